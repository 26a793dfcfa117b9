"""Property tests over random operation sequences, and hysteresis under steady load."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeClock
from tpkv.controller import Controller, SlotMapReplica
from tpkv.errors import TpkvError
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.protocol.wire import encode

NAMES = [f"s{i}" for i in range(8)]

step_op = st.tuples(st.just("step"), st.lists(st.integers(0, 7), min_size=1, max_size=4,
                                             unique=True),
                   st.integers(0, 9), st.lists(st.integers(0, 7), max_size=2, unique=True))
op = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 7), st.integers(0, 24)),
    st.tuples(st.just("close"), st.integers(0, 7)),
    step_op, step_op, step_op, step_op,
    st.tuples(st.just("attn"), st.integers(0, 7), st.floats(0, 2)),
    st.tuples(st.just("pin"), st.integers(0, 7), st.integers(0, 3)),
    st.tuples(st.just("unpin"), st.integers(0, 7)),
    st.tuples(st.just("wait"), st.floats(0, 40)),
    st.tuples(st.just("miss"), st.integers(0, 100)),
    st.tuples(st.just("lag"), st.integers(0, 3)),
    st.tuples(st.just("bad"), st.integers(0, 7)),
)
configs = st.sampled_from([
    dict(l1=12, l2=10, l3=24), dict(l1=8, l2=6, l3=0), dict(l1=16, l2=12, l3=10, kind="lru"),
    dict(l1=10, l2=16, l3=40, kind="lruk", max_moves_per_step=3),
])


def check_plan(plan: MovePlan, slots: dict[int, int]) -> None:
    """Adjacent tiers only; no slot both vacated and filled, but L1 slots (a plan may promote
    into what its demotions empty: PlanBuilder.free_vacated); destinations inside the pools."""
    assert (np.abs(plan.dst_tier.astype(int) - plan.src_tier.astype(int)) == 1).all()
    for tier, size in slots.items():
        src = set(plan.src_slot[plan.src_tier == tier].tolist())
        dst = plan.dst_slot[plan.dst_tier == tier]
        if tier != Tier.HBM:
            assert not src & set(dst.tolist()), f"tier {tier}: a slot is vacated and filled"
        assert ((dst >= 0) & (dst < size)).all()
        assert len(set(dst.tolist())) == len(dst)


class World:
    """One controller, two replica workers, reports that may be delayed, a fake clock."""

    def __init__(self, cfg: dict, make_config, clock, record_events: bool = False) -> None:
        self.record_events = record_events  # hypothesis.event() works inside @given only
        cfg = dict(cfg)
        self.cfg = make_config(**cfg)
        self.clock = clock
        self.c = Controller(self.cfg, clock, check_invariants=True)
        l1, l2 = self.c.table.slots(Tier.HBM), self.c.table.slots(Tier.DRAM)
        self.slots = {int(Tier.HBM): l1, int(Tier.DRAM): l2}
        self.reps = [SlotMapReplica(r, l1, l2, self.cfg.geometry.block_tokens) for r in range(2)]
        self.unconfirmed: deque = deque()
        self.lag = 0
        self.miss_next = -1
        self.lost = False
        self.trace: list[bytes] = []
        self.l2_room: list[int] = []  # StepResult.l2_room of each step

    def state(self) -> tuple:
        m = self.c.slot_map()
        return (m["digest"], self.c.tick, self.c.next_epoch, len(self.c.pending),
                tuple(sorted(self.c.sessions.index)))

    def apply(self, o: tuple) -> None:
        c, kind = self.c, o[0]
        before = self.state()
        try:
            if kind == "open":  # the first closed name at or after the index
                free = [n for n in NAMES[o[1]:] + NAMES[:o[1]] if n not in c.sessions.index]
                c.open_session(free[0] if free else NAMES[o[1]], o[2])
            elif kind == "close":
                c.close_session(NAMES[o[1]])
            elif kind == "attn":
                s = c.sessions.index.get(NAMES[o[1]])
                if s is not None and c.sessions.nblocks(s):
                    c.report_attention(NAMES[o[1]], [o[2]] * c.sessions.nblocks(s))
            elif kind == "pin":
                c.pin(NAMES[o[1]], 0, o[2])
            elif kind == "unpin":
                c.unpin(NAMES[o[1]])
            elif kind == "wait":
                self.clock.advance(o[1])
            elif kind == "miss":
                self.miss_next = o[1]
            elif kind == "lag":
                self.lag = o[1]
            elif kind == "step":  # indices pick among open sessions (a closed one if none)
                live = sorted(c.sessions.index) or NAMES
                batch = list(dict.fromkeys(live[i % len(live)] for i in o[1]))
                upcoming = [live[i % len(live)] for i in o[3]]
                self.step(batch, o[2], [n for n in upcoming if n not in batch])
            elif kind == "bad":
                c.schedule([NAMES[o[1]], NAMES[o[1]]], [1, 1])
        except TpkvError as exc:
            assert self.state() == before, f"{type(exc).__name__} changed the table"
            self.trace.append(type(exc).__name__.encode())
        self.check()

    def step(self, batch: list[str], tokens: int, upcoming: list[str]) -> StepResult:
        res = self.c.schedule(batch, [tokens] * len(batch), {n: 1 for n in upcoming})
        d = res.to_dict()
        # the plans, drops and tables; the admission advice apart (the golden digests pin
        # the first, test_spill_pace.py checks the advice)
        self.l2_room.append(d.pop("l2_room"))
        self.trace.append(encode(d))
        if res.plans and self.record_events:
            event(f"a step with {min(len(res.plans), 2)}+ plans")
        misses: dict[int, list[int]] = {}
        for plan in res.plans:
            check_plan(plan, self.slots)
            reads = plan.block_ids[plan.src_tier == Tier.SSD]
            if self.miss_next >= 0 and len(reads):
                misses[plan.epoch] = [int(reads[self.miss_next % len(reads)])]
                self.miss_next = -1
        reports = [r.apply_step(res, misses) for r in self.reps]
        self.unconfirmed.extend(zip(*reports))
        while len(self.unconfirmed) > self.lag:
            out = self.c.commit(list(self.unconfirmed.popleft()))
            assert out.committed
            self.lost |= out.num_misses > 0  # workers hear of misses in the next step
        if not self.unconfirmed and not self.lost:
            assert self.reps[0].digest() == self.c.slot_map()["digest"]
        self.lost = False
        T = self.c.table
        if T.keep_l3:  # the controller's L3 room is what the ranks' segments hold
            on_disk = sum(self.reps[0].num_records.values())
            assert on_disk == T.used(Tier.SSD) + T.l3_other, \
                f"{on_disk} records on disk, the controller counts {T.used(Tier.SSD)} blocks " \
                f"and {T.l3_other} other records"
        return res

    def check(self) -> None:
        T = self.c.table
        for tier in (Tier.HBM, Tier.DRAM, Tier.SSD):
            assert 0 <= T.used(tier) <= T.slots(tier)
        assert sum(T.used(t) for t in (Tier.NONE, Tier.HBM, Tier.DRAM, Tier.SSD)) == (
            T.capacity - T.free_rows.top)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(configs, st.lists(op, min_size=10, max_size=60))
def test_random_operations_keep_every_invariant(make_config, fake_clock, cfg, ops):
    w = World(cfg, make_config, fake_clock, record_events=True)
    for o in ops:
        w.apply(o)


def program(seed: int, length: int = 80) -> list[tuple]:
    """A random operation sequence weighted towards steps (as a steady engine would send)."""
    rng = np.random.default_rng(seed)
    kinds = ["open", "close", "step", "step", "step", "step", "attn", "pin", "unpin", "wait",
             "miss", "lag", "bad"]
    ops: list[tuple] = []
    for kind in rng.choice(kinds, length).tolist():
        i = int(rng.integers(0, 8))
        ops.append({
            "open": ("open", i, int(rng.integers(0, 25))), "close": ("close", i),
            "step": ("step", rng.choice(8, int(rng.integers(1, 5)), replace=False).tolist(),
                     int(rng.integers(0, 10)), rng.choice(8, int(rng.integers(0, 3)),
                                                          replace=False).tolist()),
            "attn": ("attn", i, float(rng.random() * 2)), "pin": ("pin", i, int(rng.integers(4))),
            "unpin": ("unpin", i), "wait": ("wait", float(rng.random() * 40)),
            "miss": ("miss", int(rng.integers(100))), "lag": ("lag", int(rng.integers(4))),
            "bad": ("bad", i)}[kind])
    return ops


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(configs, st.integers(0, 2**32 - 1))
def test_random_programs_keep_every_invariant(make_config, fake_clock, cfg, seed):
    """Longer, step-heavy sequences than the structured strategy tends to draw."""
    w = World(cfg, make_config, fake_clock, record_events=True)
    for o in program(seed):
        w.apply(o)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(configs, st.integers(0, 2**32 - 1))
def test_identical_inputs_give_identical_plans(make_config, cfg, seed):
    runs = []
    for _ in range(2):
        w = World(cfg, make_config, FakeClock(), record_events=True)
        for o in program(seed, 60):
            w.apply(o)
        runs.append(w.trace)
    assert runs[0] == runs[1]


def test_steady_batch_settles_without_moves(make_config, fake_clock):
    w = World(dict(l1=32, l2=32, l3=64), make_config, fake_clock)
    names = NAMES[:4]
    for n in names:
        w.c.open_session(n, 8)
    moved = []
    for _ in range(60):  # 4 sessions grow from 8 to 23 tokens: 24 blocks, below high (28.8)
        before = w.c.next_epoch
        w.step(names, 0 if _ % 4 else 1, [])
        moved.append(w.c.next_epoch - before)
    assert sum(moved) == 0 and not any(w.c.draining.values())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_hysteresis_does_not_oscillate_under_rotation(make_config, fake_clock, k):
    """Sessions take turns, k per step, the next k announced: L1 fills to its high mark,
    drains to its low mark in one step, fills again. Demotion steps are as rare as the band
    allows, and nothing demoted is promoted speculatively within the cooldown."""
    slots, per_session = 64, 4
    w = World(dict(l1=slots, l2=128, l3=256, max_moves_per_step=1000), make_config, fake_clock)
    names = [f"r{i}" for i in range(40)]
    for n in names:
        w.c.open_session(n, 4 * per_session - 1)
    high, low = 0.90 * slots, math.floor(0.75 * slots)
    demote_steps: list[int] = []
    entered = np.zeros(200, dtype=np.int64)  # blocks that came into L1 per step
    used_after = np.zeros(200, dtype=np.int64)
    demoted_at: dict[str, float] = {}
    for t in range(200):
        batch = [names[(t * k + j) % len(names)] for j in range(k)]
        nxt = [names[((t + 1) * k + j) % len(names)] for j in range(k)]
        fake_clock.advance(1.0)
        res = w.step(batch, 1 if t % 8 == 0 else 0, nxt)
        used_after[t] = w.c.table.used(Tier.HBM)
        assert used_after[t] <= high
        entered[t] += len(res.fresh_block_ids)
        down = False
        for p in res.plans:
            for name, src, dst in zip((p.session_names[i] for i in p.session_idx),
                                      p.src_tier.tolist(), p.dst_tier.tolist()):
                if (src, dst) == (Tier.HBM, Tier.DRAM):
                    demoted_at[name], down = fake_clock.now, True
                elif (src, dst) == (Tier.DRAM, Tier.HBM):
                    entered[t] += 1
                    if name not in batch:  # speculative: must honour the cooldown
                        assert fake_clock.now - demoted_at.get(name, -1e9) >= 30.0
        if down:
            demote_steps.append(t)
            assert used_after[t] - len(res.fresh_block_ids) <= low  # drained to low at once
            assert not w.c.draining[Tier.HBM]
    assert len(demote_steps) >= 2
    for a, b in zip(demote_steps, demote_steps[1:]):
        # no demotion until the tier, drained at step a, would pass high again
        assert used_after[a] + entered[a + 1:b + 1].sum() > high
    assert len(demote_steps) <= entered.sum() / (high - low) + 1


def _prepared_run(cfg: dict, make_config, seed: int, mode: str, length: int = 80) -> World:
    """program(seed) with Controller.prepare() 0-2 times before each operation: never,
    as predicted, or forced on random tiers with random prefix sizes (so that prefixes often
    stop short and stale sessions matter)."""
    w = World(cfg, make_config, FakeClock())
    rng = np.random.default_rng(seed + 1)
    for o in program(seed, length):
        for _ in range(int(rng.integers(0, 3)) if mode != "never" else 0):
            if mode == "predicted":
                w.c.prepare()
            else:
                w.c.prepare(force={t: int(rng.integers(1, 60)) for t in (0, 1, 2)
                                   if rng.random() < 0.8})
        w.apply(o)
    return w


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(configs, st.integers(0, 2**32 - 1))
def test_prepare_between_operations_changes_no_result(make_config, cfg, seed):
    """Eviction orders prepared between steps give every step exactly what it gives without
    them: the same StepResults and errors, in every mode."""
    runs = [_prepared_run(cfg, make_config, seed, mode) for mode in ("never", "predicted",
                                                                      "forced")]
    assert runs[0].trace == runs[1].trace == runs[2].trace
    assert runs[0].l2_room == runs[1].l2_room == runs[2].l2_room
    assert not runs[0].c.order_rebuilds.get("prepared")
    if runs[2].c.order_rebuilds.get("prepared"):
        event("a forced prepared order was walked")
    if runs[1].c.order_rebuilds.get("prepared"):
        event("a predicted prepared order was walked")


@pytest.mark.parametrize("cfg", [dict(l1=12, l2=10, l3=24),
                                 dict(l1=16, l2=12, l3=10, kind="lru"),
                                 dict(l1=10, l2=16, l3=40, kind="lruk", max_moves_per_step=3)])
def test_prepared_orders_are_walked_and_change_nothing(make_config, cfg):
    """Fixed seeds where steps do walk prepared orders (forced and predicted), against runs
    that never prepare."""
    walked = {"predicted": 0, "forced": 0}
    for seed in range(12):
        base = _prepared_run(cfg, make_config, seed, "never", 120).trace
        for mode in walked:
            w = _prepared_run(cfg, make_config, seed, mode, 120)
            assert w.trace == base, (seed, mode)
            walked[mode] += w.c.order_rebuilds.get("prepared", 0)
    assert walked["forced"] > 0
    assert walked["predicted"] > 0


def test_prepare_is_idempotent(make_config):
    """A second prepare() before the step keeps the first's orders (and adds none); a step
    consumes them; without a step that asked a tier for victims there is nothing to do."""
    w = World(dict(l1=12, l2=10, l3=24), make_config, FakeClock())
    c = w.c
    c.prepare()
    assert c.prepared is None  # no tier was asked for victims yet
    for o in program(3, 200):
        w.apply(o)
        c.prepare()
        first = c.prepared
        if first is None:
            continue
        tiers = {t: tuple(a.copy() if isinstance(a, np.ndarray) else a for a in v)
                 for t, v in first.tiers.items()}
        c.prepare()
        assert c.prepared is first and set(first.tiers) == set(tiers)
        for t, v in tiers.items():
            for a, b in zip(v, first.tiers[t]):
                assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
    assert c.order_rebuilds.get("prepared", 0) > 0
