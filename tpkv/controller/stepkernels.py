"""Compiled loops (numba) over the sessions of a step: resolve, check, count blocks, record runs.

Why: each of these was a handful of numpy calls over the batch's 1024 sessions, whose
per-session arrays are spread over tables too large to stay in cache; one pass reads each
session's entries once. A kernel that finds a bad request returns a code instead of raising:
the caller then runs the plain checks, which raise with the same messages as before.
"""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import PREFETCH_AHEAD, A, _jit, prefetch

OK, BAD_HANDLE, NEGATIVE, DUPLICATE = 0, 1, 2, 3


@_jit
def batch_blocks(batch: A, add: A, tokens: A, pending: A, length: A, count_l1: A,
                 block_tokens: int, mark: A) -> tuple[int, A, A, A, A, A, int, int, int]:
    """Tokens and blocks of a step's sessions, before anything changes. Returns (code, tokens
    after the step, blocks before it, blocks the new tokens open, blocks after it (at least
    those before), positions of sessions with blocks outside L1, and the sums of the blocks
    before, opened and after). `mark` is a per-session scratch of -1s, left as found; code
    NEGATIVE or DUPLICATE when an entry of `add` is < 0 or a session appears twice."""
    n = len(batch)
    new_tokens = np.empty(n, dtype=np.int64)
    before = np.empty(n, dtype=np.int64)
    opened = np.empty(n, dtype=np.int64)
    after = np.empty(n, dtype=np.int64)
    missing = np.empty(n, dtype=np.int64)
    code = OK
    k = 0
    sum_before = sum_opened = sum_after = 0
    for i in range(n):
        if i + PREFETCH_AHEAD < n:  # its record (tokens, pending, length, mark) and count
            ahead = batch[i + PREFETCH_AHEAD]
            prefetch(tokens, ahead)
            prefetch(count_l1, ahead)
        s = batch[i]
        if add[i] < 0:
            code = NEGATIVE
        if mark[s] >= 0:
            code = DUPLICATE if code == OK else code
        mark[s] = i
        t = tokens[s] + pending[s] + add[i]
        b = length[s]
        new_tokens[i] = t
        before[i] = b
        opened[i] = (t + (block_tokens - 1)) // block_tokens - b
        after[i] = b + max(opened[i], 0)
        sum_before += b
        sum_opened += opened[i]
        sum_after += after[i]
        if count_l1[s] < b:
            missing[k] = i
            k += 1
    for i in range(n):
        mark[batch[i]] = -1
    return (code, new_tokens, before, opened, after, missing[:k].copy(), sum_before, sum_opened,
            sum_after)


@_jit
def resolve_handles(handles: A, handle_of: A) -> tuple[bool, A]:
    """Session indices of handles ((gen << 32) | index); False if one names no open session."""
    n, cap = len(handles), len(handle_of)
    idx = np.empty(n, dtype=np.int64)
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            ahead = handles[i + PREFETCH_AHEAD] & 0xFFFFFFFF
            if ahead < cap:
                prefetch(handle_of, ahead)
        h = handles[i]
        s = h & 0xFFFFFFFF
        if h < 0 or s >= cap or handle_of[s] != h:
            return False, idx
        idx[i] = s
    return True, idx


@_jit
def start_runs(batch: A, new_tokens: A, tick: int, tokens: A, pending: A, runs: A,
               run_hist: A, clean: A) -> None:
    """The step is valid: its sessions take their new token counts (announced tokens are
    written now), count a run at `tick` (run_hist [K, S], newest first) and are not clean."""
    k = run_hist.shape[0]
    for i in range(len(batch)):
        s = batch[i]
        tokens[s] = new_tokens[i]
        pending[s] = 0
        runs[s] += 1
        for j in range(k - 1, 0, -1):
            run_hist[j, s] = run_hist[j - 1, s]
        run_hist[0, s] = tick
        clean[s] = False


@_jit
def outside(idx: A, batch: A, mark: A) -> A:
    """Mask of `idx` entries not in `batch`; `mark` is a per-session scratch of -1s, kept."""
    for i in range(len(batch)):
        mark[batch[i]] = i
    out = np.empty(len(idx), dtype=np.bool_)
    for i in range(len(idx)):
        out[i] = mark[idx[i]] < 0
    for i in range(len(batch)):
        mark[batch[i]] = -1
    return out


