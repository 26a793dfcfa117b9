"""Tier pools of one rank: L1 `HbmPool` (device tensor) and L2 `HostPool` (pinned mmap arenas)."""

from __future__ import annotations

import logging
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tpkv import startup
from tpkv.checks import check_int
from tpkv.config import GiB, HostConfig, KvGeometry
from tpkv.errors import ConfigError, SlotError
from tpkv.ssd.backend import PAGE_BYTES as IO_PAGE_BYTES
from tpkv.ssd.backend import BlockViews
from tpkv.workers import cuda_rt
from tpkv.workers.slots import SlotAllocator

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"torch has no dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class ByteBlocks:
    """The block shape of a HostPool of raw bytes: `[rows, row_bytes]` uint8 (vLLM's blocks
    in the connector: one row a layer). It stands where a KvGeometry does for the pool."""

    rows: int
    row_bytes: int
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        check_int("rows", self.rows)
        check_int("row_bytes", self.row_bytes)

    @property
    def block_shape(self) -> tuple[int, int]:
        return (self.rows, self.row_bytes)

    @property
    def block_bytes(self) -> int:
        return self.rows * self.row_bytes


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
            with startup.phase("l1_alloc"):
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
    whole number of blocks, pinned with cudaHostRegister when CUDA is present.

    Slot s lives in arena `s // slots_per_arena` at index `s % slots_per_arena`; a block is always
    one contiguous run of `block_bytes` bytes.

    Pinning runs in the background: the first arena is pinned before the constructor returns,
    the others in order on a thread (several at once), and `ready_slots` counts the slots of
    the pinned prefix (the controller hands out only those). A copy that touches an arena not
    pinned yet waits for it (`await_pinned`). An arena cudaHostRegister refuses ends the
    pinning there: `ready_slots` stays at the prefix and a warning says how much L2 is left
    (none when it refuses the first arena: the start goes on with L2 empty).
    """

    def __init__(self, geometry: KvGeometry | ByteBlocks, num_slots: int,
                 config: HostConfig | None = None) -> None:
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
        t_map = time.perf_counter()
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
        startup.add("l2_map", time.perf_counter() - t_map)
        # every block starts on a page and is whole pages long: O_DIRECT takes it as it is
        self.page_aligned = block_bytes % IO_PAGE_BYTES == 0 and bool(
            (self.arena_ptrs % IO_PAGE_BYTES == 0).all())
        self.pinned = False  # the memory is (being) pinned: copies may use the pinned paths
        self._cond = threading.Condition()
        self._num_ready = len(self._maps)  # arenas of the usable prefix (pinned, if pinning)
        self._registered: set[int] = set()  # arenas registered with CUDA
        self._stop = False
        self._pinner: threading.Thread | None = None
        self.pin_error: str | None = None
        self.pin_seconds = 0.0  # wall time from the start of pinning to its end
        want_pin = config.pin == "always" or (config.pin == "auto" and cuda_rt.cuda_available())
        if want_pin:
            self.pinned = True
            self._num_ready = 0
            self._t0 = time.perf_counter()
            with startup.phase("l2_first_arena"):
                first_pinned = self._pin_first()
            if first_pinned and len(self._maps) > 1:
                self._pinner = threading.Thread(target=self._pin_rest, name="tpkv-l2-pin",
                                                daemon=True)
                self._pinner.start()
            else:
                self.pin_seconds = time.perf_counter() - self._t0

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
        with self._cond:
            return sum(len(self._maps[i]) for i in self._registered)

    @property
    def ready_slots(self) -> int:
        """Slots usable now: those of the arenas pinned so far, in order (all when not pinning)."""
        return min(self.num_slots, self._num_ready * self.slots_per_arena)

    @property
    def pinning(self) -> bool:
        """Whether arenas are still being pinned in the background."""
        return self._pinner is not None and self._pinner.is_alive()

    def wait_pinned(self, timeout_s: float | None = None) -> int:
        """Wait until the background pinning ended (done or stopped); -> ready_slots."""
        if self._pinner is not None:
            self._pinner.join(timeout_s)
        return self.ready_slots

    def await_pinned(self, slots: np.ndarray, timeout_s: float = 300.0) -> None:
        """Return once every arena holding `slots` is pinned (at once when all are). A slot of
        an arena that will never be pinned (its pinning failed) is a SlotError."""
        if self._num_ready == len(self._maps) or not len(slots):
            return
        need = int(np.max(slots)) // self.slots_per_arena + 1
        if need <= self._num_ready:
            return
        with self._cond:
            ok = self._cond.wait_for(lambda: self._num_ready >= need or self._stop
                                     or self.pin_error is not None, timeout_s)
            if self._num_ready >= need:
                return
        raise SlotError(f"L2 slot {int(np.max(slots))} is in arena {need - 1}, not pinned "
                        f"({self._num_ready} of {len(self._maps)} arenas are"
                        f"{'' if ok else f' after {timeout_s:g} s'}; {self.pin_error or ''})")

    def _locate(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"L2 slot {slot} outside 0..{self.num_slots - 1}")
        return divmod(int(slot), self.slots_per_arena)

    def block(self, slot: int) -> torch.Tensor:
        """One block in the geometry's block shape (a view): [layers, 2, block_tokens,
        heads_per_rank, head_dim] for a KvGeometry, [rows, row_bytes] for ByteBlocks."""
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
        return BlockViews(self.block_bytes_view, slots, self.block_bytes, self.page_aligned,
                          self._slot_addresses)

    def _slot_addresses(self, slots: np.ndarray) -> np.ndarray:
        """Host addresses of `slots` (no wait for pinning: the store's threads copy into them
        on the host)."""
        arena, index = np.divmod(np.asarray(slots, dtype=np.int64), self.slots_per_arena)
        return self.arena_ptrs[arena] + index * self.block_bytes

    def slot_ptrs(self, slots: np.ndarray) -> np.ndarray:
        """Host addresses of `slots`, for copies: waits for arenas still being pinned."""
        slots = np.asarray(slots, dtype=np.int64)
        self.await_pinned(slots)
        return self._slot_addresses(slots)

    def group_by_arena(self, slots: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """[(arena, positions into `slots`, indices within the arena)] for index-op copies."""
        slots = np.asarray(slots, dtype=np.int64)
        self.await_pinned(slots)
        arena, index = np.divmod(slots, self.slots_per_arena)
        out = []
        for a in np.unique(arena):
            pos = np.flatnonzero(arena == a)
            out.append((int(a), pos, index[pos]))
        return out

    def _pin_first(self) -> bool:
        """Pin arena 0 before the pool is handed out; a refusal leaves L2 with no usable slot
        (`ready_slots` 0: the controller plans without L2), with a warning: -> whether it was
        pinned."""
        try:
            self._register(0)
        except Exception as exc:  # cudaHostRegister refused (a size, a memory limit)
            self.pin_error = f"arena 0: {exc}"
            log.warning("L2: pinning refused the first arena (%d bytes): %s; L2 starts with "
                        "0 of %d slots (%.2f GiB) online: the engine serves from L1 alone "
                        "(L3 is reached through L2), recomputing what L1 drops",
                        len(self._maps[0]), exc, self.num_slots,
                        self.num_slots * self.block_bytes / GiB)
            return False
        self._num_ready = 1
        return True

    def _register(self, i: int) -> None:
        cuda_rt.host_register(int(self.arena_ptrs[i]), len(self._maps[i]))
        with self._cond:
            self._registered.add(i)

    def _pin_rest(self) -> None:
        """The pinner thread: arenas 1.. in order, up to 8 registering at once; the prefix
        grows as each one and those before it are done. Stops at the first failure."""
        # A pool closed just before (a restart) may still be releasing its memory: pin the
        # rest only after it, so that the host never holds both (the first arena is pinned).
        wait_released()
        # and only once init's kernels are loaded: 8 threads faulting in L2 slowed that load
        # from about 1.5 s to 4.8 s + 4.2 s on the H200 host (bench/startup.py, second process)
        startup.wait_quiet()
        todo = list(range(self._num_ready, len(self._maps)))
        with ThreadPoolExecutor(max_workers=min(8, len(todo)),
                                thread_name_prefix="tpkv-l2-pin") as pool:
            futures = {i: pool.submit(self._register_unless_stopped, i) for i in todo}
            for i in todo:
                try:
                    futures[i].result()
                except Exception as exc:  # cudaHostRegister refused (a size, a memory limit)
                    for f in futures.values():
                        f.cancel()
                    with self._cond:
                        self.pin_error = f"arena {i}: {exc}"
                        self._cond.notify_all()
                    if not self._stop:
                        log.warning("L2: pinning stopped at arena %d of %d: %s; L2 holds %d "
                                    "slots (%.2f GiB) instead of %d", i, len(self._maps), exc,
                                    self.ready_slots, self.ready_slots * self.block_bytes / GiB,
                                    self.num_slots)
                    break
                with self._cond:
                    if self._stop:
                        break
                    self._num_ready = i + 1
                    self._cond.notify_all()
        self.pin_seconds = time.perf_counter() - self._t0
        if self.pin_error is None and not self._stop:
            log.info("L2: pinned %d arenas, %.2f GiB in %.2f s (in the background)",
                     len(self._maps), sum(len(m) for m in self._maps) / GiB, self.pin_seconds)

    def _register_unless_stopped(self, i: int) -> None:
        if not self._stop:
            self._register(i)

    def close(self, background: bool = False) -> None:
        """Stop the pinning, unpin and release the arenas; the pool is unusable afterwards.
        `background`: unpin and unmap on a thread (`wait_released` waits for it), so that a
        restart does not wait for the release of a large L2 (5-6 s at 96 GiB)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._pinner is not None:
            self._pinner.join()
        ptrs = [int(self.arena_ptrs[i]) for i in sorted(self._registered)]
        maps, self._maps = self._maps, []
        self._registered.clear()
        self.pinned = False
        self._num_ready = 0
        self.arenas.clear()
        self._bytes_views.clear()
        if background and (ptrs or maps):
            t = threading.Thread(target=_release, args=(ptrs, maps), name="tpkv-l2-release")
            with _RELEASING_LOCK:
                _RELEASING.append(t)
            t.start()  # not a daemon: an exiting process finishes the release first
        else:
            _release(ptrs, maps)


_RELEASING: list[threading.Thread] = []
_RELEASING_LOCK = threading.Lock()


def _release(ptrs: list[int], maps: list[mmap.mmap]) -> None:
    """Unpin these arenas and unmap them (a closed HostPool's memory)."""
    for ptr in ptrs:
        cuda_rt.host_unregister(ptr)
    for mm in maps:
        try:
            mm.close()
        except BufferError:  # a caller still holds a view; the OS frees it with the process
            log.debug("L2 arena still referenced at close")


def wait_released(timeout_s: float | None = None) -> bool:
    """Wait for the L2 pools closed in the background to be released; -> all were."""
    with _RELEASING_LOCK:
        threads = list(_RELEASING)
    for t in threads:
        t.join(timeout_s)
    with _RELEASING_LOCK:
        _RELEASING[:] = [t for t in _RELEASING if t.is_alive()]
        return not _RELEASING
