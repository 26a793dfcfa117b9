"""Tier pools of one rank: L1 `HbmPool` (device tensor) and L2 `HostPool` (pinned mmap arenas)."""

from __future__ import annotations

import logging
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tpkv.config import GiB, HostConfig, KvGeometry
from tpkv.errors import ConfigError, SlotError
from tpkv.workers import cuda_rt
from tpkv.workers.slots import SlotAllocator
from tpkv.workers.ssd_backend import PAGE_BYTES as IO_PAGE_BYTES
from tpkv.workers.ssd_backend import BlockViews

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


class HbmPool:
    """L1 of one rank: `[slots, layers, 2, block_tokens, heads_per_rank, head_dim]` on `device`.

    On a machine with no GPU the same tensor lives on the CPU and every caller runs unchanged.
    """

    def __init__(self, geometry: KvGeometry, num_slots: int,
                 device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda_rt.cuda_available() \
                else torch.device("cpu")
        self.geometry = geometry
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.slots = SlotAllocator(num_slots, "L1")
        try:
            # zeros, not empty: a slot never written holds finite values (attention masks
            # what lies past a session's length, and 0 * NaN would not be 0)
            self.tensor = torch.zeros((num_slots, *geometry.block_shape),
                                      dtype=torch_dtype(geometry.dtype), device=self.device)
        except torch.OutOfMemoryError as exc:
            raise ConfigError(
                f"L1 of {num_slots} slots x {geometry.block_bytes} bytes "
                f"({num_slots * geometry.block_bytes / GiB:.2f} GiB) does not fit on {self.device}"
            ) from exc

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def base_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    def block(self, slot: int) -> torch.Tensor:
        """One block: [layers, 2, block_tokens, heads_per_rank, head_dim] (a view)."""
        return self.tensor[self._slot(slot)]

    def slot_ptrs(self, slots: np.ndarray) -> np.ndarray:
        return self.base_ptr + np.asarray(slots, dtype=np.int64) * self.block_bytes

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"L1 slot {slot} outside 0..{self.num_slots - 1}")
        return int(slot)


class HostPool:
    """L2 of one rank: page-aligned anonymous mmap arenas of about `arena_bytes`, each holding a
    whole number of blocks, pinned with cudaHostRegister (in parallel) when CUDA is present.

    Slot s lives in arena `s // slots_per_arena` at index `s % slots_per_arena`; a block is always
    one contiguous run of `block_bytes` bytes.
    """

    def __init__(self, geometry: KvGeometry, num_slots: int, config: HostConfig | None = None
                 ) -> None:
        config = config or HostConfig()
        self.geometry = geometry
        self.num_slots = num_slots
        self.slots = SlotAllocator(num_slots, "L2")
        block_bytes = geometry.block_bytes
        self.slots_per_arena = max(1, min(num_slots, config.arena_bytes // block_bytes))
        dtype = torch_dtype(geometry.dtype)
        self._maps: list[mmap.mmap] = []
        self.arenas: list[torch.Tensor] = []  # each [n, *block_shape] over one mmap
        self._bytes_views: list[np.ndarray] = []  # each [n, block_bytes] uint8 over the same mmap
        for start in range(0, num_slots, self.slots_per_arena):
            n = min(self.slots_per_arena, num_slots - start)
            # One spare page after the blocks: two arenas are then never adjacent in virtual
            # memory, so no copy that merges adjacent blocks can span two registrations.
            size = -(-n * block_bytes // PAGE_BYTES) * PAGE_BYTES + PAGE_BYTES
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(mm, dtype=torch.uint8)[: n * block_bytes]
            self._maps.append(mm)
            self.arenas.append(raw.view(dtype).view(n, *geometry.block_shape))
            self._bytes_views.append(raw.numpy().reshape(n, block_bytes))
        self.arena_ptrs = np.array([a.data_ptr() for a in self.arenas], dtype=np.int64)
        # every block starts on a page and is whole pages long: O_DIRECT takes it as it is
        self.page_aligned = block_bytes % IO_PAGE_BYTES == 0 and bool(
            (self.arena_ptrs % IO_PAGE_BYTES == 0).all())
        self.pinned = False
        want_pin = config.pin == "always" or (config.pin == "auto" and cuda_rt.cuda_available())
        if want_pin:
            self._pin_all()

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this pool holds registered with CUDA (whole arenas, spare pages included):
        its share of the process's pinned memory, for soaks that check it stays flat; 0 when
        not pinned or closed."""
        return sum(len(m) for m in self._maps) if self.pinned else 0

    def _locate(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"L2 slot {slot} outside 0..{self.num_slots - 1}")
        return divmod(int(slot), self.slots_per_arena)

    def block(self, slot: int) -> torch.Tensor:
        """One block: [layers, 2, block_tokens, heads_per_rank, head_dim] (a view)."""
        arena, index = self._locate(slot)
        return self.arenas[arena][index]

    def block_bytes_view(self, slot: int) -> np.ndarray:
        """One block as a writable 1-D uint8 numpy view (for the SSD store)."""
        arena, index = self._locate(slot)
        return self._bytes_views[arena][index]

    def block_views(self, slots: np.ndarray) -> BlockViews:
        """The blocks of `slots` as writable 1-D uint8 views, made as they are read."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = int(slots[(slots < 0) | (slots >= self.num_slots)][0])
            raise SlotError(f"L2 slot {bad} outside 0..{self.num_slots - 1}")
        return BlockViews(self.block_bytes_view, slots, self.block_bytes, self.page_aligned)

    def slot_ptrs(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        arena, index = np.divmod(slots, self.slots_per_arena)
        return self.arena_ptrs[arena] + index * self.block_bytes

    def group_by_arena(self, slots: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """[(arena, positions into `slots`, indices within the arena)] for index-op copies."""
        slots = np.asarray(slots, dtype=np.int64)
        arena, index = np.divmod(slots, self.slots_per_arena)
        out = []
        for a in np.unique(arena):
            pos = np.flatnonzero(arena == a)
            out.append((int(a), pos, index[pos]))
        return out

    def _pin_all(self) -> None:
        t0 = time.perf_counter()

        def pin(i: int) -> None:
            cuda_rt.host_register(int(self.arena_ptrs[i]), len(self._maps[i]))

        with ThreadPoolExecutor(max_workers=min(8, len(self._maps))) as pool:
            list(pool.map(pin, range(len(self._maps))))
        self.pinned = True
        log.info("L2: pinned %d arenas, %.2f GiB in %.2f s", len(self._maps),
                 sum(len(m) for m in self._maps) / GiB, time.perf_counter() - t0)

    def close(self) -> None:
        """Unpin and release the arenas; the pool is unusable afterwards."""
        if self.pinned:
            for ptr in self.arena_ptrs:
                cuda_rt.host_unregister(int(ptr))
            self.pinned = False
        self.arenas.clear()
        self._bytes_views.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the OS frees it with the process
                log.debug("L2 arena still referenced at close")
        self._maps.clear()
