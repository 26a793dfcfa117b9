"""Pure placement policy: heat, eviction keys, victim selection, auto pins, watermarks, cooldown.

Every function here is a deterministic function of its array arguments and an explicit clock
(ticks or seconds passed in); none keeps state or reads the time.
"""

from __future__ import annotations

import math

import numpy as np

PolicyKind = str  # "heat" | "lru" | "lruk"


def heat(attn: np.ndarray, ticks_since_access: np.ndarray, w_attn: float,
         w_recency: float) -> np.ndarray:
    """heat = w_attn * attention_mass + w_recency / (1 + ticks_since_access); hotter is higher."""
    recency = np.maximum(np.asarray(ticks_since_access, dtype=np.float64), 0.0)
    recency += 1.0  # in place: no temporaries over every candidate (same values, same order)
    np.divide(w_recency, recency, out=recency)
    out = w_attn * np.asarray(attn, dtype=np.float64)
    out += recency
    return out


def eviction_keys(kind: PolicyKind, mean_attn: np.ndarray, run_hist: np.ndarray, tick: int,
                  w_attn: float, w_recency: float) -> tuple[np.ndarray, np.ndarray]:
    """(primary, secondary) keys per unit (a session); the lowest pair is evicted first.

    run_hist: [n, K] ticks of the latest K accesses, newest first, -1 where there were fewer.
    heat: primary is the heat, the K-th latest access (LRU-K) breaks ties.
    lru: the latest access, then the K-th latest. lruk: the K-th latest access, then the latest.
    """
    return eviction_keys_of(kind, mean_attn, run_hist[:, 0], run_hist[:, -1], tick, w_attn,
                            w_recency)


def eviction_keys_of(kind: PolicyKind, mean_attn: np.ndarray | None, last_tick: np.ndarray,
                     kth_tick: np.ndarray, tick: int, w_attn: float,
                     w_recency: float) -> tuple[np.ndarray, np.ndarray]:
    """eviction_keys from the latest and the K-th latest access tick of each unit (mean_attn
    is read by "heat" only)."""
    last = last_tick.astype(np.float64)
    kth = kth_tick.astype(np.float64)
    if kind == "heat":
        assert mean_attn is not None, "heat needs the mean attention mass"
        return heat(mean_attn, np.subtract(tick, last, out=last), w_attn, w_recency), kth
    if kind == "lru":
        return last, kth
    if kind == "lruk":
        return kth, last
    raise ValueError(f"unknown policy kind {kind!r}")


def select_victims(primary: np.ndarray, secondary: np.ndarray, sizes: np.ndarray,
                   need: int) -> np.ndarray:
    """Indices of the coldest units, coldest first, whose sizes add up to at least `need`
    (every unit if they do not). Ties break on secondary, then on index: deterministic.

    Cost is about linear in the number of units: only a prefix is fully sorted.
    """
    n = len(primary)
    if need <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    mean = max(float(sizes.mean()), 1.0)
    k = min(n, max(16, int(2 * need / mean) + 1))
    while True:
        if k >= n:
            cand = np.arange(n)
        else:
            cut = np.partition(primary, k - 1)[k - 1]  # the k-th smallest
            cand = np.flatnonzero(primary <= cut)  # every tie at the cut, for determinism
        order = cand[np.lexsort((cand, secondary[cand], primary[cand]))]
        total = np.cumsum(sizes[order])
        if total[-1] >= need or len(cand) >= n:
            stop = int(np.searchsorted(total, need)) + 1
            return order[:stop]
        k = min(n, 2 * k)


def auto_pin_threshold(attn: np.ndarray, fraction: float, cap: int) -> float:
    """Attention mass at or above which a block is auto-pinned: the top `fraction` of `attn`
    (at most `cap` blocks, only blocks with positive mass). +inf when nothing qualifies."""
    positive = attn[attn > 0]
    count = min(int(math.floor(fraction * len(attn))), cap, len(positive))
    if count <= 0:
        return math.inf
    top = np.partition(positive, len(positive) - count)[len(positive) - count:]
    threshold = float(top.min())
    if int((positive >= threshold).sum()) > count:  # ties at the edge: pin strictly above
        threshold = float(np.nextafter(np.float32(threshold), np.float32(np.inf)))
    return threshold


def watermark_excess(used: int, slots: int, high: float, low: float,
                     draining: bool) -> tuple[int, bool]:
    """Hysteresis: above `high` (or still draining), blocks to move out to get down to `low`.

    Returns (count, draining): draining stays set until a step ends at or below the low mark,
    so a tier that is between the marks is left alone.
    """
    if slots <= 0:
        return 0, False
    target = int(math.floor(low * slots))
    if used > high * slots or (draining and used > target):
        return used - target, True
    return 0, False


def cooling(demoted_at: np.ndarray, now_s: float, cooldown_s: float) -> np.ndarray:
    """Mask of blocks demoted less than `cooldown_s` ago: no speculative promotion for them."""
    return (now_s - demoted_at.astype(np.float64)) < cooldown_s


def shift_ticks(arr: np.ndarray, shift: int) -> None:
    """Ticks in `arr` `shift` earlier, in place (never below 0; -1, none, stays)."""
    arr[...] = np.where(arr >= 0, np.maximum(arr - shift, 0), arr)


def fold_access(last: np.ndarray, hist: np.ndarray, count: np.ndarray, runs_seen: np.ndarray,
                runs: np.ndarray, run_hist: np.ndarray) -> tuple[np.ndarray, ...]:
    """Fold the runs a block's session made since the block was last folded into the block's
    own access history. Every block of a session is read whenever the session runs.

    last [n], hist [n, K-1], count [n], runs_seen [n]: the block's state when last folded.
    runs [n], run_hist [n, K]: its session's run count and latest K run ticks, newest first.
    Returns the new (last, hist, count, runs_seen).
    """
    new_runs = (runs - runs_seen).astype(np.int64)  # [n]
    old = np.concatenate([last[:, None], hist], axis=1).astype(np.int64)  # [n, K]
    k = old.shape[1]
    merged = np.empty_like(old)
    for p in range(k):  # the p-th latest access: a new run if p < new_runs, else an older one
        from_old = np.clip(p - new_runs, 0, k - 1)
        older = np.take_along_axis(old, from_old[:, None], axis=1)[:, 0]
        merged[:, p] = np.where(p < new_runs, run_hist[:, min(p, k - 1)], older)
    merged[:, 1:] = np.where(merged[:, 1:] < 0, -1, merged[:, 1:])
    return (merged[:, 0].astype(np.int32), merged[:, 1:].astype(np.int32),
            (count + new_runs).astype(np.int32), runs.astype(np.int32))
