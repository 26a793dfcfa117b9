"""Copy engine: moves batches of blocks L1 <-> L2 on dedicated H2D / D2H streams, one call each."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tpkv.errors import SlotError
from tpkv.workers import copy_kernel, cuda_rt
from tpkv.workers.kernels import merged_copies
from tpkv.workers.pools import HbmPool, HostPool

log = logging.getLogger(__name__)

Method = Literal["auto", "dma", "kernel", "torch"]
# "auto" takes batched DMA whenever cudaMemcpyBatchAsync exists. Blocks below this size are
# spread over DMA_SMALL_BLOCK_STREAMS streams (several copy engines at once): on an H200 that
# lifts 256 KiB blocks from 0.82 to 0.94 of the pinned-copy ceiling, above the SM kernel's 0.91,
# while 2 MiB blocks do best on one stream (bench/copy_sweep.py, bench/results/copy_sweep.json).
SMALL_BLOCK_BYTES = 1 << 20
DMA_SMALL_BLOCK_STREAMS = 8
# Descriptors per cudaMemcpyBatchAsync call for small blocks: 256 did a little better than 8192
# one way (0.93 vs 0.91) and both ways (0.76 vs 0.72) in bench/both_sweep.py.
DMA_SMALL_BLOCK_CHUNK = 256


@dataclass
class CopyHandle:
    """One issued batch: wait() blocks the host; `event` lets a stream wait instead."""

    num_blocks: int
    num_bytes: int
    method: str
    direction: str
    event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class CopyEngine:
    """Executes L1 <-> L2 block copies for one rank. Never decides what to move."""

    def __init__(self, hbm: HbmPool, host: HostPool, method: Method | dict[str, Method] = "auto",
                 dma_streams: int | None = None, kernel_args: dict[str, int] | None = None,
                 dma_chunk: int | None = None, host_order: bool = True) -> None:
        if hbm.geometry != host.geometry:
            raise ValueError("L1 and L2 pools of one engine must share a geometry")
        self.hbm = hbm
        self.host = host
        self.block_bytes = hbm.block_bytes
        self.on_gpu = hbm.device.type == "cuda"
        # One method for both directions, or {"h2d": ..., "d2h": ...}.
        self.methods: dict[str, Method] = (dict(method) if isinstance(method, dict)
                                           else {"h2d": method, "d2h": method})
        self.dma_attr: object | None = None  # cudaMemcpyAttributes override (benchmarks)
        # Blocks copied and DMA descriptors issued for them (after merging runs), per direction:
        # their ratio is the mean run length that the slot placement gave the copies.
        self.num_blocks = {"h2d": 0, "d2h": 0}
        self.num_descriptors = {"h2d": 0, "d2h": 0}
        self.kernel_args = kernel_args or {}
        small = self.block_bytes < SMALL_BLOCK_BYTES
        self.dma_chunk = dma_chunk or (DMA_SMALL_BLOCK_CHUNK if small else
                                       cuda_rt.MAX_BATCH_DESCRIPTORS)
        self._last: dict[str, CopyHandle | None] = {"h2d": None, "d2h": None}
        self.host_order = host_order
        if self.on_gpu:
            if not host.pinned:
                raise ValueError("a GPU copy engine needs a pinned L2 pool (HostConfig.pin)")
            self.streams = {d: torch.cuda.Stream(hbm.device) for d in ("h2d", "d2h")}
            if dma_streams is None:
                dma_streams = DMA_SMALL_BLOCK_STREAMS if small else 1
            # Extra streams per direction so that one batch is spread over several copy engines.
            self.dma_substreams = {d: [torch.cuda.Stream(hbm.device) for _ in range(dma_streams)]
                                   for d in ("h2d", "d2h")} if dma_streams > 1 else None

    # ---- public -------------------------------------------------------------------------------

    def d2h(self, hbm_slots: np.ndarray, host_slots: np.ndarray) -> CopyHandle:
        """L1 -> L2: host_slots[i] <- hbm_slots[i]. Ordered after work queued on the current
        stream (so KV written by compute is complete before it is copied)."""
        return self._copy("d2h", np.asarray(hbm_slots), np.asarray(host_slots))[0]

    def d2h_pieces(self, hbm_slots: np.ndarray, host_slots: np.ndarray, piece_blocks: int,
                   after: torch.cuda.Event | None = None) -> list[CopyHandle]:
        """d2h() in pieces of piece_blocks blocks, in order on one stream, a handle each (one
        check of the slots and one pointer computation for all). `after`: the compute they
        must follow, when not all of what the current stream holds now."""
        return self._copy("d2h", np.asarray(hbm_slots), np.asarray(host_slots), piece_blocks,
                          after)

    def h2d(self, host_slots: np.ndarray, hbm_slots: np.ndarray, ordered: bool = False
            ) -> CopyHandle:
        """L2 -> L1: hbm_slots[i] <- host_slots[i]. Consumers wait on the handle's event.
        Ordered after work queued on the current stream, unless the caller has ordered the H2D
        stream itself (`ordered`: the executor's _mark)."""
        return self._copy("h2d", np.asarray(hbm_slots), np.asarray(host_slots),
                          ordered=ordered)[0]

    def synchronize(self) -> None:
        for handle in self._last.values():
            if handle is not None:
                handle.wait()

    def choose_method(self, direction: str) -> str:
        if not self.on_gpu:
            return "torch"
        if self.methods[direction] != "auto":
            return self.methods[direction]
        if cuda_rt.has_memcpy_batch():
            return "dma"
        if copy_kernel.available() and self.block_bytes % 16 == 0:
            return "kernel"
        return "torch"

    # ---- internals ----------------------------------------------------------------------------

    def _copy(self, direction: str, hbm_slots: np.ndarray, host_slots: np.ndarray,
              piece_blocks: int = 0, after: torch.cuda.Event | None = None,
              ordered: bool = False) -> list[CopyHandle]:
        hbm_slots = hbm_slots.astype(np.int64, copy=False).reshape(-1)
        host_slots = host_slots.astype(np.int64, copy=False).reshape(-1)
        if len(hbm_slots) != len(host_slots):
            raise SlotError(
                f"{direction}: {len(hbm_slots)} L1 slots but {len(host_slots)} L2 slots"
            )
        for name, slots, limit in (("L1", hbm_slots, self.hbm.num_slots),
                                   ("L2", host_slots, self.host.num_slots)):
            if len(slots) and (slots.min() < 0 or slots.max() >= limit):
                raise SlotError(f"{direction}: {name} slot outside 0..{limit - 1}")
        self.host.await_pinned(host_slots)  # an L2 arena still being pinned: wait for it
        n = len(hbm_slots)
        method = self.choose_method(direction)
        if n == 0 or not self.on_gpu:
            if n:
                self._copy_torch(direction, hbm_slots, host_slots)
            return [CopyHandle(n, n * self.block_bytes, method, direction)]
        stream = self.streams[direction]
        if after is not None:
            stream.wait_event(after)
        elif not ordered:
            stream.wait_stream(torch.cuda.current_stream(self.hbm.device))
        # DMA descriptors are made per piece from the slots (kernels.merged_copies); the SM
        # kernel takes one address pair per block
        src, dst = (None, None) if method == "dma" else self._endpoints(direction, hbm_slots,
                                                                         host_slots)
        step = piece_blocks if piece_blocks > 0 else n
        handles = []
        with torch.cuda.stream(stream):
            for at in range(0, n, step):
                part = slice(at, at + step)
                if method == "dma":
                    self._copy_dma(direction, hbm_slots[part], host_slots[part], stream)
                elif method == "kernel":
                    assert src is not None and dst is not None
                    copy_kernel.launch(src[part], dst[part], self.block_bytes, stream,
                                       **self.kernel_args)
                else:
                    self._copy_torch(direction, hbm_slots[part], host_slots[part])
                k = len(hbm_slots[part])
                event = torch.cuda.Event()
                event.record(stream)
                handles.append(CopyHandle(k, k * self.block_bytes, method, direction, event))
        self._last[direction] = handles[-1]
        return handles

    def _endpoints(self, direction: str, hbm_slots: np.ndarray, host_slots: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        dev = self.hbm.slot_ptrs(hbm_slots)
        host = self.host.slot_ptrs(host_slots)
        return (dev, host) if direction == "d2h" else (host, dev)

    def _copy_dma(self, direction: str, hbm_slots: np.ndarray, host_slots: np.ndarray,
                  stream: torch.cuda.Stream) -> None:
        """One batch of whole-block copies between these slots, runs merged, descriptors in
        ascending host address (or device address when host_order is off)."""
        num_blocks = len(hbm_slots)
        src, dst, sizes = merged_copies(self.hbm.base_ptr, self.block_bytes,
                                        self.host.arena_ptrs, self.host.slots_per_arena,
                                        hbm_slots, host_slots, direction == "h2d",
                                        self.host_order)
        self.num_blocks[direction] += num_blocks
        self.num_descriptors[direction] += len(src)
        subs = self.dma_substreams[direction] if self.dma_substreams else None
        # A batch is spread over the sub-streams in equal numbers of descriptors; runs merged
        # into large copies do best on one stream, as large blocks do (docs/decisions.md, "One
        # resume's batch on one stream").
        if subs is None or len(src) < 2 * len(subs) or sizes.mean() >= SMALL_BLOCK_BYTES:
            cuda_rt.memcpy_batch(dst, src, sizes, stream.cuda_stream, self.dma_chunk,
                                 self.dma_attr)
            return
        for part, sub in zip(np.array_split(np.arange(len(src)), len(subs)), subs):
            sub.wait_stream(stream)
            cuda_rt.memcpy_batch(dst[part], src[part], sizes[part], sub.cuda_stream,
                                 self.dma_chunk, self.dma_attr)
            stream.wait_stream(sub)

    def _copy_torch(self, direction: str, hbm_slots: np.ndarray, host_slots: np.ndarray) -> None:
        """Index ops per L2 arena: a gather then one copy (GPU), or plain index_copy (CPU)."""
        device = self.hbm.device
        for arena, pos, index in self.host.group_by_arena(host_slots):
            arena_t = self.host.arenas[arena]
            hbm_idx = torch.from_numpy(hbm_slots[pos]).to(device, non_blocking=True)
            host_idx = torch.from_numpy(index)
            if direction == "d2h":
                gathered = self.hbm.tensor.index_select(0, hbm_idx)
                if self.on_gpu:
                    staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    staging.copy_(gathered, non_blocking=True)
                    torch.cuda.current_stream(device).synchronize()
                    gathered = staging
                arena_t.index_copy_(0, host_idx, gathered)
            else:
                rows = arena_t.index_select(0, host_idx)
                if self.on_gpu:
                    rows = rows.pin_memory().to(device, non_blocking=True)
                self.hbm.tensor.index_copy_(0, hbm_idx, rows)

