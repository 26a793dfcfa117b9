"""Compiled loops (numba) of the planner: eviction candidates and keys, cached orders, demand
and prefetch rows.

Why: each replaced a chain of numpy calls over the same few arrays (a mask from three session
flags, keys from four session fields, gathers of a few sessions' rows and a filter on their
tiers). Results are those of the numpy code, bit for bit: the float keys are computed with the
same operations in the same order (numba does not contract a * b + c without fastmath).
The forbid-flag test is written out in each loop: as a call to a jitted helper (inlined or
not) it made the candidate scan 5x slower. No numba sort (each costs seconds of compile time):
coldest_first selects through a heap written out here (policy.select_victims is its reference).
"""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import PREFETCH_AHEAD, A, _jit, prefetch

HEAT, LRU, LRUK = 0, 1, 2  # PolicyConfig.kind


@_jit
def candidates(f0: A, f1: A, f2: A, count: A, kind: int, attn_sum: A, length: A,
               first_run: A, kth_run: A, tick: int, w_attn: float,
               w_recency: float) -> tuple[A, A, A, A]:
    """Sessions set in none of the forbid flags f0..f2 (an empty array: not used) with
    count > 0 on the tier, with their eviction keys (policy.eviction_keys_of: heat = w_attn *
    mean attention + w_recency / (1 + ticks since the latest run); the K-th latest run breaks
    ties) and their block counts there."""
    n = len(count)
    cand = np.empty(n, dtype=np.int64)
    k = 0
    for s in range(n):
        if count[s] > 0 and not ((len(f0) > 0 and f0[s]) or (len(f1) > 0 and f1[s])
                                 or (len(f2) > 0 and f2[s])):
            cand[k] = s
            k += 1
    primary = np.empty(k, dtype=np.float64)
    secondary = np.empty(k, dtype=np.float64)
    sizes = np.empty(k, dtype=np.int64)
    for i in range(k):
        if i + PREFETCH_AHEAD < k:  # its session record (run history, block count)
            prefetch(first_run, cand[i + PREFETCH_AHEAD])
        s = cand[i]
        last, kth = np.float64(first_run[s]), np.float64(kth_run[s])
        sizes[i] = count[s]
        if kind == HEAT:
            mean_attn = attn_sum[s] / max(length[s], 1)
            since = max(tick - last, 0.0) + 1.0
            primary[i] = w_attn * mean_attn + w_recency / since
            secondary[i] = kth
        elif kind == LRU:
            primary[i], secondary[i] = last, kth
        else:
            primary[i], secondary[i] = kth, last
    return cand[:k].copy(), primary, secondary, sizes


@_jit
def coldest_first(primary: A, secondary: A, sizes: A, need: int) -> tuple[A, bool]:
    """policy.select_victims without numpy's partition and lexsort (a chain of calls that
    costs 2x as much with cold caches, as on a rebuild step): the indices of the coldest units
    in (primary, secondary, index) order until their sizes reach `need` (all if they do not),
    from a min-heap built in O(n) and popped once per victim. False if a key is NaN (numpy
    orders those otherwise): the caller then uses select_victims. One loop sifts for both the
    build and the pops (a helper function doubled the compile time)."""
    n = len(primary)
    out = np.empty(n, dtype=np.int64)
    if need <= 0 or n == 0:
        return out[:0].copy(), True
    heap = np.empty(n, dtype=np.int64)
    for i in range(n):
        if primary[i] != primary[i] or secondary[i] != secondary[i]:  # NaN
            return out[:0].copy(), False
        heap[i] = i
    k = total = 0
    m = n
    build = n // 2 - 1  # heapify from here down to 0, then pop
    while True:
        if build >= 0:
            i = build
            build -= 1
        else:
            if m == 0 or total >= need:
                break
            out[k] = heap[0]
            total += sizes[heap[0]]
            k += 1
            m -= 1
            if m == 0:
                break
            heap[0] = heap[m]
            i = 0
        x = heap[i]  # sift heap[i] down the first m entries, keyed (primary, secondary, index)
        px, sx = primary[x], secondary[x]
        while True:
            c = 2 * i + 1
            if c >= m:
                break
            y = heap[c]
            if c + 1 < m:
                z = heap[c + 1]
                if primary[z] < primary[y] or (primary[z] == primary[y] and (
                        secondary[z] < secondary[y] or (secondary[z] == secondary[y]
                                                        and z < y))):
                    c += 1
                    y = z
            if not (primary[y] < px or (primary[y] == px and (
                    secondary[y] < sx or (secondary[y] == sx and y < x)))):
                break
            heap[i] = y
            i = c
        heap[i] = x
    return out[:k].copy(), True


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
def demand_rows(sessions: A, arena: A, start: A, length: A, tier: A) -> tuple[A, A]:
    """Rows of `sessions`, session by session in logical order, that are on L2 or L3 (to load)
    and that are on no tier (to recompute)."""
    n = 0
    for s in sessions:
        n += length[s]
    load = np.empty(n, dtype=np.int64)
    lost = np.empty(n, dtype=np.int64)
    n1 = n2 = 0
    for s in sessions:
        for r in arena[start[s]:start[s] + length[s]]:
            t = tier[r]
            if t == 1 or t == 2:
                load[n1] = r
                n1 += 1
            elif t == -1:
                lost[n2] = r
                n2 += 1
    return load[:n1].copy(), lost[:n2].copy()


