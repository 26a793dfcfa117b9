"""Controller.prepare() predicts the first L1 demotion after a quiet spell (orders.l1_likely),
so that step walks a prepared eviction order instead of scanning every session."""

from __future__ import annotations

import numpy as np

from tests.fakes import FakeClock
from tpkv.controller import Controller
from tpkv.controller.orders import l1_likely
from tpkv.protocol.digest import plan_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MoveResult, Tier


def _confirm(c: Controller, res: StepResult) -> None:
    for plan in res.plans:
        d = plan_digest(plan)
        c.commit([MoveResult(plan.epoch, r, plan.num_moves, d) for r in range(2)])


def test_l1_likely_goes_by_the_last_steps_growth() -> None:
    seen = (4, 160)  # L1 held 160 blocks at the prepare() after step 4
    assert l1_likely(170, 200, 0.9, seen, 5) == (False, (5, 170))  # 170 + 10 <= 180
    assert l1_likely(175, 200, 0.9, seen, 5) == (True, (5, 175))  # 175 + 15 > 180
    assert l1_likely(175, 200, 0.9, (3, 150), 5)[0] is False  # no growth known: 175 <= 180
    assert l1_likely(181, 200, 0.9, (3, 150), 5)[0] is True
    assert l1_likely(170, 200, 0.9, (4, 190), 5)[0] is False  # shrank: counts as 0


def test_the_first_l1_demotion_of_a_cycle_walks_a_prepared_order(make_config) -> None:
    """Two sessions grow a block each per step (a new pair every 20 steps; the last pair turns
    cold) in an L1 that drains from 90% to 50% of 200 slots: a demotion about every 40 steps,
    longer than a cached order lives (ORDER_TTL). With prepare() between steps, only the very
    first demotion scans (nothing was asked of L1 before it); each later one finds L1's order
    prepared a step ahead. (Before l1_likely, each cycle's first demotion scanned: the step
    before it had not asked L1.)"""
    c = Controller(make_config(l1=200, l2=400, l3=0, l1_marks=(0.9, 0.5)), FakeClock())
    cold = [f"c{i}" for i in range(40)]
    for n in cold:
        c.open_session(n, 16)  # 4 blocks each: 160 of L1's 200 slots
    _confirm(c, c.schedule(cold, np.zeros(len(cold), dtype=np.int64)))
    demotions = 0
    for step in range(150):
        if step % 20 == 0:
            hot = [f"h{step}a", f"h{step}b"]
            for n in hot:
                c.open_session(n, 4)
        c.prepare()
        before = dict(c.order_rebuilds)
        res = c.schedule(hot, np.full(2, 4, dtype=np.int64))
        _confirm(c, res)
        if any((p.dst_tier == Tier.DRAM).any() and (p.src_tier == Tier.HBM).any()
               for p in res.plans):
            demotions += 1
            if demotions > 1 and c.order_rebuilds != before:  # a cycle's first demotion
                assert c.order_rebuilds.get("scanned", 0) == before.get("scanned", 0)
    assert demotions >= 3
    assert c.order_rebuilds.get("scanned", 0) == 1
    assert c.order_rebuilds.get("prepared", 0) >= 2


def test_the_first_l2_spill_of_a_cycle_walks_a_prepared_order(make_config) -> None:
    """The same workload over 300 steps with L3, an L2 of 400 slots draining from 90% to 50%
    and 64 moves a step: L1 demotes every ~40 steps, and every few demotions L2 spills. With
    prepare() between steps only the first L1 and the first L2 order scan: L2's is prepared
    in the step after an L1 demotion (orders.likely_tiers), and the larger ask of a later
    step finds a prefix sized by the move budget. (Before, every L2 cycle's first spill
    scanned, as did an ask larger than the last: 4 scans.)"""
    c = Controller(make_config(l1=200, l2=400, l3=4000, l1_marks=(0.9, 0.5),
                               l2_marks=(0.9, 0.5), max_moves_per_step=64), FakeClock())
    cold = [f"c{i}" for i in range(40)]
    for n in cold:
        c.open_session(n, 16)
    _confirm(c, c.schedule(cold, np.zeros(len(cold), dtype=np.int64)))
    spills = 0
    for step in range(300):
        if step % 20 == 0:
            hot = [f"h{step}a", f"h{step}b"]
            for n in hot:
                c.open_session(n, 4)
        c.prepare()
        res = c.schedule(hot, np.full(2, 4, dtype=np.int64))
        _confirm(c, res)
        spills += any((p.dst_tier == Tier.SSD).any() for p in res.plans)
    assert spills >= 3
    assert c.order_rebuilds.get("scanned", 0) == 2
    assert c.order_rebuilds.get("prepared", 0) >= 8
