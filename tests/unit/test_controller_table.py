"""Block table, row arena and digests: storage, ids, free lists, integrity checks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkv.controller.arena import RowArena
from tpkv.controller.slotstack import SlotStack
from tpkv.controller.table import BlockTable
from tpkv.errors import TierFullError
from tpkv.protocol.digest import plan_digest, slot_map_digest
from tpkv.protocol.plan import MovePlan, Tier


def make_table(capacity: int = 8) -> BlockTable:
    return BlockTable(l1_slots=4, l2_slots=6, l3_capacity=5, lru_k=2, capacity=capacity)


def test_slot_stack_lowest_first_and_full():
    s = SlotStack(4, "L1")
    np.testing.assert_array_equal(s.pop(3), [0, 1, 2])
    with pytest.raises(TierFullError, match="L1 needs 2 slots, 1 free of 4"):
        s.pop(2)
    s.push(np.array([1, 0]))
    np.testing.assert_array_equal(s.pop(3), [0, 1, 3])


def test_slot_stack_reusing_oldest_hands_out_slots_freed_earlier_first():
    s = SlotStack(8, "L1", reuse="oldest")
    np.testing.assert_array_equal(s.pop(6), [0, 1, 2, 3, 4, 5])  # 6, 7 stay free
    s.push(np.array([4, 2]))  # freed now: handed out after 6 and 7, in ascending order
    s.push(np.array([0]))  # freed later still: last
    np.testing.assert_array_equal(s.pop(3), [6, 7, 2])
    np.testing.assert_array_equal(s.pop(2), [4, 0])
    with pytest.raises(TierFullError, match="L1 needs 1 slots, 0 free of 8"):
        s.pop(1)
    s.push(np.array([5, 3]))  # into an empty stack: as "newest" would
    np.testing.assert_array_equal(s.pop(2), [3, 5])


def test_rows_ids_generations_and_release():
    t = make_table()
    rows = t.alloc_rows(np.array([0, 0, 1]), np.array([0, 1, 0]), tick=5, runs=np.ones(3),
                        l1_slots=t.free[Tier.HBM].pop(3))
    ids = t.ids(rows)
    got, ok = t.rows_of(ids)
    assert ok.all() and (got == rows).all()
    t.release_rows(rows[:1])
    _, ok = t.rows_of(ids)
    assert ok.tolist() == [False, True, True]  # the released id is dead for good
    again = t.alloc_rows(np.array([2]), np.array([0]), tick=6, runs=np.ones(1),
                         l1_slots=t.free[Tier.HBM].pop(1))
    assert again[0] == rows[0] and t.ids(again)[0] != ids[0]  # row reused, id not
    t.set_tier(again, Tier.DRAM, t.free[Tier.DRAM].pop(1), free_src=True)
    t.check_integrity()
    assert t.used(Tier.HBM) == 2 and t.num_free(Tier.HBM) == 2 and t.used(Tier.DRAM) == 1


def test_table_grows_and_limits():
    t = BlockTable(l1_slots=16, l2_slots=6, l3_capacity=5, lru_k=2, capacity=4)
    t.ensure_rows(10, limit=100)
    assert t.capacity >= 10
    rows = t.alloc_rows(np.zeros(10, np.int64), np.arange(10), tick=1, runs=np.ones(10),
                        l1_slots=t.free[Tier.HBM].pop(10))
    assert sorted(rows.tolist()) == list(range(10))
    t.check_integrity()
    with pytest.raises(TierFullError, match="at most 12 tracked"):
        t.ensure_rows(t.free_rows.top + 5, limit=12)


def test_integrity_catches_corruption():
    t = make_table()
    rows = t.alloc_rows(np.array([0, 0]), np.array([0, 1]), tick=1, runs=np.ones(2),
                        l1_slots=t.free[Tier.HBM].pop(2))
    t.check_integrity()
    t.slot[rows[1]] = t.slot[rows[0]]  # two blocks in one slot
    with pytest.raises(AssertionError, match="share a slot"):
        t.check_integrity()


def test_integrity_sees_held_back_slots():
    t = make_table()
    rows = t.alloc_rows(np.array([0]), np.array([0]), tick=1, runs=np.ones(1),
                        l1_slots=t.free[Tier.HBM].pop(1))
    t.set_tier(rows, Tier.DRAM, t.free[Tier.DRAM].pop(1), free_src=False)  # L1 slot held back
    t.check_integrity(settled=False)
    with pytest.raises(AssertionError, match="neither used nor free"):
        t.check_integrity()


def test_bytes_per_block_budget():
    t = BlockTable(16, 16, 16, lru_k=2, capacity=1 << 16)
    assert t.nbytes() / t.capacity <= 48


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), max_size=80),
       st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
def test_arena_matches_python_lists(appends, batch):
    arena = RowArena(6, capacity=8)
    ref: list[list[int]] = [[] for _ in range(6)]
    next_row = 0
    for s, n in appends:
        rows = np.arange(next_row, next_row + n, dtype=np.int32)
        next_row += n
        arena.append(np.array([s]), np.array([n]), rows)
        ref[s].extend(rows.tolist())
        if s == 5 and n == 7:  # now and then a session closes and comes back empty
            arena.release(s)
            ref[s] = []
    for s in range(6):
        assert arena.rows(s).tolist() == ref[s]
    got, offsets = arena.gather(np.array(batch))
    assert got.tolist() == sum((ref[s] for s in batch), [])
    assert np.diff(offsets).tolist() == [len(ref[s]) for s in batch]


def test_arena_multi_append_in_one_call():
    arena = RowArena(3)
    arena.append(np.array([2, 0]), np.array([2, 3]), np.array([10, 11, 20, 21, 22]))
    assert arena.rows(2).tolist() == [10, 11] and arena.rows(0).tolist() == [20, 21, 22]


def test_digest_order_free_and_signed():
    ids, tiers, slots = np.array([5, 1, 9]), np.array([0, 1, 2]), np.array([3, 4, -1])
    d = slot_map_digest(ids, tiers, slots)
    perm = np.array([2, 0, 1])
    assert d == slot_map_digest(ids[perm], tiers[perm], slots[perm])
    assert -(1 << 63) <= d < (1 << 63)
    assert d != slot_map_digest(ids, tiers, np.array([3, 5, -1]))
    assert slot_map_digest(np.zeros(0), np.zeros(0), np.zeros(0)) == slot_map_digest([], [], [])


def test_plan_digest_counts_misses_as_none():
    plan = MovePlan(3, [7, 8], [Tier.SSD, Tier.DRAM], [-1, 2], [Tier.DRAM, Tier.HBM], [4, 1],
                    [0, 0], [0, 1], ("s",))
    assert plan_digest(plan) == slot_map_digest([7, 8], [1, 0], [4, 1])
    assert plan_digest(plan, [7]) == slot_map_digest([7, 8], [-1, 0], [-1, 1])


@pytest.mark.parametrize("reuse", ["newest", "oldest"])
def test_slot_stack_matches_a_list_model_through_many_pushes_pops_and_grows(reuse: str) -> None:
    """The stack against a plain list (free slots, bottom first): pops hand out the top,
    pushes go on top ("newest") or under everything free ("oldest", a window that slides down
    and is moved back up when it runs out of room), grows add new slots on top."""
    rng = np.random.default_rng(5)
    s = SlotStack(16, "L2", reuse=reuse)
    model = list(range(15, -1, -1))  # bottom first, as stack[:top]
    used: list[int] = []
    for _ in range(3000):
        op = rng.integers(0, 10)
        if op < 4 and model:
            n = int(rng.integers(1, len(model) + 1))
            got = s.pop(n).tolist()
            want = model[len(model) - n:][::-1]
            del model[len(model) - n:]
            assert got == want
            used += got
        elif op < 9 and used:
            k = int(rng.integers(1, len(used) + 1))
            back = [used.pop(int(rng.integers(0, len(used)))) for _ in range(k)]
            s.push(np.array(back, dtype=np.int32))
            group = sorted(back, reverse=True)
            model = group + model if reuse == "oldest" and model else model + group
        elif op == 9 and s.size < 200:
            old = s.size
            s.grow(old + int(rng.integers(1, 8)))
            model = list(range(s.size - 1, old - 1, -1)) + model
        assert s.top == len(model) and s.stack[:s.top].tolist() == model
        assert s.size == len(model) + len(used)
