"""Controller.capture: a copy taken on the controller's loop, rendered elsewhere into exactly the
snapshot the controller had when it was taken, whatever the controller does meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
from typing import Any

import numpy as np
import pytest

from tests.unit.test_dashboard_load import OwnerLoop, get
from tpkv.controller import Controller, SlotMapReplica
from tpkv.controller.capture import Capture, capture
from tpkv.controller.dashboard import DashboardServer, Recorder, ServerThread
from tpkv.controller.policy import heat
from tpkv.controller.sessions import CHOICE_NAMES
from tpkv.controller.snapshot import render
from tpkv.controller.table import PIN_EXPLICIT
from tpkv.protocol.plan import Tier

pytestmark = pytest.mark.timeout(60)


def reference_session(ctl: Controller, s: int) -> dict[str, Any]:
    """One session's row as snapshot() made it before the split: a Python loop per session,
    reading the controller's arrays directly (the oracle the vectorized render must match)."""
    T, S, pol = ctl.table, ctl.sessions, ctl.config.policy
    rows = S.rows(s)
    last = int(S.run_hist[0, s])
    idle = ctl.tick - last if last >= 0 else None
    mean_attn = float(S.attn_sum[s]) / max(len(rows), 1)
    h = float(heat(np.array([mean_attn]), np.array([idle if idle is not None else ctl.tick]),
                   pol.w_attn, pol.w_recency)[0])

    def num(x: float) -> float | None:
        return None if not math.isfinite(x) else round(float(x), 9)

    c = S.counts[:, s]
    return {
        "session": S.name(s), "tokens": int(S.tokens[s]), "pending_tokens": int(S.pending[s]),
        "blocks": len(rows), "tiers": {"L1": int(c[1]), "L2": int(c[2]), "L3": int(c[3]),
                                       "none": int(c[0])},
        "heat": num(h), "mean_attention": num(mean_attn), "last_run_tick": last,
        "ticks_idle": idle, "runs": int(S.runs[s]), "pins": [list(r) for r in S.pins.get(s, [])],
        "pinned_blocks": int(((T.pinned[rows] & PIN_EXPLICIT) != 0).sum()),
        "auto_pinned_blocks": int(((T.tier[rows] == Tier.HBM)
                                   & (T.attn[rows] >= ctl.pin_threshold)).sum()),
        "in_flight": int(T.in_flight[rows].sum()),
        "cost": {"choice": CHOICE_NAMES[int(S.choice[s])], "load_s": num(float(S.load_s[s])),
                 "recompute_s": num(float(S.recompute_s[s]))}}


class Busy:
    """A controller with sessions in every tier (and none), pins, attention, a plan in flight,
    a rebuild summary, run by two replicas that apply and confirm its steps."""

    def __init__(self, config: Any, clock: Any) -> None:
        self.c = Controller(config, clock, check_invariants=True)
        self.clock = clock
        self.reps = [SlotMapReplica(r, 16, 32) for r in range(2)]
        for r in range(2):
            self.c.register_rank(r, config.geometry, host=f"host{r}")

    def step(self, batch: list[str], commit: bool = True) -> None:
        res = self.c.schedule(batch, [1] * len(batch))
        reports = [rep.apply_step(res) for rep in self.reps]
        self.unconfirmed = [[rep[i] for rep in reports] for i in range(len(res.plans))]
        if commit:
            self.confirm()
        self.clock.advance(0.5)

    def confirm(self) -> None:
        for results in self.unconfirmed:
            assert self.c.commit(results).committed
        self.unconfirmed = []


@pytest.fixture
def busy(make_config: Any, fake_clock: Any) -> Busy:
    b = Busy(make_config(), fake_clock)
    names = [f"s{i}" for i in range(12)]
    for i, name in enumerate(names):
        b.c.open_session(name, 6 + 2 * i)
    for _ in range(3):
        for i in range(0, len(names), 2):
            b.step(names[i:i + 2])
    b.c.pin("s11", 0, 2)
    b.c.report_attention("s10", [0.5, 2.0, 0.25])
    b.c.report_attention("s11", [3.0])
    b.c.recovery = {"at_tick": 1, "ranks": [0, 1]}
    assert b.c.mark_lost(b.c.session_blocks("s3")["block_ids"][:2]) == 2  # in no tier now
    b.c.open_session("never-run", 8)
    b.step(["s0", "s1"], commit=False)  # its plan stays pending: blocks in flight
    return b


def test_sessions_are_in_every_tier(busy: Busy) -> None:
    snap = busy.c.snapshot()
    tiers = snap["tiers"]
    assert min(tiers[t]["used"] for t in ("L1", "L2", "L3")) > 0 < tiers["none"]["blocks"], tiers
    rows = snap["sessions"]
    for key in ("in_flight", "pinned_blocks", "auto_pinned_blocks", "pins", "ticks_idle"):
        assert any(s[key] for s in rows), key
    assert any(s["ticks_idle"] is None for s in rows)  # never run
    assert sum(1 for s in rows if sum(s["tiers"].values()) > max(s["tiers"].values())) > 0


@pytest.mark.parametrize("max_sessions", [256, 5, 0])
def test_render_of_a_capture_is_the_snapshot(busy: Busy, max_sessions: int) -> None:
    c = busy.c
    S = c.sessions
    open_idx = S.open_indices()
    order = open_idx[np.argsort(-S.run_hist[0, open_idx].astype(np.int64), kind="stable")]
    expected = [reference_session(c, int(s)) for s in order[:max_sessions]]
    snap = render(capture(c, max_sessions))
    assert snap["sessions"] == expected
    assert snap == c.snapshot(max_sessions)
    assert json.dumps(snap, allow_nan=False) == json.dumps(c.snapshot(max_sessions),
                                                            allow_nan=False)


