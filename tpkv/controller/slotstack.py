"""SlotStack: the free slots (or rows) of one pool, the lowest index handed out first."""

from __future__ import annotations

import numpy as np

from tpkv.errors import TierFullError


class SlotStack:
    """Free slots (or rows) of one pool as a stack; the lowest index is handed out first.

    Slots given back go on top (reuse "newest": handed out next) or at the bottom (reuse
    "oldest": handed out after every slot that was free before them). For L1, "oldest" keeps a
    slot a demotion just emptied out of the next copy into L1 and out of the next step's new
    K/V while its L1 -> L2 copy still runs (both would wait for that copy on the GPU).

    `stack[:top]` are the free slots, bottom first. With "oldest" the stack is a window into
    a buffer twice its size, so that a push at the bottom moves the window down instead of
    moving every free slot up (that memmove cost ~1 ms a push with 1.7M free L2 slots); when
    the room below runs out the free slots are moved back up once (amortised O(1) a slot).
    """

    def __init__(self, size: int, name: str, reuse: str = "newest") -> None:
        self.name = name
        self.reuse_oldest = reuse == "oldest"
        self._place(np.arange(size - 1, -1, -1, dtype=np.int32), size)

    def _place(self, content: np.ndarray, top: int) -> None:
        """A new buffer holding `content` (the whole stack, free part first) as its window."""
        size = len(content)
        self._lo = size if self.reuse_oldest else 0  # room below the window
        self._buf = np.empty(self._lo + size, dtype=np.int32)
        self._buf[self._lo:] = content
        self.stack = self._buf[self._lo:]
        self.top = top  # stack[:top] are free

    @property
    def size(self) -> int:
        return len(self.stack)

    def pop(self, n: int) -> np.ndarray:
        if n > self.top:
            raise TierFullError(f"{self.name} needs {n} slots, {self.top} free of {self.size}")
        out = self.stack[self.top - n:self.top][::-1].copy()
        self.top -= n
        return out

    def push(self, slots: np.ndarray) -> None:
        n = len(slots)
        assert self.top + n <= self.size, f"{self.name}: push past capacity"
        # Highest first, so that a later pop hands the group back in ascending order: slots a
        # session gave up together come back as runs, and copies of runs merge into fewer,
        # larger DMAs (256 KiB blocks both ways: 0.82 of the ceiling random, 0.91 in runs).
        group = np.sort(slots)[::-1] if n > 1 else slots
        if self.reuse_oldest and self.top:  # under the slots already free
            if self._lo < n:  # no room below the window: move the free slots back up once
                lo = self.size
                self._buf[lo:lo + self.top] = self._buf[self._lo:self._lo + self.top].copy()
                self._lo = lo
            self._lo -= n
            self._buf[self._lo:self._lo + n] = group
            self.stack = self._buf[self._lo:self._lo + self.size]
        else:
            self.stack[self.top:self.top + n] = group
        self.top += n

    def grow(self, size: int) -> None:
        extra = np.arange(size - 1, self.size - 1, -1, dtype=np.int32)
        free = self.stack[:self.top]
        self._place(np.concatenate([extra, free, np.zeros(size - len(extra) - self.top,
                                                         dtype=np.int32)]),
                    self.top + len(extra))

    def shrink(self, size: int) -> bool:
        """Drop slots [size, self.size), which must all be free; -> whether they were (else
        nothing changes)."""
        free = self.stack[:self.top]
        keep = free[free < size]
        if len(free) - len(keep) != self.size - size:  # a slot past `size` is not free
            return False
        self._place(np.concatenate([keep, np.zeros(size - len(keep), dtype=np.int32)]),
                    len(keep))
        return True
