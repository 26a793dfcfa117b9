"""The batch's block table (L1 slot of every block, session by session), patched step to step."""

from __future__ import annotations

import numpy as np

from tpkv.controller.arena import extent_index
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import BlockTable

_MAX_RUNS = 256  # above this many copied runs, one vectorized copy beats a loop of slices


class BatchTable:
    """Keeps the last step's table. A session that ran last step keeps the entries it had
    there unless a block of it changed slot since (S.dirty); blocks appended since (new tokens)
    do not count as a change. Only the entries past what is kept are looked up in the block
    table; the kept ones are copied from the last table in runs (one slice per run of sessions
    that sit in the same order and did not grow).

    Decode batches change little from step to step, and the last table is small and hot in
    cache, while the block table is large: this turns ~64K scattered reads into a few hundred
    reads and about one memcpy of the table.
    """

    def __init__(self) -> None:
        self.batch = np.zeros(0, dtype=np.int64)
        self.offsets = np.zeros(1, dtype=np.int64)
        self.lens = np.zeros(0, dtype=np.int64)
        self.slots = np.zeros(0, dtype=np.int32)

    def build(self, S: SessionTable, T: BlockTable, batch: np.ndarray,
              lens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [B + 1], slots) for `batch`; every block must be in L1 by now. `lens`: the
        sessions' block counts, when the caller has them. Per-session arrays are read and
        written at the positions whose session changed only (the batch's sessions are spread
        over arrays too large to stay in cache)."""
        n = len(batch)
        if lens is None:
            lens = S.arena.length[batch]
        offsets = np.empty(n + 1, dtype=np.int64)
        offsets[0] = 0
        np.cumsum(lens, out=offsets[1:])
        out = np.empty(int(offsets[-1]), dtype=np.int32)
        moved = None  # positions that hold another session than last step (None: all)
        if n == len(self.batch):
            moved = np.flatnonzero(self.batch != batch)
            prev = np.arange(n)  # S.table_pos of a session that kept its position
            prev[moved] = S.table_pos[batch[moved]]
        else:
            prev = S.table_pos[batch]
        dirty = S.dirty[batch]
        reuse = (prev >= 0) & ~dirty
        keep = np.zeros(n, dtype=np.int64)  # leading entries copied from the last table
        keep[reuse] = self.lens[prev[reuse]]
        if reuse.any():
            self._copy_kept(out, offsets, prev, reuse, keep, lens)
        grow = np.flatnonzero(lens > keep)
        if len(grow):
            first = keep[grow]
            more = lens[grow] - first
            num_more = int(more.sum())
            if num_more == len(grow):  # one block each (a decode step)
                src, dst = S.arena.start[batch[grow]] + first, offsets[grow] + first
            else:
                src = extent_index(S.arena.start[batch[grow]] + first, more)
                dst = extent_index(offsets[grow] + first, more)
            out[dst] = T.slot[S.arena.arena[src]]
        if moved is None:
            S.table_pos[self.batch] = -1
            S.table_pos[batch] = np.arange(n)
        elif len(moved):
            S.table_pos[self.batch[moved]] = -1
            S.table_pos[batch[moved]] = moved
        S.dirty[batch[dirty]] = False
        self.batch, self.offsets, self.lens, self.slots = batch.copy(), offsets, lens, out
        return offsets, out

    def _copy_kept(self, out: np.ndarray, offsets: np.ndarray, prev: np.ndarray,
                   reuse: np.ndarray, keep: np.ndarray, lens: np.ndarray) -> None:
        """out[offsets[i] : offsets[i] + keep[i]] = the first keep[i] entries of position
        prev[i] of the last table, for every i in `reuse`."""
        # Position i continues the run of i - 1 when both sit next to each other in both
        # tables: i - 1 kept all its entries (did not grow) and prev[i] == prev[i - 1] + 1.
        cont = np.zeros(len(reuse) + 1, dtype=bool)
        cont[1:-1] = (reuse[1:] & reuse[:-1] & (keep[:-1] == lens[:-1])
                      & (prev[1:] == prev[:-1] + 1))
        starts = np.flatnonzero(reuse & ~cont[:-1])
        if len(starts) > _MAX_RUNS:
            r = np.flatnonzero(keep)
            out[extent_index(offsets[r], keep[r])] = self.slots[
                extent_index(self.offsets[prev[r]], keep[r])]
            return
        ends = np.flatnonzero(reuse & ~cont[1:])  # the last position of each run
        dst_a = offsets[starts]
        dst_b = offsets[ends] + keep[ends]
        src_a = self.offsets[prev[starts]]
        src_b = src_a + (dst_b - dst_a)
        # memoryview slices: a plain memmove each, about half the cost of numpy slice copies
        to, old = out.data, self.slots.data
        for a, b, c, d in zip(dst_a.tolist(), dst_b.tolist(), src_a.tolist(), src_b.tolist()):
            to[a:b] = old[c:d]

    def nbytes(self) -> int:
        return int(self.batch.nbytes + self.offsets.nbytes + self.lens.nbytes
                   + self.slots.nbytes)
