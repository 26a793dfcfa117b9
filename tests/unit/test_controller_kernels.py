"""The compiled planner kernels against the numpy policy functions they replace, on random
inputs (the golden tests cover them only on the states their programs reach)."""

from __future__ import annotations

import numpy as np
import pytest

from tpkv.controller.plankernels import HEAT, LRU, LRUK, candidates
from tpkv.controller.policy import eviction_keys_of, select_victims


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
