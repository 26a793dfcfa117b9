"""A rank's compiled passes on a resume's critical path, before its first copy is issued: the
plan check (SlotMirror.check: ~0.2 ms as a dozen numpy calls on 700 moves, a few microseconds
here) and the copy descriptors (CopyEngine: addresses of both sides, merged runs)."""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from tpkv import kernel_pool, startup
from tpkv.numba_cache import ensure_cache_dir
from tpkv.protocol.plan import Tier

ensure_cache_dir(__file__)  # before any kernel is defined: a read-only install still caches

_HBM, _DRAM, _SSD, _NONE = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD), int(Tier.NONE)
_ROW_MASK = (1 << 32) - 1  # a block id is (generation << 32) | row (tpkv.controller.table)


@njit(cache=True, nogil=True)
def check_moves(ids: np.ndarray, tier: np.ndarray, slot: np.ndarray, block_ids: np.ndarray,
                src_tier: np.ndarray, src_slot: np.ndarray, dst_tier: np.ndarray,
                dst_slot: np.ndarray, owner1: np.ndarray, owner2: np.ndarray,
                count1: np.ndarray, count2: np.ndarray) -> np.ndarray:
    """Mask of the moves this rank can apply (SlotMirror.check). count1 / count2: zeroed
    scratch of the L1 / L2 pool sizes, zero again on return."""
    n = len(block_ids)
    ok = np.empty(n, dtype=np.bool_)
    n1, n2 = len(owner1), len(owner2)
    for i in range(n):  # the block is where the plan says it starts
        b = block_ids[i]
        row = b & _ROW_MASK
        t, s = _NONE, -1
        if b >= 0 and row < len(ids) and ids[row] == b:
            t, s = tier[row], slot[row]
        ok[i] = t == src_tier[i] and (src_tier[i] == _SSD or s == src_slot[i])
    for i in range(n):  # how often each pooled destination is named
        d = dst_slot[i]
        if dst_tier[i] == _HBM and 0 <= d < n1:
            count1[d] += 1
        elif dst_tier[i] == _DRAM and 0 <= d < n2:
            count2[d] += 1
    for i in range(n):  # L2 first: whether a demotion is applied decides its L1 slot
        if dst_tier[i] == _DRAM:
            d = dst_slot[i]
            ok[i] = ok[i] and 0 <= d < n2 and count2[d] == 1 and owner2[d] < 0
    for i in range(n):
        d = dst_slot[i]
        if dst_tier[i] == _DRAM and 0 <= d < n2:
            count2[d] = 0
    for i in range(n):  # L1 slots this plan empties here: marked apart from the counts
        if ok[i] and src_tier[i] == _HBM and 0 <= src_slot[i] < n1:
            count1[src_slot[i]] += n + 1
    for i in range(n):
        if dst_tier[i] == _HBM:
            d = dst_slot[i]
            if not (0 <= d < n1):
                ok[i] = False
                continue
            named, emptied = count1[d] % (n + 1), count1[d] > n
            ok[i] = ok[i] and named == 1 and (owner1[d] < 0 or emptied)
    for i in range(n):
        if dst_tier[i] == _HBM and 0 <= dst_slot[i] < n1:
            count1[dst_slot[i]] = 0
        if src_tier[i] == _HBM and 0 <= src_slot[i] < n1:
            count1[src_slot[i]] = 0
    return ok


@njit(cache=True, nogil=True)
def merged_copies(dev_base: int, block_bytes: int, arena_ptrs: np.ndarray, slots_per_arena: int,
                  hbm_slots: np.ndarray, host_slots: np.ndarray, h2d: bool, by_host: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) descriptors of the copies of these blocks (L2 -> L1 when `h2d`), in
    ascending address of the host side (`by_host`) or the device side, where both sides
    continue contiguously merged into one copy."""
    n = len(hbm_slots)
    dev = np.empty(n, dtype=np.int64)
    host = np.empty(n, dtype=np.int64)
    for i in range(n):
        dev[i] = dev_base + hbm_slots[i] * block_bytes
        h = host_slots[i]
        host[i] = arena_ptrs[h // slots_per_arena] + (h % slots_per_arena) * block_bytes
    key = host if by_host else dev
    order = np.argsort(key, kind="mergesort")
    src = np.empty(n, dtype=np.int64)
    dst = np.empty(n, dtype=np.int64)
    size = np.empty(n, dtype=np.int64)
    k = -1
    for j in range(n):
        i = order[j]
        s, d = (host[i], dev[i]) if h2d else (dev[i], host[i])
        if k >= 0 and s == src[k] + size[k] and d == dst[k] + size[k]:
            size[k] += block_bytes
        else:
            k += 1
            src[k], dst[k], size[k] = s, d, block_bytes
    return src[:k + 1], dst[:k + 1], size[:k + 1]


_WARM = False
_WARM_LOCK = threading.Lock()  # a second caller (tpkv.init's warm-up thread) waits for the first


def warm() -> None:
    """Compile (or load from numba's disk cache) both passes with the argument types a rank
    gives them, once per process, before it serves: compiled on first use, merged_copies' sort
    took 4 s on a fresh checkout, in the middle of a step's copies."""
    global _WARM
    if _WARM:
        return
    with _WARM_LOCK, startup.phase("worker_kernels"):
        if _WARM:
            return
        kernel_pool.ensure(None)  # on a cold cache: compiled in parallel processes first
        i64, i8 = np.int64, np.int8
        slots = np.arange(2, dtype=i64)
        merged_copies(1 << 30, 64, np.array([1 << 40], dtype=i64), 4, slots, slots, True, True)
        # a MovePlan's arrays are read-only (another type to numba than writable ones)
        ids, tier, dst_tier = slots.copy(), np.zeros(2, dtype=i8), np.ones(2, dtype=i8)
        for a in (ids, tier, dst_tier):
            a.setflags(write=False)
        check_moves(slots, np.zeros(2, dtype=i8), slots, ids, tier, ids, dst_tier, ids,
                    np.full(2, -1, dtype=i64), np.full(2, -1, dtype=i64),
                    np.zeros(2, dtype=i64), np.zeros(2, dtype=i64))
        _WARM = True
