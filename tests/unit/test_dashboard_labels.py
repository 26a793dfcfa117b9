"""What the page says in words: geometry, rates, tier accounting, idle, the kept last state."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from tpkv.config import KvGeometry
from tpkv.controller.dashboard import DashboardServer, idle, labels
from tpkv.controller.dashboard.demo import DemoState, build_demo, step

pytestmark = pytest.mark.timeout(120)


def served(state: DemoState, server: DashboardServer | None = None) -> tuple[
        DashboardServer, dict[str, Any]]:
    """One frame as /api/snapshot serves it (the actor's path: capture, then render)."""
    if server is None:
        g = state.ctl.config.geometry
        server = DashboardServer(state.ctl.snapshot, recorder=state.recorder, port=0,
                                 capture_fn=state.ctl.capture, sample_interval_s=None,
                                 info={"geometry": dataclasses.asdict(g),
                                       "block_bytes": g.block_bytes, "tp_size": g.tp_size})
    frame = server.capture_frame()()
    assert frame.error is None, frame.error
    return server, json.loads(frame.snapshot_json)


@pytest.fixture()
def demo(tmp_path: Any) -> DemoState:
    return build_demo(str(tmp_path))


def test_geometry_reads_as_text() -> None:
    g = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                   block_tokens=16, tp_size=2)
    text = labels.geometry_text({"geometry": dataclasses.asdict(g), "block_bytes": g.block_bytes})
    # 2 (K, V) x 32 layers x 4 heads per rank x 128 x 16 tokens x 2 bytes = 1 MiB
    assert g.block_bytes == 1 << 20
    assert text == ("32 layers x 8 KV heads x 128 dims, bfloat16, 16 tokens/block, TP 2: "
                    "1 MiB per block per rank (K and V)")
    assert labels.geometry_text({}) is None


def test_small_rates_keep_their_digits() -> None:
    # the old axis printed 0.0025 GB/s steps as 0.00 and 0.01: three digits in a unit that fits
    assert [labels.rate(x, "B/s") for x in (2.5e6, 7.5e6, 1.0e7, 2.2e9, 512.0)] == [
        "2.5 MB/s", "7.5 MB/s", "10 MB/s", "2.2 GB/s", "512 B/s"]
    assert labels.rate(1234.0, "tokens/s") == "1.23 k tokens/s"
    assert labels.sig3(0.0025) == "0.0025" and labels.sig3(12.345) == "12.3"


def test_rates_say_configured_until_measured(demo: DemoState) -> None:
    _, d = served(demo)
    rates = d["dashboard"]["rates"]
    pol = demo.ctl.config.policy
    # the demo reports prefills, and no plan moves 1 MiB: L2->L1 and L3->L2 stay configured
    assert rates["prefill"]["measured"] and rates["prefill"]["samples"] == 15
    assert rates["prefill"]["text"].endswith("(measured, 15 samples)")
    for name, start in (("h2d", pol.h2d_bytes_per_s), ("ssd_read", pol.ssd_read_bytes_per_s)):
        assert not rates[name]["measured"] and rates[name]["value"] == start
        assert rates[name]["text"] == f"{labels.rate(start, 'B/s')} (configured, not yet measured)"


def test_l3_slots_add_up_after_every_session_closed(demo: DemoState) -> None:
    ctl = demo.ctl
    for s in [s["session"] for s in ctl.snapshot()["sessions"]]:
        ctl.close_session(s)
    _, d = served(demo)
    t = d["tiers"]["L3"]
    # as the issue saw it: no block in L3, and free short of the slots (here 861 of 3600)
    assert t["used"] == 0 and t["free"] < t["slots"]
    assert t["used"] + t["free"] + t["other_records"] + t["held"] == t["slots"]
    assert t["held"] > 0  # the closed sessions' room, until the ranks apply the next step
    acc = d["dashboard"]["accounting"]
    for name in ("L1", "L2", "L3"):
        assert acc[name]["rest"] == 0
        assert sum(p["blocks"] for p in acc[name]["parts"]) == acc[name]["slots"]
    assert acc["L3"]["text"] == f"0 used + {t['free']} free + {t['held']} held = {t['slots']} slots"


def test_idle_after_ten_seconds_without_a_step(demo: DemoState) -> None:
    server, d = served(demo)
    act = d["dashboard"]["activity"]
    assert act["state"] == "live" and act["idle_s"] < idle.IDLE_AFTER_S
    demo.clock.advance(idle.IDLE_AFTER_S + 5)
    _, d = served(demo, server)
    act = d["dashboard"]["activity"]
    assert act["state"] == "idle" and act["idle_s"] >= idle.IDLE_AFTER_S + 5
    # the clock time of the last step: the snapshot's time less the idle time
    assert act["last_step_unix_s"] == pytest.approx(
        d["dashboard"]["snapshot_unix_s"] - act["idle_s"], abs=2e-3)
    assert idle.activity({"uptime_s": 3.0, "last_step_s": None}, 0.0)["state"] == "waiting"


def test_last_sessions_are_kept_once_all_closed(demo: DemoState) -> None:
    server, before = served(demo)
    assert before["num_sessions"] > 20 and before["dashboard"]["last_active"] is None
    names = [s["session"] for s in before["sessions"]]
    for name in names[1:]:  # the workload ends: its sessions close one by one
        demo.ctl.close_session(name)
    _, last_one = served(demo, server)
    assert last_one["num_sessions"] == 1 and last_one["dashboard"]["last_active"] is None
    demo.ctl.close_session(names[0])
    _, after = served(demo, server)
    assert after["num_sessions"] == 0 and after["sessions"] == []
    kept = after["dashboard"]["last_active"]
    assert [s["session"] for s in kept["sessions"]] == names
    assert kept["num_sessions"] == before["num_sessions"] and kept["tick"] == before["tick"]
    assert kept["heatmap"]["sessions"] == before["dashboard"]["heatmap"]["sessions"]
    assert kept["t_unix_s"] == before["dashboard"]["snapshot_unix_s"]
    # a new session: the page shows the present again
    demo.ctl.open_session("back-again", 64)
    step(demo, ["back-again"], [4], {}, np.random.default_rng(0))
    _, again = served(demo, server)
    assert again["num_sessions"] == 1 and again["dashboard"]["last_active"] is None


def test_kept_state_is_the_fullest_of_the_last_minute() -> None:
    keep = idle.LastActive(window_s=60.0)

    def frame(n: int, t: float) -> dict[str, Any]:
        out = {"num_sessions": n, "tick": int(t), "sessions": [{"session": f"s{i}"}
                                                               for i in range(n)]}
        keep.finish(out, t)
        return out

    frame(5, 1000.0)
    frame(3, 1030.0)  # fewer, within the minute: the 5 stay kept
    assert frame(0, 1031.0)["dashboard"]["last_active"]["num_sessions"] == 5
    frame(2, 1070.0)  # the 5 are older than a minute now: the 2 replace them
    kept = frame(0, 1071.0)["dashboard"]["last_active"]
    assert (kept["num_sessions"], kept["tick"], kept["t_unix_s"]) == (2, 1070, 1070.0)