def test_a_capture_does_not_change_with_the_controller(busy: Busy) -> None:
    c = busy.c
    cap = c.capture()
    before = json.loads(json.dumps(c.snapshot()))
    blocks_before = {name: cap.blocks(name) for name in ("s0", "s10", "never-run")}
    # the controller goes on: commits, new steps, a closed session, attention, a new rebuild
    assert c.pending
    busy.confirm()
    busy.step(["s3", "s4"])
    c.close_session("s6")
    c.report_attention("s0", [5.0])
    c.pin("s2", 0, 1)
    assert c.recovery is not None
    c.recovery["at_tick"] = 99
    c.events.append({"tick": 0, "kind": "later"})
    c.latency_us.append(1e9)
    after = cap.snapshot()
    assert json.loads(json.dumps(after)) == before
    assert json.loads(json.dumps(c.snapshot())) != before  # it did change meanwhile
    for name, old in blocks_before.items():
        new = cap.blocks(name)
        assert np.array_equal(new["tier_code"], old["tier_code"])
        assert np.array_equal(new["heat"], old["heat"])


def test_capture_blocks_are_session_blocks_tier_and_heat(busy: Busy) -> None:
    c = busy.c
    cap = c.capture()
    code = {"none": 0, "L1": 1, "L2": 2, "L3": 3}
    for s in cap.snapshot()["sessions"]:
        name = s["session"]
        got = cap.blocks(name)
        want = c.session_blocks(name)  # folds the runs into the table, as before
        assert got["tier_code"].tolist() == [code[t] for t in want["tier"]]
        assert got["heat"].tolist() == pytest.approx(want["heat"], rel=1e-12, abs=0)
    with pytest.raises(LookupError):
        cap.blocks("no-such-session")


class Seen:
    """Wraps Controller.capture and the Capture it gives, noting the threads each runs on."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.threads: dict[str, set[int]] = {"capture": set(), "snapshot": set(),
                                             "blocks": set()}
        self.captures = 0

    def __call__(self) -> Capture:
        self.threads["capture"].add(threading.get_ident())
        self.captures += 1
        cap = self.ctl.capture()
        seen = self

        class Watched(Capture):
            def snapshot(self) -> dict[str, Any]:
                seen.threads["snapshot"].add(threading.get_ident())
                return super().snapshot()

            def blocks(self, session_id: str) -> dict[str, Any]:
                seen.threads["blocks"].add(threading.get_ident())
                return super().blocks(session_id)

        return Watched(**{f.name: getattr(cap, f.name) for f in dataclasses.fields(cap)})


def test_only_the_capture_runs_on_the_controllers_loop(busy: Busy) -> None:
    c = busy.c
    seen = Seen(c)
    owner = OwnerLoop()
    g = c.config.geometry
    rec = Recorder(g.block_bytes * g.tp_size, c.now_s, window_s=60, interval_s=1)
    rec.sample()

    def forbidden(*args: Any) -> Any:
        raise AssertionError("snapshot_fn/blocks_fn called though capture_fn is given")

    server = DashboardServer(forbidden, blocks_fn=forbidden, capture_fn=seen, recorder=rec,
                             port=0, sample_interval_s=None, cache_s=30.0,
                             owner_loop=owner.loop)
    try:
        with ServerThread(server) as t:
            status, headers, body = get(t.server.port, "/api/snapshot")
            mstatus, _, text = get(t.server.port, "/metrics")
            serving = t._thread.ident
    finally:
        owner.close()
    assert status == mstatus == 200
    data = json.loads(body)
    derived = data.pop("dashboard")
    assert data == json.loads(json.dumps(c.snapshot()))  # the fake clock stands still
    assert derived["heatmap"]["sessions"] == [s["session"] for s in data["sessions"]]
    assert all(derived["heatmap"]["exact"])
    assert seen.captures == 1 and seen.threads["capture"] == {owner.ident}
    assert seen.threads["snapshot"] == seen.threads["blocks"] == {serving}
    assert serving != owner.ident
    hold = derived["snapshot_hold_s"]
    assert 0 < hold < 5
    line = next(x for x in text.decode().splitlines()
                if x.startswith("tpkv_dashboard_snapshot_hold_seconds "))
    assert float(line.split()[1]) == pytest.approx(hold)


def test_frozen_recorder_keeps_its_views(busy: Busy) -> None:
    c = busy.c
    g = c.config.geometry
    rec = Recorder(g.block_bytes * g.tp_size, c.now_s, window_s=60, interval_s=1)
    rec.sample()
    busy.clock.advance(1.0)
    rec.moves["L1->L2"] += 3
    rec.on_resync(4, 10)
    rec.sample()
    frozen = rec.frozen()
    traffic, consistency = frozen.traffic(), frozen.consistency({"0": "a"})
    now = frozen.clock()
    busy.clock.advance(1.0)
    rec.moves["L2->L3"] += 7
    rec.on_resync(5, 11)
    rec.sample()
    assert frozen.traffic() == traffic and frozen.consistency({"0": "a"}) == consistency
    assert frozen.clock() == now != rec.clock()
    assert rec.traffic() != traffic


def test_actor_style_payload_runs_off_the_loop(busy: Busy) -> None:
    """DashboardServer.capture on the owner, the returned callable anywhere: same payload as
    payload() built in one go."""
    c = busy.c
    server = DashboardServer(c.snapshot, blocks_fn=c.session_blocks, capture_fn=c.capture,
                             port=0, sample_interval_s=None)
    make = server.capture(heatmap=False)
    out: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: out.append(make()))
    t.start()
    t.join(10)
    assert out and out[0] == server.payload(heatmap=False)
    assert asyncio.iscoroutinefunction(server.frame)
