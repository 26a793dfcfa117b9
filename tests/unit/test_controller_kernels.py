"""The compiled planner kernels against the numpy policy functions they replace, on random
inputs (the golden tests cover them only on the states their programs reach)."""

from __future__ import annotations

import numpy as np
import pytest

from tpkv.controller.cost import resume_costs
from tpkv.controller.kernels import count_either, gave_up, uncopied_running
from tpkv.controller.plankernels import (
    HEAT,
    LRU,
    LRUK,
    candidates,
    coldest_candidates,
    unit_keys,
    walk_prepared,
)
from tpkv.controller.policy import eviction_keys_of, select_victims
from tpkv.controller.rowkernels import not_on, record_choices, split_by_tier


@pytest.mark.parametrize("kind", ["heat", "lru", "lruk"])
def test_candidates_match_the_policy_keys(kind: str) -> None:
    rng = np.random.default_rng(5)
    n, tick = 500, 1000
    forbid = [rng.random(n) < 0.2, rng.random(n) < 0.1, np.zeros(0, dtype=bool)]
    count = rng.integers(0, 3, n).astype(np.int32)
    attn_sum = rng.random(n) * 10
    length = rng.integers(0, 70, n).astype(np.int64)
    first = rng.integers(-1, tick, n).astype(np.int32)
    kth = np.minimum(first, rng.integers(-1, tick, n)).astype(np.int32)
    code = {"heat": HEAT, "lru": LRU, "lruk": LRUK}[kind]
    cand, primary, secondary, sizes = candidates(*forbid, count, code, attn_sum, length, first,
                                                 kth, tick, 1.5, 2.0)
    want = np.flatnonzero(~(forbid[0] | forbid[1]) & (count > 0))
    mean_attn = attn_sum[want] / np.maximum(length[want], 1) if kind == "heat" else None
    p, s = eviction_keys_of(kind, mean_attn, first[want], kth[want], tick, 1.5, 2.0)
    assert np.array_equal(cand, want)
    assert np.array_equal(primary, p) and np.array_equal(secondary, s)  # bit for bit
    assert np.array_equal(sizes, count[want])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 67])
def test_candidates_of_any_length(n: int) -> None:
    """The candidate filter goes 8 sessions at a time, then the rest: every length, 3 flags."""
    rng = np.random.default_rng(n)
    forbid = [rng.random(n) < 0.3 for _ in range(3)]
    count = rng.integers(0, 2, n).astype(np.int32)
    zeros = np.zeros(n, dtype=np.int64)
    cand = candidates(*forbid, count, LRU, zeros.astype(np.float64), zeros, zeros.astype(np.int32),
                      zeros.astype(np.int32), 0, 1.0, 1.0)[0]
    want = np.flatnonzero(~(forbid[0] | forbid[1] | forbid[2]) & (count > 0))
    assert np.array_equal(cand, want)


