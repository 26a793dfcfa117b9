"""SlotMirror.check: a move is applied only from where this rank holds the block, into a pooled
slot that is free here and that no other move of the plan names."""

from __future__ import annotations

import numpy as np

from tpkv.types import MovePlan, Tier
from tpkv.workers.mirror import SlotMirror, _named_once
from tpkv.workers.slots import SlotAllocator

H, D = int(Tier.HBM), int(Tier.DRAM)


def test_check_refuses_shared_taken_and_outside_destinations():
    m = SlotMirror(SlotAllocator(8, "L1"), SlotAllocator(8, "L2"))
    m.put(np.array([1, 2, 3, 5, 6, 7]), np.array([H, H, H, H, H, D]),
          np.array([0, 1, 2, 3, 4, 6]), ["s"] * 6, np.arange(6))
    # 1 and 2 both into L2 slot 5; 3 into L2 slot 6 (block 7 is there); 5 into 7 (free);
    # 6 into L2 slot 99 (no such slot); 7 from L1 slot 0 (it is in L2 slot 6 here)
    plan = MovePlan(1, [1, 2, 3, 5, 6, 7], [H, H, H, H, H, H], [0, 1, 2, 3, 4, 0],
                    [D, D, D, D, D, D], [5, 5, 6, 7, 99, 0], [0] * 6, np.arange(6), ("s",))
    assert m.check(plan).tolist() == [False, False, False, True, False, False]


def test_named_once_matches_counting():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 50, 800):
        v = rng.integers(0, max(1, n), n)
        want = np.array([np.count_nonzero(v == x) == 1 for x in v], dtype=bool)
        assert np.array_equal(_named_once(v), want)