@_jit
def alloc_blocks(batch: A, n_new: A, first: A, free_rows: A, free_top: int, slots: A,
                 tick: int, runs: A, count_l1: A, session: A, logical: A, last_tick: A,
                 count: A, runs_seen: A, tier: A, slot: A, owner_l1: A,
                 gen: A) -> tuple[A, A, A, A]:
    """Table rows for the blocks the step's new tokens open: n_new[i] > 0 blocks of session
    batch[i] from logical first[i] on, in batch order, each in the next of `slots` (L1), rows
    taken from the top of the free-row stack as SlotStack.pop hands them out. They count as
    accessed once at `tick` (the session's runs so far folded in). Returns (rows, batch
    position of each, block ids, logical indices)."""
    total = 0
    for i in range(len(batch)):
        total += max(n_new[i], 0)
    rows = np.empty(total, dtype=np.int32)
    pos = np.empty(total, dtype=np.int64)
    ids = np.empty(total, dtype=np.int64)
    lg = np.empty(total, dtype=np.int64)
    k = 0
    for i in range(len(batch)):
        s = batch[i]
        for j in range(n_new[i]):
            r = free_rows[free_top - 1 - k]
            rows[k] = r
            pos[k] = i
            ids[k] = (np.int64(gen[r]) << 32) | r
            lg[k] = first[i] + j
            session[r] = s
            logical[r] = first[i] + j
            last_tick[r] = tick
            count[r] = 1
            runs_seen[r] = runs[s]
            tier[r] = 0  # L1
            slot[r] = slots[k]
            owner_l1[slots[k]] = r
            k += 1
        if n_new[i] > 0:
            count_l1[s] += n_new[i]
    return rows, pos, ids, lg


@_jit
def written_kept(batch: A, before: A, rewrite: A, after: A, block_tokens: int, arena: A,
                 start: A, tier: A, slot: A, kept: A, kept_last: A, l3copy: A,
                 l3_last: A) -> A:
    """The copies of the blocks a step writes into that held tokens before it: the last block
    of each session that gets tokens, when it was part full (`before`, `after`: its tokens
    before and after the step), and the blocks of the `rewrite` tokens before `before` that it
    writes again (counted by an earlier step that no forward fed: TpkvRuntime's credits). They
    are stale once the step writes. Their L2 copies (BlockTable.kept, by L1 slot) are
    forgotten here, and their L2 slots returned for the caller to free; their L3 copies
    (BlockTable.l3copy) are void. Only sessions flagged `kept_last` (a block of theirs promoted
    keeping its L2 copy since they last got tokens) or `l3_last` (loaded from L3, or recomputed
    keeping its record, since) are
    looked at: one flag each, instead of three lookups in tables of a million rows; their
    flags are cleared (the blocks they open from here on are new)."""
    n = len(batch)
    total = 0
    for i in range(n):
        first = (before[i] - rewrite[i]) // block_tokens
        total += max((before[i] + block_tokens - 1) // block_tokens - first, 0)
    out = np.empty(total, dtype=np.int32)
    k = 0
    for i in range(n):
        s = batch[i]
        b = before[i] - rewrite[i]  # the first token the step writes
        two, three = kept_last[s], l3_last[s]
        if not (two or three) or after[i] <= b:
            continue
        kept_last[s] = False
        l3_last[s] = False
        # blocks b's block .. the last that held tokens before the step (none when b starts
        # a block past them)
        for j in range(b // block_tokens, (before[i] + block_tokens - 1) // block_tokens):
            r = arena[start[s] + j]
            if three:
                l3copy[r] = 0
            if two and tier[r] == 0:  # (in L1, as every block of the batch is by now)
                z = slot[r]
                if kept[z] >= 0:
                    out[k] = kept[z]
                    kept[z] = -1
                    k += 1
    return out[:k].copy()


@_jit
def l3_moved(rows: A, sessions: A, mode: int, epoch: int, l3copy: A, l3_other: A,
             l3_last: A, l3_epoch: A) -> None:
    """PlanBuilder's bookkeeping of moves out of or into L3, in one pass: every session is
    stamped with the plan's epoch (SessionTable.l3_epoch); mode 1 (a load, L3 copies on):
    the row keeps its record as its copy (l3copy, one more record of its session not in L3,
    its session flagged l3_last); mode 2 (a kept spill): the copy becomes its place in L3."""
    for i in range(len(rows)):
        s = sessions[i]
        l3_epoch[s] = epoch
        if mode == 1:
            l3copy[rows[i]] = 1
            l3_other[s] += 1
            l3_last[s] = True
        elif mode == 2:
            l3copy[rows[i]] = 0
            l3_other[s] -= 1


@_jit
def keep_promoted(rows: A, slots: A, room: int, tier: A, slot: A, session: A, kept: A,
                  kept_last: A) -> tuple[int, A]:
    """PlanBuilder.end_phase: rows just promoted keep their old L2 slots (`slots`) as copies,
    in order, while still in L1 and while `room` copies may be added (BlockTable.keep_reserve);
    their sessions are flagged kept_last. Returns (copies kept, the other slots, to free)."""
    n = len(rows)
    rest = np.empty(n, dtype=np.int64)
    k = 0
    j = 0
    for i in range(n):
        r = rows[i]
        if tier[r] == 0 and k < room:  # (still in L1: not dropped again in the phase)
            kept[slot[r]] = slots[i]
            kept_last[session[r]] = True
            k += 1
        else:
            rest[j] = slots[i]
            j += 1
    return k, rest[:j].copy()
