"""HostSlots: one rank's host memory for the vLLM connector's blocks, allocated once as a tpkv
HostPool and handed out slot by slot, each slot kept while anything refers to it."""

from __future__ import annotations

import threading
from typing import Literal

import numpy as np

from tpkv.config import GiB, HostConfig
from tpkv.errors import ConfigError, SlotError
from tpkv.workers.pools import ByteBlocks, HostPool


class HostSlots:
    """`num_slots` blocks of `shape` (`[layers, page_bytes]` uint8) in a HostPool: page-aligned
    mmap arenas, pinned with cudaHostRegister when CUDA is present (`pin`, as HostConfig.pin),
    so the connector's host budget is one allocation made at start and never exceeded.

    A slot is free once nothing refers to it. `take` hands out a free slot with one reference
    (its taker fills it, then nothing writes it again); `ref` adds one for each further holder
    (the index's record, a write queued for disk, a load under way) and `release` gives one
    back. A holder's bytes therefore never change under it, whatever the others do. Slots
    are handed out lowest first (the arenas pinned first). Thread safe."""

    def __init__(self, shape: tuple[int, int], num_slots: int,
                 pin: Literal["auto", "always", "never"] = "auto") -> None:
        blocks = ByteBlocks(*shape)
        try:
            config = HostConfig(budget_bytes=max(num_slots * blocks.block_bytes, 1),
                                arena_bytes=max(GiB, blocks.block_bytes), pin=pin)
        except ConfigError as exc:
            raise ConfigError(f"host_bytes of {num_slots} blocks of {blocks.block_bytes} bytes: "
                              f"{exc}") from exc
        self.pool = HostPool(blocks, num_slots, config)
        self.num_slots = num_slots
        self.block_bytes = blocks.block_bytes
        self._refs = np.zeros(num_slots, dtype=np.int32)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def take(self) -> int | None:
        """A free slot, with one reference; None when every slot is held."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._refs[slot] = 1
            return slot

    def ref(self, slot: int) -> None:
        """One more holder of a slot that is held already."""
        with self._lock:
            if self._refs[slot] < 1:
                raise SlotError(f"host slot {slot} is free: nothing may take it again")
            self._refs[slot] += 1

    def release(self, slot: int) -> None:
        """A holder is done with the slot; the last one frees it."""
        with self._lock:
            if self._refs[slot] < 1:
                raise SlotError(f"host slot {slot} released more often than held")
            self._refs[slot] -= 1
            if not self._refs[slot]:
                self._free.append(slot)

    def refs(self, slot: int) -> int:
        with self._lock:
            return int(self._refs[slot])

    def pinned_for(self, slots: list[int]) -> bool:
        """Whether these slots are pinned memory now: the pool pins (CUDA is present) and
        their arenas are in the pinned prefix. Never waits for the background pinning: a copy
        from a slot not pinned yet goes the pageable way."""
        return self.pool.pinned and bool(slots) and max(slots) < self.pool.ready_slots

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes, `[layers, page_bytes]` uint8 (a view of the pool)."""
        return self.pool.block_bytes_view(slot).reshape(self.pool.geometry.block_shape)

    def close(self) -> None:
        """Give the memory back (views still held keep their mapping until dropped)."""
        self.pool.close()
