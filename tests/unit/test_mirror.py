"""SlotMirror.check: a move is applied only from where this rank holds the block, into a pooled
slot that is free here and that no other move of the plan names."""

from __future__ import annotations

import numpy as np

from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.mirror import SlotMirror
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


def _reference_check(m: SlotMirror, plan: MovePlan) -> np.ndarray:
    """SlotMirror.check's rules written plainly (the compiled pass must agree)."""
    tier, slot = m.where(plan.block_ids)
    ok = (tier == plan.src_tier) & ((plan.src_tier == int(Tier.SSD)) | (slot == plan.src_slot))
    for t in (D, H):
        owner = m.owner[t]
        for i in np.flatnonzero(plan.dst_tier == t).tolist():
            d = int(plan.dst_slot[i])
            named = int(np.count_nonzero((plan.dst_tier == t) & (plan.dst_slot == d)))
            emptied = t == H and bool((ok & (plan.src_tier == H) & (plan.src_slot == d)).any())
            ok[i] &= 0 <= d < len(owner) and named == 1 and (owner[d] < 0 or emptied)
    return ok


def test_check_agrees_with_its_rules_on_random_plans():
    rng = np.random.default_rng(0)
    applied = 0
    for _ in range(300):
        m = SlotMirror(SlotAllocator(10, "L1"), SlotAllocator(12, "L2"))
        ids = rng.choice(40, 14, replace=False)
        tiers = rng.choice([H, D, int(Tier.SSD)], 14)
        slots = np.where(tiers == H, rng.permutation(10 + 4)[:14] % 10,
                         rng.permutation(12 + 2)[:14] % 12)
        keep = np.ones(14, dtype=bool)  # one block a slot
        for t in (H, D):
            on = np.flatnonzero(tiers == t)
            _, first = np.unique(slots[on], return_index=True)
            drop = np.setdiff1d(np.arange(len(on)), first)
            keep[on[drop]] = False
        m.put(ids[keep], tiers[keep], np.where(tiers[keep] == int(Tier.SSD), -1, slots[keep]),
              ["s"] * int(keep.sum()), np.arange(int(keep.sum())))
        n = int(rng.integers(1, 12))
        b = rng.choice(np.concatenate([ids, [45, 46]]), n, replace=False)  # some unknown
        st = rng.choice([H, D, int(Tier.SSD)], n)
        dt = np.where(st == H, D, np.where(st == int(Tier.SSD), D, rng.choice([H, int(Tier.SSD)],
                                                                                n)))
        ss = rng.integers(-1, 12, n)
        ds = rng.integers(0, 13, n)  # some past the L1 / L2 pools
        plan = MovePlan(1, b, st, ss, dt, ds, np.zeros(n, dtype=int), np.arange(n), ("s",))
        ok = m.check(plan)
        assert ok.tolist() == _reference_check(m, plan).tolist()
        assert not m._count[0].any() and not m._count[1].any()  # scratch left zeroed
        applied += int(ok.sum())
    assert applied > 100  # the plans are not all refused


def test_check_lets_a_plan_refill_the_l1_slots_its_applied_demotions_empty():
    """PlanBuilder.free_vacated: a promotion may fill an L1 slot that a demotion of the same
    plan empties, but only one this rank applies: if the demotion is refused here (its L2 slot
    is taken), the block stays and the promotion into its slot is refused too."""
    m = SlotMirror(SlotAllocator(4, "L1"), SlotAllocator(8, "L2"))
    m.put(np.array([1, 2, 3, 4, 9]), np.array([H, H, D, D, D]), np.array([0, 1, 2, 3, 5]),
          ["s"] * 5, np.arange(5))
    # 1: L1 0 -> L2 4 (free); 2: L1 1 -> L2 5 (block 9 is there); 3: L2 2 -> L1 0 (emptied by
    # 1); 4: L2 3 -> L1 1 (block 2 stays: its demotion is refused)
    plan = MovePlan(1, [1, 2, 3, 4], [H, H, D, D], [0, 1, 2, 3], [D, D, H, H], [4, 5, 0, 1],
                    [0] * 4, np.arange(4), ("s",))
    ok = m.check(plan)
    assert ok.tolist() == [True, False, True, False]
    m.apply(plan, ok)
    assert m.where(np.array([1, 2, 3, 4]))[1].tolist() == [4, 1, 0, 3]
    # an L2 slot emptied by a promotion is never refilled in the same plan
    # (block 9 leaves L2 slot 5 for L1 slot 2; block 2 may not take L2 slot 5)
    plan = MovePlan(2, [2, 9], [H, D], [1, 5], [D, H], [5, 2], [0, 0], np.arange(2), ("s",))
    assert m.check(plan).tolist() == [False, True]
