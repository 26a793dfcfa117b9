"""Compiled loops (numba) of the planner: eviction candidates and keys, cached orders (a
session's rows by tier, demand and prefetch: rowkernels.py).

Why: each replaced a chain of numpy calls over the same few arrays (a mask from three session
flags, keys from four session fields, gathers of a few sessions' rows and a filter on their
tiers). Results are those of the numpy code, bit for bit: the float keys are computed with the
same operations in the same order (numba does not contract a * b + c without fastmath).
Where the forbid flags are tested session by session (still_cold), the test is written out:
as a call to a jitted helper per session (inlined or not) it made the candidate scan 5x slower
(_unforbidden calls one per flag array). No numba sort (each costs seconds of compile time):
coldest_candidates selects through a heap written out here (candidates and
policy.select_victims are its reference).
"""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import PREFETCH_AHEAD, A, _jit, prefetch

HEAT, LRU, LRUK = 0, 1, 2  # PolicyConfig.kind
# How many candidates ahead coldest_candidates asks for a session's record and attention sum:
# its loop is short (most candidates cost a key and one comparison). In-step at 1M blocks, with
# 7K candidates, a call took 193 us asking for the record only 8 ahead, 180 for both lines 8
# ahead, 166 for both 16 ahead.
_SCAN_AHEAD = 16


@_jit
def _key(kind: int, attn_sum: float, length: int, last: float, kth: float, tick: int,
         w_attn: float, w_recency: float) -> tuple[float, float]:
    """A session's eviction keys (primary, secondary) at `tick` (policy.eviction_keys_of:
    heat = w_attn * mean attention + w_recency / (1 + ticks since the latest run); the K-th
    latest run breaks ties). Scalars only: every kernel here computes its keys through this
    one, so they are the same floats everywhere."""
    if kind == HEAT:
        mean_attn = attn_sum / max(length, 1)
        since = max(tick - last, 0.0) + 1.0
        return w_attn * mean_attn + w_recency / since, kth
    if kind == LRU:
        return last, kth
    return kth, last


@_jit
def _clear_flagged(mask: A, flags: A) -> None:
    """mask[s] = 0 where flags[s] is set (none for an empty `flags`)."""
    if len(flags) > 0:
        for s in range(len(mask)):
            mask[s] &= flags[s] == 0


@_jit
def _unforbidden(f0: A, f1: A, f2: A, count: A) -> A:
    """Sessions with count > 0 set in none of the forbid flags f0..f2 (an empty array: not
    used), ascending. A byte mask first, one branch-free loop per array, then
    the sessions of its nonzero 8-byte words. Tested a session at a time with branches, a
    coldest_candidates call in-step at 1M blocks (22K sessions) took 48 instead of 35 us with
    a few hundred candidates (L1), 222 instead of 193 us with 7K (L2)."""
    n = len(count)
    mask = np.empty(n, dtype=np.uint8)
    for s in range(n):
        mask[s] = count[s] > 0
    _clear_flagged(mask, f0)
    _clear_flagged(mask, f1)
    _clear_flagged(mask, f2)
    cand = np.empty(n, dtype=np.int64)
    k = 0
    whole = n - n % 8
    words = mask[:whole].view(np.uint64)
    for w in range(len(words)):
        if words[w] != 0:
            for s in range(8 * w, 8 * w + 8):
                cand[k] = s
                k += mask[s]
    for s in range(whole, n):
        cand[k] = s
        k += mask[s]
    return cand[:k]


@_jit
def candidates(f0: A, f1: A, f2: A, count: A, kind: int, attn_sum: A, length: A,
               first_run: A, kth_run: A, tick: int, w_attn: float,
               w_recency: float) -> tuple[A, A, A, A]:
    """Sessions set in none of the forbid flags f0..f2 (an empty array: not used) with
    count > 0 on the tier, with their eviction keys (policy.eviction_keys_of: heat = w_attn *
    mean attention + w_recency / (1 + ticks since the latest run); the K-th latest run breaks
    ties) and their block counts there."""
    cand = _unforbidden(f0, f1, f2, count)
    k = len(cand)
    primary = np.empty(k, dtype=np.float64)
    secondary = np.empty(k, dtype=np.float64)
    sizes = np.empty(k, dtype=np.int64)
    for i in range(k):
        if i + PREFETCH_AHEAD < k:  # its session record (run history, block count)
            prefetch(first_run, cand[i + PREFETCH_AHEAD])
        s = cand[i]
        sizes[i] = count[s]
        primary[i], secondary[i] = _key(kind, attn_sum[s], length[s], np.float64(first_run[s]),
                                        np.float64(kth_run[s]), tick, w_attn, w_recency)
    return cand.copy(), primary, secondary, sizes


