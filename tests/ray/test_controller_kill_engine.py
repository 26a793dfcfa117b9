"""The controller actor killed twice mid-run under the engine: it restarts, the runtime rebuilds
it from the rank's slot map and the L3 manifests, and the tokens equal a run with no fault."""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.engine_run import drive, tiny_model_and_reference, tiny_tiers


@pytest.mark.timeout(240)
def test_tokens_after_two_controller_kills_equal_a_run_without_fault(ray_cluster, tmp_path,
                                                                      monkeypatch):
    import ray

    import tpkv
    from tpkv.models.tiered import TieredEngine

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model, want = tiny_model_and_reference()
    rt = tpkv.init(tiny_tiers(model, str(tmp_path / "l3")), controller="ray", device="cpu")
    handle = rt.controller.handle
    try:
        engine = TieredEngine(rt, model, report_prefill=False).engine
        schedule, calls = engine.schedule, [0]

        def schedule_with_kills(session_ids: Any, num_new_tokens: Any) -> Any:
            calls[0] += 1
            if calls[0] in (12, 30):  # mid-turn, with sessions on L2 and L3
                ray.kill(handle, no_restart=False)
            return schedule(session_ids, num_new_tokens)

        engine.schedule = schedule_with_kills
        got = drive(engine)
        snap = rt.controller.snapshot()
    finally:
        rt.close()
        ray.kill(handle, no_restart=True)
    assert rt.num_rebuilds == 2 and snap["restarts"] == 2
    assert snap["recovery"]["from_manifests"] > 0  # the second rebuild found sessions in L3
    assert got == want