def test_select_victims_is_the_prefix_of_a_full_sort() -> None:
    """Its partial sort (only keys at or below the k-th smallest) gives what sorting every key
    by (primary, secondary, index) and cutting at `need` gives."""
    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.integers(0, 400 if trial % 4 else 5000))
        primary = (rng.random(n) if trial % 3 == 0
                   else rng.integers(0, 20, n).astype(np.float64))  # many ties
        if trial % 7 == 0 and n:
            primary[: n // 2] = -0.0  # equal to 0.0 in both orders
        secondary = rng.integers(-1, 10, n).astype(np.float64)
        sizes = rng.integers(0, 50, n).astype(np.int64)
        need = int(rng.integers(-2, 4000))
        order = np.lexsort((np.arange(n), secondary, primary))
        stop = int(np.searchsorted(np.cumsum(sizes[order]), need)) + 1 if n and need > 0 else 0
        assert np.array_equal(select_victims(primary, secondary, sizes, need), order[:stop])



def test_coldest_candidates_is_candidates_then_select_victims() -> None:
    """The one-pass selection gives select_victims' order of candidates()' keys, ties (equal
    run ticks, no attention) and -0.0 included; it declines keys with a NaN (numpy sorts those
    last; the planner falls back)."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(0, 400 if trial % 4 else 8000))
        kind = (HEAT, LRU, LRUK)[trial % 3]
        forbid = [rng.random(n) < 0.2, (rng.random(n) < 0.1) if trial % 2 else
                  np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)]
        count = rng.integers(0, 60 if trial % 5 else 3, n).astype(np.int32)
        attn_sum = (rng.random(n) * 10 if trial % 3 == 0 else
                    np.where(rng.random(n) < 0.5, -0.0, 0.0))
        length = rng.integers(0, 70, n).astype(np.int64)
        tick = 1000
        first = rng.integers(-1, tick if trial % 2 else 20, n).astype(np.int32)
        kth = np.minimum(first, rng.integers(-1, tick, n)).astype(np.int32)
        need = int(rng.integers(-2, 4000 if trial % 7 else 1 << 20))
        keys = (*forbid, count, kind, attn_sum, length, first, kth, tick, 1.5, 2.0)
        cand, primary, secondary, sizes = candidates(*keys)
        units, ok = coldest_candidates(*keys, need)
        assert ok and np.array_equal(units, cand[select_victims(primary, secondary, sizes,
                                                                need)])
    one = np.ones(2, dtype=np.int32)
    _, ok = coldest_candidates(*[np.zeros(0, dtype=bool)] * 3, one, HEAT,
                               np.array([1.0, np.nan]), np.ones(2, dtype=np.int64), one, one,
                               5, 1.0, 1.0, 2)
    assert not ok


def test_tier_filters_match_numpy_masks() -> None:
    """split_by_tier and not_on keep the rows' order, as the masks they replace do."""
    rng = np.random.default_rng(11)
    tier = rng.integers(-1, 3, 1000).astype(np.int8)
    for n in (0, 1, 37, 600):
        rows = rng.permutation(1000)[:n].astype(np.int64)
        on2, on3 = split_by_tier(rows, tier)
        assert np.array_equal(on2, rows[tier[rows] == 1])
        assert np.array_equal(on3, rows[tier[rows] == 2])
        assert np.array_equal(not_on(rows, tier, 0), rows[tier[rows] != 0])
        assert on2.dtype == on3.dtype == np.int64



def test_l3_room_counts_match_the_numpy_they_replace() -> None:
    """count_either is np.count_nonzero(a | b) (sessions with blocks or records in L3) and
    uncopied_running np.cumsum(l3copy[rows] == 0) (records a spill of rows[:i + 1] writes),
    dtype included, for the arrays the planner passes (int64 counts, int32 records, uint8
    copies, int32 rows), empty ones too."""
    rng = np.random.default_rng(12)
    for n in (0, 1, 999):
        a = rng.integers(0, 3, n) * rng.integers(0, 2, n)
        b = (rng.integers(0, 2, n) * rng.integers(1, 50, n)).astype(np.int32)
        assert count_either(a, b) == np.count_nonzero(a | b)
    l3copy = rng.integers(0, 2, 1000).astype(np.uint8)
    for n in (0, 1, 300):
        rows = rng.permutation(1000)[:n].astype(np.int32)
        got, want = uncopied_running(rows, l3copy), np.cumsum(l3copy[rows] == 0)
        assert np.array_equal(got, want) and got.dtype == want.dtype


@pytest.mark.parametrize("mark_clean", [True, False])
def test_gave_up_matches_the_numpy_steps(mark_clean: bool) -> None:
    """The sessions that gave rows (touched and dirty after) and their counts; with
    mark_clean, the ones that gave none are clean, as orders.coldest's numpy steps did."""
    rng = np.random.default_rng(13)
    units = rng.permutation(200)[:80].astype(np.int64)
    per_unit = rng.integers(0, 3, 50).astype(np.int64)
    stop = 50
    clean, touched, dirty = (np.zeros(200, dtype=bool) for _ in range(3))
    gave, sizes = gave_up(units, stop, per_unit, mark_clean, clean, touched, dirty)
    keep = per_unit > 0
    assert np.array_equal(gave, units[:stop][keep]) and np.array_equal(sizes, per_unit[keep])
    assert np.array_equal(np.flatnonzero(touched), np.sort(gave))
    assert np.array_equal(touched, dirty)
    want_clean = np.zeros(200, dtype=bool)
    if mark_clean:
        want_clean[units[:stop][per_unit == 0]] = True
    assert np.array_equal(clean, want_clean)


def test_record_choices_costs_are_resume_costs_bit_for_bit() -> None:
    rng = np.random.default_rng(17)
    counts = rng.integers(0, 200, (2, 300)).astype(np.int32)
    counts[:, :20] = 0  # sessions with nothing on L2/L3: no choice recorded
    sess = rng.permutation(300)[:120].astype(np.int64)
    bb, bt, h2d, ssd, pre, others, w = 524288, 16, 5.5e10, 1.8e9, 3.0e4, 99, 0.05
    choice = np.full(300, -1, dtype=np.int8)
    load_out, redo_out = np.zeros(300, np.float32), np.zeros(300, np.float32)
    weight = 1.0 + w * max(others, 0)
    any_redo, redo, n2, n3, load_s, recompute_s = record_choices(
        sess, counts[0], counts[1], bt, bb, h2d, ssd, pre, weight, choice, load_out, redo_out)
    n2w, n3w = counts[0][sess].astype(np.int64), counts[1][sess].astype(np.int64)
    want_load, want_redo, weighted = resume_costs(n2w, n3w, (n2w + n3w) * bt, bb, h2d, ssd, pre,
                                                  others, w)
    assert np.array_equal(n2, n2w) and np.array_equal(n3, n3w)
    assert np.array_equal(load_s, want_load) and np.array_equal(recompute_s, want_redo)
    has = n2w + n3w > 0
    assert np.array_equal(redo, (weighted < want_load) & has) and any_redo == redo.any()
    assert np.array_equal(choice[sess[has]], redo[has].astype(np.int8))
    assert (choice[sess[~has]] == -1).all()
    assert np.array_equal(load_out[sess[has]], want_load[has].astype(np.float32))


def test_walk_prepared_is_coldest_candidates_of_the_table_now() -> None:
    """An order prepared on one state (plankernels.coldest_candidates without flags, keys from
    unit_keys), walked after some sessions changed (keys, counts; they are the stale ones) with
    the step's flags, gives coldest_candidates on the new state exactly, or declines; it
    declines only when the answer may lie past the prefix. The scratch marks end all zero."""
    rng = np.random.default_rng(13)
    empty = np.zeros(0, dtype=bool)
    walked = 0
    for trial in range(600):
        n = int(rng.integers(1, 300 if trial % 4 else 4000))
        kind = (HEAT, LRU, LRUK)[trial % 3]
        tick = 1000
        count = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 60, n)).astype(np.int32)
        attn_sum = (rng.random(n) * 10 if trial % 3 == 0 else
                    np.where(rng.random(n) < 0.5, -0.0, 0.0))
        length = rng.integers(0, 70, n).astype(np.int64)
        first = rng.integers(-1, tick if trial % 2 else 20, n).astype(np.int32)
        kth = np.minimum(first, rng.integers(-1, tick, n)).astype(np.int32)
        size = int(rng.integers(1, 3000 if trial % 5 else 1 << 20))
        prefix, ok = coldest_candidates(empty, empty, empty, count, kind, attn_sum, length,
                                        first, kth, tick, 1.5, 2.0, size)
        assert ok
        primary, secondary = unit_keys(prefix, kind, attn_sum, length, first, kth, tick, 1.5,
                                       2.0)
        complete = int(count[prefix].sum()) < size
        # The step: some sessions change (run, attention, blocks in or out, opened, closed).
        stale = rng.choice(n, int(rng.integers(0, min(n, 40) + 1))).astype(np.int64)
        count, attn_sum, first = count.copy(), attn_sum.copy(), first.copy()
        for s in stale.tolist():
            what = int(rng.integers(0, 4))
            if what == 0:
                count[s] = int(rng.integers(0, 60))
            elif what == 1:
                attn_sum[s] += float(rng.random() * 5)
            elif what == 2:
                first[s] = int(rng.integers(-1, tick))
        lower = rng.random(n) < 0.5  # counts of other sessions may go down (moves out, drops)
        lower[stale] = False
        count[lower] = np.minimum(count[lower], rng.integers(0, 60, int(lower.sum())))
        forbid = [rng.random(n) < 0.2, (rng.random(n) < 0.1) if trial % 2 else empty, empty]
        need = int(rng.integers(-2, 4000 if trial % 7 else 1 << 20))
        keys = (*forbid, count, kind, attn_sum, length, first, kth, tick, 1.5, 2.0)
        mark = np.zeros(n, dtype=np.uint8)
        units, ok = walk_prepared(prefix, primary, secondary, complete, stale, mark, *keys, need)
        assert not mark.any()
        want, _ = coldest_candidates(*keys, need)
        if ok:
            walked += 1
            assert np.array_equal(units, want), trial
        else:
            assert not complete
    assert walked > 200


def test_unit_keys_are_the_candidates_keys() -> None:
    rng = np.random.default_rng(17)
    n, tick = 500, 1000
    empty = np.zeros(0, dtype=bool)
    count = rng.integers(0, 3, n).astype(np.int32)
    attn_sum = rng.random(n) * 10
    length = rng.integers(0, 70, n).astype(np.int64)
    first = rng.integers(-1, tick, n).astype(np.int32)
    kth = np.minimum(first, rng.integers(-1, tick, n)).astype(np.int32)
    for kind in (HEAT, LRU, LRUK):
        cand, primary, secondary, _ = candidates(empty, empty, empty, count, kind, attn_sum,
                                                 length, first, kth, tick, 1.5, 2.0)
        p, s = unit_keys(cand, kind, attn_sum, length, first, kth, tick, 1.5, 2.0)
        assert np.array_equal(p, primary) and np.array_equal(s, secondary)
