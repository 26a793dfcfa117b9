"""Pure policy functions and the cost model: formulas, tie breaks, hysteresis, determinism."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkv.config import PolicyConfig
from tpkv.controller.cost import RateMeter, resume_cost
from tpkv.controller.policy import (
    auto_pin_threshold,
    cooling,
    eviction_keys,
    fold_access,
    heat,
    select_victims,
    watermark_excess,
)
from tpkv.protocol.plan import MoveResult


def test_heat_formula_defaults():
    h = heat(np.array([0.0, 1.0, 0.5]), np.array([0, 0, 3]), 0.7, 0.3)
    np.testing.assert_allclose(h, [0.3, 1.0, 0.35 + 0.3 / 4])


def test_heat_prefers_recent_then_attended():
    # same mass: the one accessed longer ago is colder
    assert heat(np.array([0.2]), np.array([10]), 0.7, 0.3) < heat(np.array([0.2]), np.array([1]),
                                                                  0.7, 0.3)


def test_eviction_keys_per_kind():
    hist = np.array([[10, 2], [10, 8], [5, -1]])  # newest first
    attn = np.zeros(3)
    p, s = eviction_keys("lru", attn, hist, 12, 0.7, 0.3)
    np.testing.assert_array_equal(p, [10, 10, 5])
    p, s = eviction_keys("lruk", attn, hist, 12, 0.7, 0.3)
    np.testing.assert_array_equal(p, [2, 8, -1])
    p, s = eviction_keys("heat", attn, hist, 12, 0.7, 0.3)
    np.testing.assert_allclose(p, [0.1, 0.1, 0.3 / 8])
    np.testing.assert_array_equal(s, [2, 8, -1])  # LRU-K breaks the tie of the first two
    with pytest.raises(ValueError):
        eviction_keys("random", attn, hist, 12, 0.7, 0.3)


def test_select_victims_orders_and_breaks_ties():
    primary = np.array([0.5, 0.1, 0.1, 0.9, 0.1])
    secondary = np.array([0, 7, 3, 0, 3])
    sizes = np.array([1, 2, 2, 2, 2])
    order = select_victims(primary, secondary, sizes, need=3)
    # ties on primary: secondary 3 first (index 2 before 4), then 7
    np.testing.assert_array_equal(order, [2, 4])
    np.testing.assert_array_equal(select_victims(primary, secondary, sizes, need=100),
                                  [2, 4, 1, 0, 3])
    assert len(select_victims(primary, secondary, sizes, need=0)) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 4)), min_size=1,
                max_size=60), st.integers(1, 80))
def test_select_victims_matches_full_sort(units, need):
    primary = np.array([u[0] for u in units], dtype=np.float64)
    secondary = np.array([u[1] for u in units], dtype=np.float64)
    sizes = np.array([u[2] for u in units])
    idx = np.arange(len(units))
    full = idx[np.lexsort((idx, secondary, primary))]
    stop = min(len(full), int(np.searchsorted(np.cumsum(sizes[full]), need)) + 1)
    np.testing.assert_array_equal(select_victims(primary, secondary, sizes, need), full[:stop])


def test_auto_pin_threshold_top_share_and_cap():
    attn = np.array([0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=np.float32)
    assert auto_pin_threshold(attn, 0.25, 100) == 8.0  # top 3 of 12
    assert auto_pin_threshold(attn, 0.25, 2) == 9.0  # capped at 2 blocks
    assert math.isinf(auto_pin_threshold(np.zeros(10, np.float32), 0.5, 10))
    ties = np.ones(10, dtype=np.float32)
    assert (ties >= auto_pin_threshold(ties, 0.2, 100)).sum() == 0  # never more than the share


def test_watermark_hysteresis():
    assert watermark_excess(85, 100, 0.9, 0.75, False) == (0, False)  # between the marks
    assert watermark_excess(91, 100, 0.9, 0.75, False) == (16, True)  # above high: down to low
    assert watermark_excess(85, 100, 0.9, 0.75, True) == (10, True)  # still draining
    assert watermark_excess(75, 100, 0.9, 0.75, True) == (0, False)  # reached low
    assert watermark_excess(80, 100, 0.9, 0.75, False) == (0, False)  # rising again: left alone


def test_cooling_window():
    demoted = np.array([-np.inf, 100.0, 80.0], dtype=np.float32)
    np.testing.assert_array_equal(cooling(demoted, 110.0, 30.0), [False, True, False])


def _brute_fold(created: int, runs: list[int], k: int) -> tuple[int, list[int], int]:
    seen = [t for t in runs if t >= created]
    newest = sorted(seen, reverse=True)
    hist = (newest[1:k] + [-1] * k)[:k - 1]
    return newest[0], hist, len(seen)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 4), st.lists(st.booleans(), min_size=1, max_size=30), st.integers(0, 29),
       st.integers(0, 29))
def test_fold_access_matches_replay(k, runs_mask, created, fold_at):
    """Folding at any point, then again at the end, equals replaying every access."""
    ticks = [t for t, ran in enumerate(runs_mask) if ran]
    created = min(created, len(runs_mask) - 1)
    ticks = sorted(set(ticks) | {created})  # the block is created during a run
    fold_at = max(fold_at, created)
    last, hist, count, seen = created, np.full((1, k - 1), -1), 1, None

    def session_state(upto: int) -> tuple[int, np.ndarray]:
        done = [t for t in ticks if t <= upto]
        newest = sorted(done, reverse=True)
        return len(done), np.array([(newest + [-1] * k)[:k]])

    runs_at_create, _ = session_state(created)
    state = (np.array([last]), hist, np.array([count]), np.array([runs_at_create]))
    for upto in (fold_at, len(runs_mask)):
        runs, run_hist = session_state(upto)
        state = fold_access(*state, np.array([runs]), run_hist)
        seen = _brute_fold(created, [t for t in ticks if t <= upto], k)
    assert seen is not None
    assert int(state[0][0]) == seen[0]
    assert state[1][0].tolist() == seen[1]
    assert int(state[2][0]) == seen[2]


def test_resume_cost_regimes():
    bb = 2 << 20  # 2 MiB blocks, 16 tokens each
    # alone, a fast prefill beats a slow disk
    alone = resume_cost(0, 512, 512 * 16, bb, 55e9, 2.1e9, 70_000.0, 0, 1.0)
    assert alone.choice == "recompute" and alone.recompute_s < alone.load_s
    # under load the same disk read wins: the recompute would stall 63 other sessions
    busy = resume_cost(0, 512, 512 * 16, bb, 55e9, 2.1e9, 70_000.0, 63, 1.0)
    assert busy.choice == "load" and busy.recompute_cost_s == pytest.approx(64 * busy.recompute_s)
    # from DRAM loading always wins
    assert resume_cost(512, 0, 512 * 16, bb, 55e9, 2.1e9, 70_000.0, 0, 1.0).choice == "load"


def test_rate_meter_learns_from_reports():
    m = RateMeter(PolicyConfig())
    r = MoveResult(epoch=1, rank=0, moves_applied=4, slot_map_digest=0, bytes_ssd_read=1 << 30,
                   elapsed_ns=10**9)
    m.observe_plan([r, r])
    assert m.ssd_read_bytes_per_s == pytest.approx(float(1 << 30))
    m.observe_prefill(8192, 0.1)
    assert m.prefill_tokens_per_s == pytest.approx(81920.0)
    m.observe_plan([MoveResult(2, 0, 1, 0, bytes_h2d=100, elapsed_ns=1)])  # too small: ignored
    assert m.samples["h2d"] == 0
