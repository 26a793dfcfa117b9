"""KvRows: copies between vLLM's paged KV cache (one tensor a layer) and host blocks
(`[layers, page_bytes]` each, a store slot or an array of its own), as one batch of row copies
by address: on a GPU one cudaMemcpyBatchAsync on the caller's copy stream, on the CPU one
compiled loop without the GIL. Where neither runs, each row is a torch copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tpkv.errors import KvLayoutError
from tpkv.ssd import kernels
from tpkv.workers import cuda_rt

if TYPE_CHECKING:
    from tpkv.integrations.vllm.host_slots import HostSlots
    from tpkv.integrations.vllm.record import BlockRecord


def block_views(kv_caches: dict[str, torch.Tensor], num_blocks: int
                ) -> tuple[list[str], list[torch.Tensor]]:
    """Each layer's KV cache as [num_blocks, page_bytes] uint8 (a view, no copy). vLLM puts the
    block index first in every layer's tensor (one page a block, or several kernel blocks a
    block); anything else is a KvLayoutError naming the layer and its shape."""
    if not kv_caches:
        raise KvLayoutError("vLLM registered no KV cache layers")
    names, views = [], []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise KvLayoutError(f"layer {name!r}: KV cache is a {type(t).__name__}, not a tensor")
        if t.dim() < 1 or t.shape[0] % num_blocks or not t.is_contiguous():
            raise KvLayoutError(
                f"layer {name!r}: KV cache of shape {tuple(t.shape)} and strides {t.stride()} "
                f"is not {num_blocks} contiguous blocks along dim 0")
        flat = t.reshape(-1).view(torch.uint8)
        views.append(flat.view(num_blocks, -1))
        names.append(name)
    pages = {v.shape[1] for v in views}
    if len(pages) != 1:
        raise KvLayoutError(f"layers have different block sizes in bytes: {sorted(pages)}")
    return names, views


@dataclass
class RowGroup:
    """Host blocks to copy into vLLM blocks `ids`: their bytes, whether those are pinned, and
    their addresses (taken once, whatever the layers copied)."""

    ids: list[int]
    blocks: list[np.ndarray]
    pinned: bool
    host: np.ndarray

    @classmethod
    def of(cls, ids: list[int], blocks: list[np.ndarray], pinned: bool) -> RowGroup:
        return cls(ids, blocks, pinned, kernels.addresses(blocks)[0])


@dataclass
class HostBatch:
    """Host blocks to copy into vLLM blocks, in RowGroups: see `batch_of`."""

    groups: list[RowGroup] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(g.ids) for g in self.groups)


def batch_of(block_ids: Sequence[int], recs: Sequence[BlockRecord], slots: HostSlots | None,
             on_gpu: bool) -> HostBatch:
    """The records `recs` (held by the caller) for vLLM blocks `block_ids`: one group off a GPU;
    on a GPU those in pinned slots, then the others."""
    if not on_gpu:
        return HostBatch([RowGroup.of(list(block_ids), [r.data for r in recs], True)]
                         if recs else [])
    pooled = [i for i, r in enumerate(recs) if r.slot >= 0]
    pinned = slots is not None and bool(pooled) and slots.pinned_for(
        [recs[i].slot for i in pooled])
    fast = set(pooled) if pinned else set()
    batch = HostBatch()
    for group, is_pinned in (([i for i in range(len(recs)) if i in fast], True),
                             ([i for i in range(len(recs)) if i not in fast], False)):
        if group:
            batch.groups.append(RowGroup.of([block_ids[i] for i in group],
                                            [recs[i].data for i in group], is_pinned))
    return batch


class KvRows:
    """vLLM's KV cache of one rank, `views` (each layer as `[num_blocks, page_bytes]` uint8,
    contiguous), as addresses: layer l's row of vLLM block b lies at
    `views[l].data_ptr() + b * page_bytes`, and in a host block at `address + l * page_bytes`.

    A batch names vLLM block ids, the host blocks (arrays `[layers, page_bytes]` uint8, C
    contiguous, which the caller keeps alive and unchanged until the copies are done) and the
    layers to copy (default all). `save` copies KV cache rows into host blocks and returns once
    they are in; `load` copies host blocks into the KV cache: on the CPU done when it returns,
    on a GPU issued on `stream` (which the caller synchronizes or records an event on). On a
    GPU, host blocks go by address only when `pinned` (slots of a pinned HostPool); others
    row by row through torch."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = views  # as given: indexed once a layer, each time it is copied
        self.num_layers = len(self.views)
        self.page_bytes = int(self.views[0].shape[1])
        self.device = self.views[0].device
        self.on_gpu = self.device.type == "cuda"
        # on a GPU, by address through the batch entry of the CUDA runtime, where it has one
        self.batched = not self.on_gpu or cuda_rt.has_memcpy_batch()

    def addresses(self, block_ids: Sequence[int], host: np.ndarray,
                  layers: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(KV cache row addresses, host row addresses) of the host blocks at addresses `host`
        (kernels.addresses), layer by layer, then block by block within a layer."""
        order = range(self.num_layers) if layers is None else layers
        lay = np.asarray(order, dtype=np.uint64)
        bases = np.array([self.views[layer].data_ptr() for layer in order], dtype=np.uint64)
        ids = np.asarray(block_ids, dtype=np.uint64)
        page = np.uint64(self.page_bytes)
        kv = (bases[:, None] + ids[None, :] * page).ravel()
        rows = (host[None, :] + lay[:, None] * page).ravel()
        return kv, rows

    def save(self, block_ids: Sequence[int], blocks: Sequence[np.ndarray],
             stream: Any = None, pinned: bool = True) -> None:
        """KV cache rows of `block_ids` into `blocks` (every layer); done on return. On a GPU
        the copies run on `stream` (a stream made for them) after what the current stream
        holds (the forward that wrote them)."""
        if not len(block_ids):
            return
        by_address = not self.on_gpu or (self.batched and pinned and stream is not None)
        if by_address:
            kv, host = self.addresses(block_ids, kernels.addresses(blocks)[0])
        if not self.on_gpu:
            if kernels.copy_addresses(host, kv, self.page_bytes):
                return
        elif by_address:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            self._batch(host, kv, stream)
            stream.synchronize()
            return
        for block_id, block in zip(block_ids, blocks):
            dst = torch.from_numpy(block)
            for layer, view in enumerate(self.views):
                dst[layer].copy_(view[block_id])

    def load(self, group: RowGroup, layers: Sequence[int] | None = None,
             stream: Any = None) -> None:
        """The group's blocks into the KV cache rows of its ids, the `layers` given (default
        all): done on return on the CPU; on a GPU issued on `stream` (a stream made for them;
        the current one when None, row by row)."""
        if not group.ids:
            return
        order = range(self.num_layers) if layers is None else layers
        by_address = not self.on_gpu or (self.batched and group.pinned and stream is not None)
        if by_address:
            kv, host = self.addresses(group.ids, group.host, order)
        if not self.on_gpu:
            if kernels.copy_addresses(kv, host, self.page_bytes):
                return
        elif by_address:
            self._batch(kv, host, stream)
            return
        for layer in order:
            view = self.views[layer]
            for block_id, block in zip(group.ids, group.blocks):
                view[block_id].copy_(torch.from_numpy(block[layer]), non_blocking=self.on_gpu)

    def load_batch(self, batch: HostBatch, layers: Sequence[int] | None = None,
                   stream: Any = None) -> None:
        """`load` of every group of `batch`."""
        for group in batch.groups:
            self.load(group, layers, stream)

    def _batch(self, dsts: np.ndarray, srcs: np.ndarray, stream: Any) -> None:
        cuda_rt.memcpy_batch(dsts, srcs, np.full(len(dsts), self.page_bytes, dtype=np.uint64),
                             stream.cuda_stream)
