"""LayerCopies: a rank's L2 -> L1 copies issued layer by layer, with the event each layer's
attention waits for."""

from __future__ import annotations

import numpy as np
import torch

from tpkv.workers import cuda_rt
from tpkv.workers.copy_engine import CopyEngine, CopyHandle


class LayerCopies:
    """Issues L2 -> L1 batches on the engine's h2d stream, `layers_per_copy` layers of every
    block per copy (from `layer_chunk_bytes`), and keeps per layer the event of the newest copy
    of that layer (`events`): the forward's layer k waits for events[k] only (`wait_layer`), so
    attention over the first layers starts while the last are still copying. Without
    `layer_events` a batch is one ordered copy whose event stands for every layer."""

    def __init__(self, engine: CopyEngine, layer_events: bool = True,
                 layer_chunk_bytes: int = 64 << 10) -> None:
        self.engine = engine
        self.hbm, self.host = engine.hbm, engine.host
        self.layer_events = layer_events
        g = self.hbm.geometry
        self.layer_bytes, self.num_layers = g.layer_bytes, g.num_layers
        self.layers_per_copy = min(g.num_layers, max(1, -(-layer_chunk_bytes // g.layer_bytes)))
        self.events: list[torch.cuda.Event | None] = [None] * g.num_layers

    def issue(self, host_slots: np.ndarray, hbm_slots: np.ndarray) -> CopyHandle:
        """Copy L2 `host_slots` into L1 `hbm_slots` (the stream is ordered after compute by the
        caller, or here); -> the batch's handle (its event: the last layer's)."""
        if not self.layer_events:
            handle = self.engine.h2d(host_slots, hbm_slots, ordered=True)
            self.events = [handle.event] * self.num_layers
            return handle
        n, step = len(hbm_slots), self.layers_per_copy
        handle = CopyHandle(n, n * self.hbm.block_bytes, "layers", "h2d")
        if not self.engine.on_gpu:
            for start in range(0, self.num_layers, step):
                self._copy_torch(host_slots, hbm_slots, start, start + step)
            return handle
        stream = self.engine.streams["h2d"]
        stream.wait_stream(torch.cuda.current_stream(self.hbm.device))
        use_dma = self.engine.choose_method("h2d") == "dma"
        return self._by_layer(self.host.slot_ptrs(host_slots), hbm_slots, handle,
                              None if use_dma else host_slots)

    @property
    def reads_addresses(self) -> bool:
        """Whether issue_from can copy from host addresses here: on the CPU, or through the
        batched DMA entry."""
        return not self.engine.on_gpu or self.engine.choose_method("h2d") == "dma"

    def issue_from(self, addresses: np.ndarray, blocks: list[np.ndarray],
                   hbm_slots: np.ndarray) -> CopyHandle:
        """Copy whole blocks from host memory outside L2 (pinned, at `addresses`; on the CPU
        the same bytes as arrays, `blocks`) into L1 `hbm_slots`, as issue() does from L2 (only
        where reads_addresses); ordered after compute, as issue() is."""
        n = len(hbm_slots)
        handle = CopyHandle(n, n * self.hbm.block_bytes, "layers", "h2d")
        if not self.engine.on_gpu:
            for slot, block in zip(hbm_slots.tolist(), blocks):
                self.hbm.block(slot).view(torch.uint8).reshape(-1).copy_(torch.from_numpy(block))
            return handle
        assert self.reads_addresses
        self.engine.streams["h2d"].wait_stream(torch.cuda.current_stream(self.hbm.device))
        return self._by_layer(np.asarray(addresses, dtype=np.uint64), hbm_slots, handle, None,
                              self.layers_per_copy if self.layer_events else self.num_layers)

    def _by_layer(self, src0: np.ndarray, hbm_slots: np.ndarray, handle: CopyHandle,
                  host_slots: np.ndarray | None, step: int = 0) -> CopyHandle:
        """The copies of issue(), `step` layers at a time (default `layers_per_copy`) from host
        addresses `src0` (DMA), or from L2 `host_slots` by index ops where given."""
        n, step = len(hbm_slots), step or self.layers_per_copy
        stream = self.engine.streams["h2d"]
        dst0 = self.hbm.slot_ptrs(hbm_slots)
        with torch.cuda.stream(stream):
            for start in range(0, self.num_layers, step):
                stop = min(self.num_layers, start + step)
                if host_slots is None:
                    off, size = start * self.layer_bytes, (stop - start) * self.layer_bytes
                    cuda_rt.memcpy_batch(dst0 + off, src0 + off, np.full(n, size, np.uint64),
                                         stream.cuda_stream)
                else:
                    self._copy_torch(host_slots, hbm_slots, start, stop)
                event = torch.cuda.Event()
                event.record(stream)
                self.events[start:stop] = [event] * (stop - start)
        handle.event = self.events[-1]
        return handle

    def _copy_torch(self, host_slots: np.ndarray, hbm_slots: np.ndarray, start: int,
                    stop: int) -> None:
        """Layers [start, stop) of each block by index ops per L2 arena (CPU, or no batch API)."""
        device = self.hbm.device
        for arena, pos, index in self.host.group_by_arena(host_slots):
            rows = self.host.arenas[arena][torch.from_numpy(index), start:stop]
            if self.engine.on_gpu:
                rows = rows.pin_memory().to(device, non_blocking=True)
            self.hbm.tensor[torch.from_numpy(hbm_slots[pos]).to(device), start:stop] = rows

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` of every block copied into L1 so far
        (no host wait). On the CPU copies are done when issued."""
        event = self.events[layer]
        if event is not None and self.engine.on_gpu:
            torch.cuda.current_stream(self.hbm.device).wait_event(event)
