"""Compiled loops (numba) for the controller's per-step hot paths.

Why: a 1024-session step touches a few thousand table entries, but as whole-array numpy it
took ~400 numpy calls of 3-10 us each, most of them on arrays of a few hundred entries. Each
kernel here replaces one such chain of calls with one pass over the same entries, with the
same results in the same order (the golden tests compare every StepResult bit for bit).

Kernels never allocate what the caller can size (outputs are passed in where the length is
known), never raise (a broken invariant is returned as a code the caller turns into an
error), and are compiled once per argument types and cached on disk (`cache=True`): call them
with the dtypes the tables use, so that no call site adds a signature.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_jit = njit(cache=True, nogil=True, boundscheck=False)
A = np.ndarray  # argument annotations (numba types each call from its arguments)


@_jit
def move_rows(rows: A, dst_slots: A, session: A, tier: A, slot: A, owner_src: A, owner_dst: A,
              count_src: A, count_dst: A, touched: A, dirty: A, clean: A, demoted_at: A,
              dst: int, now_s: float, demote: bool, sess_out: A, old_out: A) -> None:
    """PlanBuilder.move on the table: rows go to (dst, dst_slots). Source slots leave their
    owner map (owner_src empty: from L3), destinations enter it (owner_dst empty: to L3),
    per-session tier counts follow, the sessions are touched and dirty, and lose `clean` when
    the move goes to L1; with `demote`, demoted_at = now_s (float32, as numpy would cast).
    Writes each row's session and old slot to sess_out / old_out."""
    to_l1 = dst == 0
    for i in range(len(rows)):
        r = rows[i]
        s = session[r]
        old = slot[r]
        sess_out[i] = s
        old_out[i] = old
        if len(owner_src):
            owner_src[old] = -1
        if len(owner_dst):
            owner_dst[dst_slots[i]] = r
        tier[r] = dst
        slot[r] = dst_slots[i]
        count_src[s] -= 1
        count_dst[s] += 1
        touched[s] = True
        dirty[s] = True
        if to_l1:
            clean[s] = False
        if demote:
            demoted_at[r] = np.float32(now_s)


@_jit
def plan_arrays(rows: A, sess: A, gen: A, logical: A, in_flight: A,
                local: A) -> tuple[A, A, A, A]:
    """The per-move arrays of a MovePlan from its rows and their sessions: block ids
    (gen << 32 | row), the index of each move's session among the plan's sessions in order of
    first use, logical indices (int64); marks the rows in flight. `local` is a per-session
    scratch of -1s, left as found. Returns (ids, session_idx, logical, sessions in order)."""
    n = len(rows)
    ids = np.empty(n, dtype=np.int64)
    sidx = np.empty(n, dtype=np.int32)
    lg = np.empty(n, dtype=np.int64)
    order = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):
        r = rows[i]
        ids[i] = (np.int64(gen[r]) << 32) | np.int64(r)
        lg[i] = logical[r]
        in_flight[r] = 1
        s = sess[i]
        j = local[s]
        if j < 0:
            j = k
            local[s] = k
            order[k] = s
            k += 1
        sidx[i] = j
    for j in range(k):
        local[order[j]] = -1
    return ids, sidx, lg, order[:k]


@_jit
def walk_coldest(units: A, need: int, want_tier: int, use_threshold: bool, threshold: np.float32,
                 skip: A, arena: A, start: A, length: A, tier: A, pinned: A,
                 attn: A) -> tuple[A, int, A]:
    """Walk `units` (sessions, coldest first) and count each one's rows on `want_tier` that may
    go (not pinned; with use_threshold, attention mass below `threshold`; not in the sorted
    `skip`) until `need` are counted. Returns (those rows of units[:stop], stop, per_unit[:stop]);
    stop = len(units) when they hold fewer than `need`."""
    n = len(units)
    per_unit = np.zeros(n, dtype=np.int64)
    cap = max(need, 16)
    picked = np.empty(cap, dtype=np.int32)
    total = 0
    stop = n
    for u in range(n):
        s = units[u]
        a = start[s]
        count = 0
        for j in range(a, a + length[s]):
            r = arena[j]
            if tier[r] != want_tier or pinned[r] != 0:
                continue
            if use_threshold and not attn[r] < threshold:
                continue
            if len(skip):
                at = np.searchsorted(skip, r)
                if at < len(skip) and skip[at] == r:
                    continue
            if total == cap:
                cap *= 2
                grown = np.empty(cap, dtype=np.int32)
                grown[:total] = picked[:total]
                picked = grown
            picked[total] = r
            total += 1
            count += 1
        per_unit[u] = count
        if total >= need:
            stop = u + 1
            break
    return picked[:total].copy(), stop, per_unit[:stop].copy()


@_jit
def batch_slots(batch: A, lens: A, prev_batch: A, prev_offsets: A, prev_lens: A, prev_slots: A,
                table_pos: A, dirty: A, arena: A, start: A, slot: A, offsets: A, out: A) -> int:
    """BatchTable.build in one pass: a session that sat in the last table and is not dirty
    copies its entries from there (position prev, found through table_pos unless it kept its
    position); entries past those are read from the block table through the arena. Then
    table_pos follows the new table and the batch's sessions are clean again. Returns -1 if
    a session has fewer blocks than it had in the last table (never: lengths only grow)."""
    n = len(batch)
    same = n == len(prev_batch)
    offsets[0] = 0
    for i in range(n):
        offsets[i + 1] = offsets[i] + lens[i]
    for i in range(n):
        s = batch[i]
        p = i if same and prev_batch[i] == s else table_pos[s]
        keep = 0
        if p >= 0 and not dirty[s]:
            keep = prev_lens[p]
            if keep > lens[i]:
                return -1
            a, b = offsets[i], prev_offsets[p]
            for j in range(keep):
                out[a + j] = prev_slots[b + j]
        a, b = offsets[i], start[s]
        for j in range(keep, lens[i]):
            out[a + j] = slot[arena[b + j]]
    if same:
        for i in range(n):
            if prev_batch[i] != batch[i]:
                table_pos[prev_batch[i]] = -1
        for i in range(n):
            if prev_batch[i] != batch[i]:
                table_pos[batch[i]] = i
    else:
        for i in range(len(prev_batch)):
            table_pos[prev_batch[i]] = -1
        for i in range(n):
            table_pos[batch[i]] = i
    for i in range(n):
        dirty[batch[i]] = False
    return 0
