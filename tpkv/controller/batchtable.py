"""The batch's block table (L1 slot of every block, session by session), patched step to step."""

from __future__ import annotations

import numpy as np

from tpkv.controller.arena import extent_index
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import BlockTable


class BatchTable:
    """Keeps the last step's table; a step copies the segments of sessions that ran last step
    and changed nothing since (S.dirty unset), and looks up only the others in the block table.

    Decode batches change little from step to step, and the last table is small and hot in
    cache, while the block table is large: this turns ~64K scattered reads into a copy.
    """

    def __init__(self) -> None:
        self.batch = np.zeros(0, dtype=np.int64)
        self.offsets = np.zeros(1, dtype=np.int64)
        self.slots = np.zeros(0, dtype=np.int32)
        self._index = np.zeros(0, dtype=np.int64)

    def build(self, S: SessionTable, T: BlockTable,
              batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [B + 1], slots) for `batch`; every block must be in L1 by now."""
        lens = S.arena.length[batch]
        offsets = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        prev = S.table_pos[batch]
        reuse = (prev >= 0) & ~S.dirty[batch]
        fresh = np.flatnonzero(~reuse)
        rows, fresh_offsets = S.arena.gather(batch[fresh], reuse=True)
        source = np.concatenate([self.slots, np.take(T.slot, rows)])
        starts = np.empty(len(batch), dtype=np.int64)
        starts[reuse] = self.offsets[prev[reuse]]
        starts[fresh] = len(self.slots) + fresh_offsets[:-1]
        if len(self._index) < total:
            self._index = np.empty(total + total // 2, dtype=np.int64)
        out = np.take(source, extent_index(starts, lens, self._index))
        S.table_pos[self.batch] = -1
        S.table_pos[batch] = np.arange(len(batch))
        S.dirty[batch] = False
        self.batch, self.offsets, self.slots = batch.copy(), offsets, out
        return offsets, out

    def nbytes(self) -> int:
        return int(self.batch.nbytes + self.offsets.nbytes + self.slots.nbytes
                   + self._index.nbytes)
