"""`tpkv demo` end to end at TP 2 on CPU: ranks agree and sessions really go to L3 and back."""

import pytest

from tpkv.launch import demo as demo_mod


@pytest.mark.timeout(240)
def test_demo_runs_tp2_through_all_tiers(ray_cluster, monkeypatch, capsys):
    summaries: list[dict] = []
    monkeypatch.setattr(demo_mod, "print_summary", lambda out, console: summaries.append(out))
    assert demo_mod.demo(tp=2, seconds=60.0, model="tiny", sessions=24, keep_serving=True,
                         serve_s=0.5) == 0
    out = summaries[0]
    assert out["world"] == 2 and out["turns"] > 24
    assert out["moves"]["l1_l2"] > 0 and out["moves"]["l2_l3"] > 0 and out["moves"]["l3_l2"] > 0
    # and back into L1: in a returning turn's own step, or in the steps before it (the turns in
    # line come up ahead, so whether any resume step itself loads depends on timing)
    assert out["moves"]["l2_l1"] > 0
    printed = capsys.readouterr().out
    assert "agree on every turn and move: True" in printed
    assert "dashboard: http://127.0.0.1:" in printed and "--keep-serving" in printed
    assert "step " in printed and "L1 " in printed  # the progress bar's live figures
    assert out["dashboard"].startswith("http://127.0.0.1:")