@_jit
def record_choices(sessions: A, count_l2: A, count_l3: A, block_tokens: int, block_bytes: int,
                   h2d_bytes_per_s: float, ssd_read_bytes_per_s: float,
                   prefill_tokens_per_s: float, weight: float, choice: A, load_out: A,
                   recompute_out: A) -> tuple[bool, A, A, A, A, A]:
    """The cost model's choice for each returning session with blocks on L2/L3: cost.
    resume_costs (the same operations in the same order, so the same floats; `weight` is its
    1 + gpu_share_weight * other sessions), recompute when the weighted recompute time is below
    the load time, kept per session with both estimates (float32). Returns (any recompute,
    recompute per session, its blocks on L2, on L3, load_s, recompute_s)."""
    n = len(sessions)
    redo = np.zeros(n, dtype=np.bool_)
    n2 = np.empty(n, dtype=np.int64)
    n3 = np.empty(n, dtype=np.int64)
    load_s = np.empty(n, dtype=np.float64)
    recompute_s = np.empty(n, dtype=np.float64)
    any_redo = False
    for i in range(n):
        s = sessions[i]
        n2[i], n3[i] = count_l2[s], count_l3[s]
        f2, f3 = np.float64(n2[i]), np.float64(n3[i])
        load_s[i] = (f3 * block_bytes / ssd_read_bytes_per_s
                     + (f2 + f3) * block_bytes / h2d_bytes_per_s)
        recompute_s[i] = np.float64((n2[i] + n3[i]) * block_tokens) / prefill_tokens_per_s
        if n2[i] + n3[i] > 0:
            redo[i] = recompute_s[i] * weight < load_s[i]
            any_redo = any_redo or redo[i]
            choice[s] = redo[i]
            load_out[s] = np.float32(load_s[i])
            recompute_out[s] = np.float32(recompute_s[i])
    return any_redo, redo, n2, n3, load_s, recompute_s


@_jit
def prefetch_rows(sessions: A, arena: A, start: A, length: A, tier: A, demoted_at: A,
                  now_s: float, cooldown_s: float, room1: int, room2: int) -> tuple[A, A]:
    """Rows of `sessions` (soonest first) out of their cooldown (policy.cooling): the first
    room1 on L2, and on L3 whole sessions' rows while they fit in room2 (none for a room <= 0).
    Whole, because L3 records stay on disk until a session's last L3 block leaves (then its
    files are deleted): a part staged and spilled again would be written twice."""
    up = np.empty(max(room1, 0), dtype=np.int32)
    stage = np.empty(max(room2, 0), dtype=np.int32)
    n1 = n2 = 0
    for s in sessions:
        rows = arena[start[s]:start[s] + length[s]]
        on3 = 0
        cool3 = 0
        for r in rows:
            if tier[r] == 2:
                on3 += 1
                if now_s - np.float64(demoted_at[r]) < cooldown_s:
                    cool3 += 1
        take3 = on3 > 0 and cool3 == 0 and n2 + on3 <= room2
        for r in rows:
            t = tier[r]
            if t == 1 and n1 < room1 and not now_s - np.float64(demoted_at[r]) < cooldown_s:
                up[n1] = r
                n1 += 1
            elif t == 2 and take3:
                stage[n2] = r
                n2 += 1
    return up[:n1].copy(), stage[:n2].copy()


@_jit
def split_by_tier(rows: A, tier: A) -> tuple[A, A]:
    """The rows (in order) on L2 and those on L3: one pass over their tiers instead of a gather
    and a mask per tier."""
    n = len(rows)
    on2 = np.empty(n, dtype=rows.dtype)
    on3 = np.empty(n, dtype=rows.dtype)
    n2 = n3 = 0
    for i in range(n):
        r = rows[i]
        t = tier[r]
        if t == 1:
            on2[n2] = r
            n2 += 1
        elif t == 2:
            on3[n3] = r
            n3 += 1
    return on2[:n2].copy(), on3[:n3].copy()


@_jit
def not_on(rows: A, tier: A, t: int) -> A:
    """The rows (in order) whose tier is not t."""
    out = np.empty(len(rows), dtype=rows.dtype)
    k = 0
    for i in range(len(rows)):
        if tier[rows[i]] != t:
            out[k] = rows[i]
            k += 1
    return out[:k].copy()
