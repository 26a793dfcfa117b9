"""Compiled loops (numba) for the controller's per-step hot paths.

Why: a 1024-session step touches a few thousand table entries, but as whole-array numpy it
took ~400 numpy calls of 3-10 us each, most of them on arrays of a few hundred entries. Each
kernel here replaces one such chain of calls with one pass over the same entries, with the
same results in the same order (the golden tests compare every StepResult bit for bit).

Kernels never allocate what the caller can size (outputs are passed in where the length is
known), never raise (a broken invariant is returned as a code the caller turns into an
error), and are compiled once per argument types and cached on disk (`cache=True`): call them
with the dtypes the tables use, so that no call site adds a signature. Copy loops index views
from 0 (`dst[j] = src[j]`): numba checks every computed index for wraparound, which keeps
`out[a + j] = src[b + j]` from vectorizing (7x slower measured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tpkv.numba_cache import ensure_cache_dir

ensure_cache_dir(__file__)  # before any kernel is defined: a read-only install still caches
_jit = njit(cache=True, nogil=True, boundscheck=False)
A = np.ndarray  # argument annotations (numba types each call from its arguments)
PREFETCH_AHEAD = 8  # how many sessions (rows) ahead a loop asks for lines


@intrinsic
def _prefetch(typingctx: Any, arr: Any, idx: Any) -> tuple[Any, Any]:
    """Ask for the cache line of arr[idx] (llvm.prefetch: a read, kept in every cache level)
    without waiting for it. A loop over a list of sessions (the batch, eviction candidates) or
    of block rows (moves) reads a line or a few per entry from tables too large to stay in
    cache, scattered; where the CPU does not reach the next entries' loads on its own, the loop
    asks for the lines of the entry PREFETCH_AHEAD places on first, so that their misses
    overlap with the work on the ones before. Results do not change (a prefetch writes
    nothing)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                       wraparound=False)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, ir.IntType(8).as_pointer()), i32(0), i32(3),
                          i32(1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


prefetch = cast(Callable[[A, int], None], _prefetch)  # as kernels call it (typed for mypy)


@_jit
def move_rows(rows: A, src: int, dst: int, free_stack: A, free_top: int, session: A, tier: A,
              slot: A, owner_src: A, owner_dst: A, count_src: A, count_dst: A, touched: A,
              dirty: A, clean: A, demoted_at: A, now_s: float, at: int, out_rows: A,
              out_sess: A, out_src_slot: A, out_dst_slot: A, out_src_tier: A,
              out_dst_tier: A) -> None:
    """PlanBuilder.move on the table: rows go from `src` to `dst`, into the slots on top of
    the free stack (free_stack[free_top - 1] first, as SlotStack.pop hands them out; none for
    L3: -1). Source slots leave their owner map (owner_src empty: from L3), destinations enter
    it (owner_dst empty: to L3); per-session tier counts follow; the sessions are touched and
    dirty and, moving to L1, not clean; a demotion sets demoted_at = now_s (float32, as numpy
    casts). Each move lands in the phase's buffers at position at + i."""
    to_l1 = dst == 0
    demote = dst > src
    n = len(rows)
    for i in range(n):
        if i + PREFETCH_AHEAD < n:  # rows a session appended step by step lie apart
            ahead = rows[i + PREFETCH_AHEAD]
            prefetch(session, ahead)
            prefetch(tier, ahead)
            prefetch(slot, ahead)
        r = rows[i]
        s = session[r]
        old = slot[r]
        new = free_stack[free_top - 1 - i] if len(owner_dst) else -1
        if len(owner_src):
            owner_src[old] = -1
        if len(owner_dst):
            owner_dst[new] = r
        tier[r] = dst
        slot[r] = new
        count_src[s] -= 1
        count_dst[s] += 1
        touched[s] = True
        dirty[s] = True
        if to_l1:
            clean[s] = False
        if demote:
            demoted_at[r] = np.float32(now_s)
        j = at + i
        out_rows[j] = r
        out_sess[j] = s
        out_src_slot[j] = old
        out_dst_slot[j] = new
        out_src_tier[j] = src
        out_dst_tier[j] = dst


@_jit
def plan_arrays(n: int, rows: A, sess: A, src_slot: A, dst_slot: A, src_tier: A, dst_tier: A,
                gen: A, logical: A, in_flight: A, local: A) -> tuple[A, ...]:
    """The arrays of a MovePlan, in its wire dtypes, from the first n moves of the phase's
    buffers: block ids (gen << 32 | row), the index of each move's session among the plan's
    sessions in order of first use, logical indices, tiers and slots; marks the rows in flight.
    `local` is a per-session scratch of -1s, left as found. Returns (rows, ids, src_tier,
    src_slot, dst_tier, dst_slot, session_idx, logical, sessions in order of first use)."""
    out_rows = rows[:n].copy()
    ids = np.empty(n, dtype=np.int64)
    sidx = np.empty(n, dtype=np.int32)
    lg = np.empty(n, dtype=np.int64)
    order = np.empty(n, dtype=np.int64)
    k = 0
    for i in range(n):
        r = rows[i]
        ids[i] = (np.int64(gen[r]) << 32) | r
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
    return (out_rows, ids, src_tier[:n].copy(), src_slot[:n].copy(), dst_tier[:n].copy(),
            dst_slot[:n].copy(), sidx, lg, order[:k].copy())


@_jit
def emptied_sessions(sess: A, count: A, mark: A) -> A:
    """The sessions of `sess` (with repeats) whose count is 0, once each, in order of first
    appearance: PlanBuilder.emptied_l3 in one pass instead of a gather, a mask, a filter and a
    set. `mark` is a per-session scratch of -1s, left as found."""
    out = np.empty(len(sess), dtype=np.int64)
    k = 0
    for i in range(len(sess)):
        s = sess[i]
        if count[s] == 0 and mark[s] < 0:
            mark[s] = k
            out[k] = s
            k += 1
    for j in range(k):
        mark[out[j]] = -1
    return out[:k].copy()


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
        if u + 1 < n:  # the next session's record (start, length), read after this walk
            prefetch(start, units[u + 1])
        s = units[u]
        a = start[s]
        count = 0
        for j in range(a, a + length[s]):
            r = arena[j]
            if tier[r] != want_tier or pinned[r] != 0:
                continue
            if use_threshold and not attn[r] < threshold:
                continue
            if len(skip):  # bisect by hand: np.searchsorted costs seconds of compile time
                lo, hi = 0, len(skip)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if skip[mid] < r:
                        lo = mid + 1
                    else:
                        hi = mid
                if lo < len(skip) and skip[lo] == r:
                    continue
            if total == cap:
                cap *= 2
                grown = np.empty(cap, dtype=np.int32)
                for q in range(total):  # a slice assignment here costs 5 s of compile time
                    grown[q] = picked[q]
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
def gave_up(units: A, stop: int, per_unit: A, mark_clean: bool, clean: A, touched: A,
            dirty: A) -> tuple[A, A]:
    """After walk_coldest: the sessions of units[:stop] that gave rows (now touched and dirty,
    as PlanBuilder.touch makes them) and how many each; with mark_clean, those that gave none
    become clean (only pinned blocks of them are left in L1)."""
    gave = np.empty(stop, dtype=units.dtype)
    sizes = np.empty(stop, dtype=per_unit.dtype)
    k = 0
    for u in range(stop):
        s = units[u]
        if per_unit[u] > 0:
            gave[k] = s
            sizes[k] = per_unit[u]
            k += 1
            touched[s] = True
            dirty[s] = True
        elif mark_clean:
            clean[s] = True
    return gave[:k].copy(), sizes[:k].copy()


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
        if i + PREFETCH_AHEAD < n:  # its record (table_pos, start) and dirty flag
            ahead = batch[i + PREFETCH_AHEAD]
            prefetch(table_pos, ahead)
            prefetch(dirty, ahead)
        s = batch[i]
        p = i if same and prev_batch[i] == s else table_pos[s]
        keep = 0
        if p >= 0 and not dirty[s]:
            keep = prev_lens[p]
            if keep > lens[i]:
                return -1
            dst, src = out[offsets[i]:offsets[i] + keep], prev_slots[prev_offsets[p]:]
            for j in range(keep):  # on views: no negative-index checks, so it vectorizes
                dst[j] = src[j]
        dst, rows = out[offsets[i]:offsets[i + 1]], arena[start[s]:]
        for j in range(keep, lens[i]):
            dst[j] = slot[rows[j]]
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


@_jit
def count_either(a: A, b: A) -> int:
    """np.count_nonzero(a | b) in one pass and no temporary: entries where a or b is nonzero
    (two arrays over every session, in each step that spills)."""
    n = 0
    for i in range(len(a)):
        n += (a[i] != 0) | (b[i] != 0)
    return n


@_jit
def uncopied_running(rows: A, l3copy: A) -> A:
    """np.cumsum(l3copy[rows] == 0) in one pass: after each of `rows`, how many so far have
    no L3 copy (whose spill writes a record)."""
    out = np.empty(len(rows), dtype=np.int64)
    n = 0
    for i in range(len(rows)):
        n += l3copy[rows[i]] == 0
        out[i] = n
    return out


@_jit
def pin_mass(owner: A, attn: A, bits: A, fraction: float, cap: int, vals: A, high: A,
             low: A) -> tuple[int, int]:
    """policy.auto_pin_threshold over the attention of the blocks L1 holds (`attn[owner[s]]`
    for every owned slot s), without gathering it or sorting: the count-th largest positive
    mass found by its float32 bits (`bits`: attn viewed as int32; positive floats order as
    their bits), top 16 bits first (a count per value in `high`, 32768), then the low 16 of
    those in the bucket it falls in (`low`, 65536). `vals` (len(owner)) holds the positive
    masses' bits. -> (bits of the count-th largest, 1 if more than `count` masses are at
    least that (ties at the edge)); (-1, 0) where nothing qualifies (+inf)."""
    n = 0
    m = 0
    high[:] = 0
    low[:] = 0
    for i in range(len(owner)):
        if i + PREFETCH_AHEAD < len(owner) and owner[i + PREFETCH_AHEAD] >= 0:
            prefetch(attn, owner[i + PREFETCH_AHEAD])
        r = owner[i]
        if r < 0:
            continue
        n += 1
        if attn[r] > 0:  # (NaN is not)
            b = bits[r]
            vals[m] = b
            m += 1
            high[b >> 16] += 1
    count = min(int(np.floor(fraction * n)), cap, m)
    if count <= 0:
        return -1, 0
    above = 0  # masses in buckets higher than the one found
    h = len(high) - 1
    while above + high[h] < count:
        above += high[h]
        h -= 1
    for i in range(m):
        if vals[i] >> 16 == h:
            low[vals[i] & 0xFFFF] += 1
    at_least = above  # masses >= the value found, once found
    v = len(low) - 1
    while at_least + low[v] < count:
        at_least += low[v]
        v -= 1
    at_least += low[v]
    return (h << 16) | v, int(at_least > count)
