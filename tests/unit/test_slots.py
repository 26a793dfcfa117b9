"""Slot accounting of the pools: property tests against a set model, and typed misuse errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkv.errors import SlotError, TierFullError
from tpkv.workers.slots import SlotAllocator


def test_alloc_until_full_then_typed_error():
    a = SlotAllocator(8, "L2")
    got = a.alloc(5)
    assert sorted(got.tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(TierFullError, match="L2 needs 4 slots, 3 free of 8"):
        a.alloc(4)
    assert a.num_free == 3  # nothing taken by the failed call
    a.check_integrity()


def test_double_free_and_out_of_range_leave_state_unchanged():
    a = SlotAllocator(4, "L1")
    a.alloc(2)
    with pytest.raises(SlotError, match="double free of slots \\[3\\]"):
        a.free(np.array([0, 3]))
    with pytest.raises(SlotError, match="outside 0..3"):
        a.free(np.array([9]))
    with pytest.raises(SlotError, match="listed twice"):
        a.free(np.array([1, 1]))
    assert a.num_used == 2 and a.is_used(np.array([0, 1])).all()
    a.check_integrity()


def test_take_specific_slots():
    a = SlotAllocator(6, "L1")
    a.take(np.array([5, 2]))
    assert sorted(a.used_slots().tolist()) == [2, 5]
    with pytest.raises(SlotError, match="already in use: \\[5\\]"):
        a.take(np.array([5]))
    assert set(a.alloc(4).tolist()) == {0, 1, 3, 4}
    a.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "take"]), st.integers(0, 40)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), ops, st.booleans())
def test_matches_set_model(num_slots, sequence, check_each):
    """Against a set; with check_each off, take() leaves the free stack stale across the
    following frees and allocs (check_integrity rebuilds it, so it runs only at the end)."""
    a = SlotAllocator(num_slots, "L2")
    used: set[int] = set()
    rng = np.random.default_rng(num_slots)
    for op, k in sequence:
        if op == "alloc":
            if k > num_slots - len(used):
                with pytest.raises(TierFullError):
                    a.alloc(k)
            else:
                got = a.alloc(k).tolist()
                assert len(set(got)) == k and not used & set(got)
                used |= set(got)
        elif op == "free" and used:
            pick = rng.choice(sorted(used), size=min(k, len(used)), replace=False)
            a.free(pick)
            used -= set(pick.tolist())
        elif op == "take":
            free = sorted(set(range(num_slots)) - used)
            pick = free[: min(k, len(free))]
            a.take(np.array(pick, dtype=np.int64))
            used |= set(pick)
        assert set(a.used_slots().tolist()) == used
        assert a.num_free == num_slots - len(used)
        if check_each:
            a.check_integrity()
    a.check_integrity()
