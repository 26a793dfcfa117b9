"""The batch's block table (L1 slot of every block, session by session), patched step to step."""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import batch_slots
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import BlockTable


class BatchTable:
    """Keeps the last step's table. A session that ran last step keeps the entries it had
    there unless a block of it changed slot since (S.dirty); blocks appended since (new tokens)
    do not count as a change. Only the entries past what is kept are looked up in the block
    table; the kept ones are copied from the last table (one compiled pass, kernels.batch_slots).

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
              lens: np.ndarray | None = None,
              total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(offsets [B + 1], slots) for `batch`; every block must be in L1 by now. `lens`: the
        sessions' block counts and `total` their sum, when the caller has them. Per-session
        arrays are read and written at the positions whose session changed only (the batch's
        sessions are spread over arrays too large to stay in cache)."""
        if lens is None:
            lens = S.arena.length[batch]
        if total is None:
            total = int(lens.sum())
        offsets = np.empty(len(batch) + 1, dtype=np.int64)
        out = np.empty(total, dtype=np.int32)
        if batch_slots(batch, lens, self.batch, self.offsets, self.lens, self.slots, S.table_pos,
                       S.dirty, S.arena.arena, S.arena.start, T.slot, offsets, out):
            raise AssertionError("a session of the batch has fewer blocks than last step")
        self.batch, self.offsets, self.lens, self.slots = batch.copy(), offsets, lens, out
        return offsets, out

    def nbytes(self) -> int:
        return int(self.batch.nbytes + self.offsets.nbytes + self.lens.nbytes
                   + self.slots.nbytes)
