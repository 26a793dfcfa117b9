"""SlotStack: the free slots (or rows) of one pool, the lowest index handed out first."""

from __future__ import annotations

from collections import deque

import numpy as np

from tpkv.errors import TierFullError

MAX_COOLING = 4096  # spills remembered without a report that they were written


class SlotStack:
    """Free slots (or rows) of one pool as a stack; the lowest index is handed out first.

    Slots given back go on top (reuse "newest": handed out next) or at the bottom (reuse
    "oldest": handed out after every slot that was free before them). For L1, "oldest" keeps a
    slot a demotion just emptied out of the next copy into L1 and out of the next step's new
    K/V while its L1 -> L2 copy still runs (both would wait for that copy on the GPU).

    L2 slots a spill (a background L2 -> L3 write) still reads are "cooling" (push_cooling):
    they lie under every other free slot, the newest spill's lowest, so that they are handed
    out last and those of the oldest spill first; `clean` counts the free slots above them.
    The controller marks a spill's slots clean once the ranks report it written (cooled_below).

    `stack[:top]` are the free slots, bottom first. With "oldest" the stack is a window into
    a buffer twice its size, so that a push at the bottom moves the window down instead of
    moving every free slot up (that memmove cost ~1 ms a push with 1.7M free L2 slots); when
    the room below runs out the free slots are moved back up once (amortised O(1) a slot).
    """

    def __init__(self, size: int, name: str, reuse: str = "newest") -> None:
        self.name = name
        self.reuse_oldest = reuse == "oldest"
        # Spills whose slots are cooling, oldest first: [epoch, slots still free here, blocks
        # it spilled, step it was pushed at]; `cool`: the second column's sum, `flying`: the
        # third's; `_spent`: how many entries lead with no slot free here (only those do)
        self.cooling: deque[list[int]] = deque()
        self.cool = 0
        self.flying = 0
        self._spent = 0
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

    @property
    def clean(self) -> int:
        """Free slots no unfinished spill reads (as far as the controller knows)."""
        return self.top - self.cool

    def pop(self, n: int) -> np.ndarray:
        if n > self.top:
            raise TierFullError(f"{self.name} needs {n} slots, {self.top} free of {self.size}")
        out = self.stack[self.top - n:self.top][::-1].copy()
        self.took(n)
        return out

    def took(self, n: int) -> None:
        """The top `n` free slots were handed out: past the clean ones, those of the oldest
        cooling spills."""
        self.top -= n
        over, i = self.cool - self.top, self._spent
        while over > 0:  # (the entries stay until written: they count blocks in flight)
            head = self.cooling[i]
            k = min(over, head[1])
            head[1] -= k
            self.cool -= k
            over -= k
            if head[1] == 0:
                i += 1
        self._spent = i

    def push(self, slots: np.ndarray) -> None:
        n = len(slots)
        assert self.top + n <= self.size, f"{self.name}: push past capacity"
        if self.top == 0 and self.cool:  # (a stack emptied by setting `top`: a rebuild)
            for c in self.cooling:
                c[1] = 0
            self.cool = 0
            self._spent = len(self.cooling)
        # Highest first, so that a later pop hands the group back in ascending order: slots a
        # session gave up together come back as runs, and copies of runs merge into fewer,
        # larger DMAs (256 KiB blocks both ways: 0.82 of the ceiling random, 0.91 in runs).
        group = np.sort(slots)[::-1] if n > 1 else slots
        if self.reuse_oldest and self.top:  # under the slots already free, above cooling ones
            self._under(group, self.cool)
        else:
            self.stack[self.top:self.top + n] = group
        self.top += n

    def push_cooling(self, slots: np.ndarray, epoch: int, step: int = 0) -> None:
        """Free `slots`, which the spill of plan `epoch` still reads: under every free slot."""
        n = len(slots)
        if n == 0:
            return
        assert self.top + n <= self.size, f"{self.name}: push past capacity"
        self._under(np.sort(slots)[::-1] if n > 1 else slots, 0)
        self.top += n
        self.cool += n
        self.flying += n
        self.cooling.append([epoch, n, n, step])
        while len(self.cooling) > MAX_COOLING and self.cooling[0][1] == 0:
            self.flying -= self.cooling.popleft()[2]  # no reports come (ranks that send none)
            self._spent -= 1

    def cooled_below(self, epoch: int) -> list[list[int]]:
        """The spills of plans before `epoch` are written: their free slots are clean now.
        Returns those spills' entries (see `cooling`)."""
        done = []
        while self.cooling and self.cooling[0][0] < epoch:
            head = self.cooling.popleft()
            self.cool -= head[1]
            self.flying -= head[2]
            if head[1] == 0:
                self._spent -= 1
            done.append(head)
        return done

    def in_flight(self) -> int:
        """Blocks of the spills not known written (free here or refilled since)."""
        return self.flying

    def _under(self, group: np.ndarray, above: int) -> None:
        """Put `group` under the free slots, with the lowest `above` of them still under it."""
        n = len(group)
        if self._lo < n:  # no room below the window: move the free slots up once
            lo = self.size
            if len(self._buf) < lo + self.size:  # ("newest": made on the first need)
                buf = np.empty(2 * self.size, dtype=np.int32)
                buf[lo:] = self.stack
                self._buf = buf
            else:
                self._buf[lo:lo + self.top] = self._buf[self._lo:self._lo + self.top].copy()
            self._lo = lo
        self._lo -= n
        lo = self._lo
        if above:
            self._buf[lo:lo + above] = self._buf[lo + n:lo + n + above].copy()
        self._buf[lo + above:lo + above + n] = group
        self.stack = self._buf[lo:lo + self.size]

    def grow(self, size: int) -> None:
        extra = np.arange(size - 1, self.size - 1, -1, dtype=np.int32)
        free = self.stack[:self.top]  # new slots go above the cooling ones
        self._place(np.concatenate([free[:self.cool], extra, free[self.cool:],
                                    np.zeros(size - len(extra) - self.top, dtype=np.int32)]),
                    self.top + len(extra))

    def shrink(self, size: int) -> bool:
        """Drop slots [size, self.size), which must all be free; -> whether they were (else
        nothing changes). Cooling slots count as clean from then on."""
        free = self.stack[:self.top]
        keep = free[free < size]
        if len(free) - len(keep) != self.size - size:  # a slot past `size` is not free
            return False
        self._place(np.concatenate([keep, np.zeros(size - len(keep), dtype=np.int32)]),
                    len(keep))
        self.cooling.clear()
        self.cool = self.flying = self._spent = 0
        return True
