"""Compiled loops (numba) over sessions' rows for the planner: the rows a step demands and what
loading or recomputing them costs, the rows a prefetch brings up, rows split by tier.

Each replaced a gather of a few sessions' rows and a filter on their tiers in numpy; results are
those of the numpy code (see plankernels.py for the rules these loops keep).
"""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import A, _jit


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
    room1 on L2 and the first room2 on L3 (none for a room <= 0), so a session too big for one
    step's room is staged over several. A staged block keeps its L3 record as a copy until the
    session's last L3 block leaves, so a part staged and demoted again costs no write."""
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
        take3 = on3 > 0 and cool3 == 0
        for r in rows:
            t = tier[r]
            if t == 1 and n1 < room1 and not now_s - np.float64(demoted_at[r]) < cooldown_s:
                up[n1] = r
                n1 += 1
            elif t == 2 and take3 and n2 < room2:
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