@_jit
def coldest_candidates(f0: A, f1: A, f2: A, count: A, kind: int, attn_sum: A, length: A,
                       first_run: A, kth_run: A, tick: int, w_attn: float, w_recency: float,
                       need: int) -> tuple[A, bool]:
    """`candidates`, then policy.select_victims on their keys, in one pass over the candidates:
    the sessions candidates() gives, coldest first in (primary, secondary, session) order,
    until their block counts reach `need` (all if they do not). False if a key is NaN (numpy
    orders those otherwise): the caller then runs candidates() and select_victims.

    The key of each candidate (computed as candidates() does, so the same floats; the tests
    hold the two together) goes into a max-heap of the coldest seen so far, which keeps only
    those that reach `need` without one to spare: once they do, a warmer candidate costs one
    comparison. A rebuild wants a few dozen to a few hundred sessions of 1-7K candidates, so
    this writes no key arrays over every candidate, and does less than heapifying them all
    and popping each victim (numpy's partition and lexsort before that: 2x slower again with
    cold caches). The heap is emptied warmest first into its own back. One loop sifts down
    for the pass and the emptying (a helper function doubled the compile time)."""
    cand = _unforbidden(f0, f1, f2, count)
    k = len(cand)
    # Candidates that entered the heap, in the order they did (so by session: the last key).
    kp = np.empty(k, dtype=np.float64)
    ks = np.empty(k, dtype=np.float64)
    kz = np.empty(k, dtype=np.int64)
    ku = np.empty(k, dtype=np.int64)
    heap = np.empty(k, dtype=np.int64)  # of their positions in kp, ks, kz, ku
    if need <= 0 or k == 0:
        return ku[:0].copy(), True
    m = total = 0  # the heap is heap[:m]; total: the blocks they hold
    entered = 0
    i = 0  # the next candidate
    out = -1  # once every candidate was seen: how many sessions the answer holds
    while True:
        if out < 0 and m > 0 and total - kz[heap[0]] >= need:
            total -= kz[heap[0]]  # the warmest is not needed: the last entry replaces it
            m -= 1
            x = heap[m]
        elif i < k:
            if i + _SCAN_AHEAD < k:  # its session record (run history, length), attention
                prefetch(first_run, cand[i + _SCAN_AHEAD])
                prefetch(attn_sum, cand[i + _SCAN_AHEAD])
            s = cand[i]
            i += 1
            px, sx = _key(kind, attn_sum[s], length[s], np.float64(first_run[s]),
                          np.float64(kth_run[s]), tick, w_attn, w_recency)
            if px != px or sx != sx:  # NaN
                return ku[:0].copy(), False
            if total >= need:
                y = heap[0]  # it entered before: s goes first only with smaller keys
                if not (px < kp[y] or (px == kp[y] and sx < ks[y])):
                    continue
            x = entered
            entered += 1
            kp[x], ks[x], kz[x], ku[x] = px, sx, count[s], s
            j = m  # sift x up from a new last entry
            m += 1
            while j > 0:
                up = (j - 1) // 2
                y = heap[up]
                if not (kp[y] < px or (kp[y] == px and (
                        ks[y] < sx or (ks[y] == sx and y < x)))):
                    break
                heap[j] = y
                j = up
            heap[j] = x
            total += kz[x]
            continue
        else:
            if out < 0:
                out = m
            if m <= 1:
                break
            m -= 1  # the warmest left goes after the colder ones
            x = heap[m]
            heap[m] = heap[0]
        px, sx = kp[x], ks[x]  # sift x down from the root of heap[:m]
        j = 0
        while True:
            c = 2 * j + 1
            if c >= m:
                break
            y = heap[c]
            if c + 1 < m:
                z = heap[c + 1]
                if kp[y] < kp[z] or (kp[y] == kp[z] and (
                        ks[y] < ks[z] or (ks[y] == ks[z] and y < z))):
                    c += 1
                    y = z
            if not (px < kp[y] or (px == kp[y] and (
                    sx < ks[y] or (sx == ks[y] and x < y)))):
                break
            heap[j] = y
            j = c
        heap[j] = x
    units = np.empty(out, dtype=np.int64)
    for j in range(out):
        units[j] = ku[heap[j]]
    return units, True


