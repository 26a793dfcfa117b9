"""Which in-flight L1 -> L2 batch a copy into L1 (or a compute write) must wait for."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tpkv.workers.executor import PlanExecutor, _Demotion, _meets


@dataclass
class _Handle:
    finished: bool = False

    def done(self) -> bool:
        return self.finished


def _executor(*batches: tuple[list[int], list[int], bool]) -> tuple[PlanExecutor, list[_Handle]]:
    ex = PlanExecutor.__new__(PlanExecutor)  # only the demotion list is used here
    handles = [_Handle(done) for _, _, done in batches]
    ex.demotions = deque(_Demotion(h, np.sort(np.asarray(l1)), np.sort(np.asarray(l2)))
                         for h, (l1, l2, _) in zip(handles, batches))
    return ex, handles


def test_meets_finds_any_common_slot():
    assert _meets(np.array([2, 5, 9]), np.array([7, 9]))
    assert not _meets(np.array([2, 5, 9]), np.array([0, 3, 10]))
    assert not _meets(np.array([], dtype=np.int64), np.array([1]))
    assert not _meets(np.array([1]), np.array([], dtype=np.int64))


def test_a_copy_into_free_slots_waits_for_no_demotion():
    ex, _ = _executor(([10, 11, 12], [0, 1, 2], False))
    assert ex._demotion_into(np.array([20, 21]), np.array([5, 6])) is None


def test_the_newest_overlapping_demotion_is_the_one_waited_for():
    ex, h = _executor(([10, 11], [0, 1], False), ([12, 13], [2, 3], False),
                      ([30], [9], False))
    assert ex._demotion_into(np.array([11, 40]), None) is h[0]
    assert ex._demotion_into(np.array([11, 13]), None) is h[1]  # the d2h stream is in order
    assert ex._demotion_into(np.array([50]), np.array([9])) is h[2]  # reads an L2 slot it writes
    assert ex._demotion_into(np.array([50]), None) is None


def test_finished_demotions_are_forgotten_oldest_first():
    ex, h = _executor(([10], [0], True), ([11], [1], False))
    assert ex._demotion_into(np.array([10]), None) is None
    assert len(ex.demotions) == 1 and ex.demotions[0].handle is h[1]


def test_a_plan_issues_first_the_direction_the_next_plan_waits_for() -> None:
    """Demotions first when the step's next plan promotes into the L1 slots they empty (that
    copy waits for them), else promotions first (a resume waits for those)."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.types import MovePlan, Tier

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    calls: list[str] = []
    for name in ("h2d", "d2h"):
        real = getattr(ex.engine, name)
        setattr(ex.engine, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    H, D = int(Tier.HBM), int(Tier.DRAM)

    def plan(epoch: int, moves: list[tuple[int, int, int, int, int]]) -> MovePlan:
        b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
        return MovePlan(epoch, b, st, ss, dt, ds, np.zeros(len(moves)), b, ("s",))

    # plan 1: block 0 L1 slot 0 -> L2 slot 0, block 1 L2 slot 1 -> L1 slot 1
    first = plan(1, [(0, H, 0, D, 0), (1, D, 1, H, 1)])
    ok = np.ones(2, dtype=bool)
    into_emptied = plan(2, [(2, D, 2, H, 0)])  # into L1 slot 0, which plan 1 empties
    elsewhere = plan(2, [(2, D, 2, H, 5)])
    ex.run(first, ok, into_emptied)
    assert calls == ["d2h", "h2d"]
    calls.clear()
    ex.run(first, ok, elsewhere)
    assert calls == ["h2d", "d2h"]
    calls.clear()
    ex.run(first, ok, None)
    assert calls == ["h2d", "d2h"]
