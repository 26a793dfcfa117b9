"""DemotionPieces: the L1 -> L2 copy pieces that may still run, and the slots each one touches."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tpkv.workers.copy_engine import CopyHandle


@dataclass
class _Demotion:
    """A piece of an L1 -> L2 batch that may still run, and its serial number (the slots it
    reads and writes carry it in DemotionPieces.piece_of)."""

    handle: CopyHandle
    serial: int


class DemotionPieces:
    """The L1 -> L2 pieces issued on one stream (in order), each kept until its handle is done:
    a copy into an L1 slot a piece reads, or out of an L2 slot it writes, waits for the newest
    such piece, and for no other."""

    def __init__(self, num_l1_slots: int, num_l2_slots: int) -> None:
        self.running: deque[_Demotion] = deque()  # oldest first
        # Per L1 / L2 slot: the serial of the newest piece that read / wrote it (-1: none);
        # a serial below the oldest running piece's is of a piece long done.
        self.piece_of = (np.full(num_l1_slots, -1, dtype=np.int64),
                         np.full(num_l2_slots, -1, dtype=np.int64))
        self._serial = 0

    def track(self, handle: CopyHandle, l1_slots: np.ndarray, l2_slots: np.ndarray) -> None:
        """Keep an L1 -> L2 piece (issued after every piece tracked before it, on one stream)
        until its handle is done: copies into its L1 slots or out of its L2 slots wait for it."""
        self.piece_of[0][l1_slots] = self._serial
        self.piece_of[1][l2_slots] = self._serial
        self.running.append(_Demotion(handle, self._serial))
        self._serial += 1

    def newest_into(self, l1_slots: np.ndarray, l2_slots: np.ndarray | None
                    ) -> CopyHandle | None:
        """The newest L1 -> L2 piece still running that reads one of `l1_slots` or writes one
        of `l2_slots` (the d2h stream runs in order: waiting for it waits for all before it)."""
        l1 = np.asarray(l1_slots, dtype=np.int64)
        l2 = np.full(len(l1), -1, dtype=np.int64) if l2_slots is None else l2_slots  # no slot
        return self.groups(l1, l2)[-1][0]

    def newest_writing(self, l2_slots: np.ndarray) -> CopyHandle | None:
        """The newest L1 -> L2 piece still running that writes one of `l2_slots` (an L3 read
        into them waits for it, and for no other piece)."""
        self._forget_done()
        if not len(l2_slots) or not self.running:
            return None
        dep = int(self.piece_of[1][np.asarray(l2_slots, dtype=np.int64)].max())
        at = dep - self.running[0].serial
        return self.running[at].handle if at >= 0 else None

    def groups(self, l1_slots: np.ndarray, l2_slots: np.ndarray
               ) -> list[tuple[CopyHandle | None, np.ndarray]]:
        """Copies into L1 (positions into l1_slots / l2_slots) grouped by the newest L1 -> L2
        piece still running that reads one of the copy's L1 slot or writes its L2 slot: that
        piece's handle (None: no wait), oldest piece first, so the groups can be issued in
        order on one stream as their pieces finish."""
        self._forget_done()
        n = len(l1_slots)
        if not n or not self.running:
            return [(None, np.arange(n))]
        l1 = np.asarray(l1_slots, dtype=np.int64)
        l2 = np.asarray(l2_slots, dtype=np.int64)
        dep = self.piece_of[0][l1]  # a copy, as fancy indexing makes one
        named = l2 >= 0
        dep[named] = np.maximum(dep[named], self.piece_of[1][l2[named]])
        dep -= self.running[0].serial  # positions in the deque; < 0: done or none
        dep[dep < 0] = -1
        if dep.max() < 0:
            return [(None, np.arange(n))]
        order = np.argsort(dep, kind="stable")
        cuts = np.flatnonzero(np.diff(dep[order])) + 1
        return [(None if dep[g[0]] < 0 else self.running[int(dep[g[0]])].handle, g)
                for g in np.split(order, cuts)]

    def _forget_done(self) -> None:
        """Drop the pieces done from the front (the stream runs them in order)."""
        while self.running and self.running[0].handle.done():
            self.running.popleft()