@_jit
def still_cold(units: A, f0: A, f1: A, f2: A, count: A, first_run: A,
               built: int) -> tuple[A, int]:
    """A cached order less the sessions now forbidden, with no blocks left on the tier, or run
    since it was built; and the blocks the rest hold there."""
    out = np.empty(len(units), dtype=np.int64)
    k = 0
    total = 0
    for i in range(len(units)):
        s = units[i]
        if count[s] > 0 and first_run[s] <= built and not (
                (len(f0) > 0 and f0[s]) or (len(f1) > 0 and f1[s]) or (len(f2) > 0 and f2[s])):
            out[k] = s
            k += 1
            total += count[s]
    return out[:k].copy(), total


@_jit
def unit_keys(units: A, kind: int, attn_sum: A, length: A, first_run: A, kth_run: A,
              tick: int, w_attn: float, w_recency: float) -> tuple[A, A]:
    """The eviction keys (primary, secondary) of `units` at `tick`, computed as candidates()
    and coldest_candidates() compute them (the same floats)."""
    k = len(units)
    primary = np.empty(k, dtype=np.float64)
    secondary = np.empty(k, dtype=np.float64)
    for i in range(k):
        s = units[i]
        primary[i], secondary[i] = _key(kind, attn_sum[s], length[s], np.float64(first_run[s]),
                                        np.float64(kth_run[s]), tick, w_attn, w_recency)
    return primary, secondary


@_jit
def walk_prepared(units: A, primary: A, secondary: A, complete: bool, stale: A, mark: A,
                  f0: A, f1: A, f2: A, count: A, kind: int, attn_sum: A, length: A,
                  first_run: A, kth_run: A, tick: int, w_attn: float, w_recency: float,
                  need: int) -> tuple[A, bool]:
    """coldest_candidates(f0, f1, f2, count, ..., need), the same sessions in the same order,
    from an order prepared before the step (Controller.prepare): `units`, the coldest sessions
    with blocks on the tier as the table was then, in (primary, secondary, session) order with
    their keys at `tick`; `complete` if they are all such sessions. Sessions whose keys or
    block counts may have changed since (`stale`, repeats allowed: the batch, sessions moved
    in this step, attention reported...) are skipped in `units` and merged in with their keys
    as they are now; every other session's key and eligibility it had then, except the
    counts and flags, which are read now. False when the answer may lie past the prepared
    prefix (or a stale key is NaN, or too many are eligible): the caller then runs
    coldest_candidates. `mark` is scratch over sessions, all zero on entry and on return."""
    n = len(units)
    out = np.empty(0, dtype=np.int64)
    if need <= 0:
        return out, True
    ns = len(stale)
    xs = np.empty(ns, dtype=np.int64)  # eligible stale sessions, sorted by key (insertion)
    xp = np.empty(ns, dtype=np.float64)
    xq = np.empty(ns, dtype=np.float64)
    nx = 0
    ok = True
    for i in range(ns):
        s = stale[i]
        if mark[s] != 0:
            continue
        mark[s] = 1
        if not ok or count[s] <= 0 or (len(f0) > 0 and f0[s]) or (len(f1) > 0 and f1[s]) or (
                len(f2) > 0 and f2[s]):
            continue
        if nx >= 256:  # not the case this is for: leave it to the full scan
            ok = False
            continue
        px, sx = _key(kind, attn_sum[s], length[s], np.float64(first_run[s]),
                      np.float64(kth_run[s]), tick, w_attn, w_recency)
        if px != px or sx != sx:  # NaN: numpy's order
            ok = False
            continue
        j = nx
        while j > 0 and (px < xp[j - 1] or (px == xp[j - 1] and (
                sx < xq[j - 1] or (sx == xq[j - 1] and s < xs[j - 1])))):
            xs[j], xp[j], xq[j] = xs[j - 1], xp[j - 1], xq[j - 1]
            j -= 1
        xs[j], xp[j], xq[j] = s, px, sx
        nx += 1
    if ok:
        out = np.empty(n + nx, dtype=np.int64)
        k = total = 0
        i = j = 0
        while total < need:
            while i < n:
                s = units[i]
                if mark[s] == 0 and count[s] > 0 and not (
                        (len(f0) > 0 and f0[s]) or (len(f1) > 0 and f1[s]) or (
                        len(f2) > 0 and f2[s])):
                    break
                i += 1
            if i == n and not complete:  # past the prefix: sessions not prepared may be next
                ok = False
                break
            if i < n and (j == nx or primary[i] < xp[j] or (primary[i] == xp[j] and (
                    secondary[i] < xq[j] or (secondary[i] == xq[j] and units[i] < xs[j])))):
                s = units[i]
                i += 1
            elif j < nx:
                s = xs[j]
                j += 1
            else:
                break  # every candidate: fewer blocks than asked
            out[k] = s
            k += 1
            total += count[s]
        out = out[:k].copy()
    for i in range(ns):
        mark[stale[i]] = 0
    return out, ok
