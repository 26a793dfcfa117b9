"""Slot accounting for one tier pool: which slots are free, with typed errors on misuse."""

from __future__ import annotations

import numpy as np

from tpkv.errors import SlotError, TierFullError


class SlotAllocator:
    """Free-list allocator over `num_slots` slots; lowest slots first. alloc/free/take cost
    O(slots named) in numpy; the first alloc() after a take() rebuilds the stack (O(pool))."""

    def __init__(self, num_slots: int, tier_name: str) -> None:
        if num_slots <= 0:
            raise SlotError(f"{tier_name} needs at least one slot, got {num_slots}")
        self.tier_name = tier_name
        self.num_slots = num_slots
        self._used = np.zeros(num_slots, dtype=bool)
        # Stack of free slots, top at the end; reversed so that slot 0 is handed out first.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._num_free = num_slots
        # take() of given slots (a worker mirroring the controller) leaves the stack stale
        # rather than rebuilding it from the whole pool each time; alloc() rebuilds it first.
        self._stale = False

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def alloc(self, n: int) -> np.ndarray:
        """Take `n` free slots; TierFullError (nothing taken) when fewer are free."""
        if n < 0:
            raise SlotError(f"{self.tier_name}: cannot allocate {n} slots")
        if n > self._num_free:
            raise TierFullError(
                f"{self.tier_name} needs {n} slots, {self._num_free} free of {self.num_slots}"
            )
        if self._stale:
            self._rebuild_free()
        start = self._num_free - n
        slots = self._free[start:self._num_free][::-1].copy()
        self._num_free = start
        self._used[slots] = True
        return slots

    def take(self, slots: np.ndarray) -> None:
        """Mark the given free slots used (a worker mirroring the controller's choice)."""
        slots = self._check(slots)
        if self._used[slots].any():
            taken = slots[self._used[slots]]
            raise SlotError(f"{self.tier_name}: slots already in use: {taken[:8].tolist()}")
        self._used[slots] = True
        self._num_free -= len(slots)
        self._stale = True

    def free(self, slots: np.ndarray) -> None:
        """Return used slots; SlotError (nothing freed) on a double free or a bad index."""
        slots = self._check(slots)
        if not self._used[slots].all():
            idle = slots[~self._used[slots]]
            raise SlotError(f"{self.tier_name}: double free of slots {idle[:8].tolist()}")
        self._used[slots] = False
        n = len(slots)
        if not self._stale:
            self._free[self._num_free:self._num_free + n] = np.sort(slots)[::-1]
        self._num_free += n

    def is_used(self, slots: np.ndarray) -> np.ndarray:
        return self._used[self._check(slots)]

    def used_slots(self) -> np.ndarray:
        return np.flatnonzero(self._used)

    def check_integrity(self) -> None:
        """Internal invariant: free stack and used mask describe the same set."""
        if self._stale:
            assert int(self._used.sum()) == self.num_slots - self._num_free, "counts disagree"
            self._rebuild_free()
        free = self._free[:self._num_free]
        assert len(np.unique(free)) == len(free), "free list has duplicates"
        assert not self._used[free].any(), "a free slot is marked used"
        assert int(self._used.sum()) == self.num_slots - self._num_free, "counts disagree"

    def _check(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)]
            raise SlotError(
                f"{self.tier_name}: slots {bad[:8].tolist()} outside 0..{self.num_slots - 1}"
            )
        if len(slots) > 1:
            ordered = np.sort(slots)
            if (ordered[1:] == ordered[:-1]).any():
                raise SlotError(f"{self.tier_name}: a slot is listed twice in "
                                f"{slots[:16].tolist()}")
        return slots

    def _rebuild_free(self) -> None:
        free = np.flatnonzero(~self._used)[::-1]
        self._num_free = len(free)
        self._free[: self._num_free] = free
        self._stale = False
