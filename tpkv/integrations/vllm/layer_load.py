"""A step's synchronous loads copied into vLLM's KV cache layer by layer, so that each attention
layer of the forward waits only for its own layer's copies.

vLLM calls the connector's wait_for_layer_load(layer) before each attention layer of a forward
(the maybe_transfer_kv_layer decorator of its attention op). LayerHooks learns, from a forward
that called it for every KV cache layer of the rank, the order the forward runs the layers in;
until one did, loads are copied whole before the forward. A LayerCopier then copies a step's
blocks, already read and checked, layer after layer in that order on a thread of the rank's
own (on a GPU, on a CUDA stream of its own that first waits for the forward's stream, with one
event a layer), and `wait(job, name)` returns once that layer's copies are in (on a GPU: the
forward's stream waits for the layer's event). A forward that did not wait for a layer of a
layer-wise load may have read it before its copy: its blocks are failed loads (vLLM recomputes
them and drops the step's output for their requests) and LayerHooks turns layer-wise loads off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpkv.integrations.vllm.block_io import HostBatch, KvRows
from tpkv.integrations.vllm.copy_thread import CopyThread

log = logging.getLogger(__name__)



class LayerHooks:
    """What a rank knows of vLLM's per-layer hooks: `order`, the KV cache layers in the order
    one forward called wait_for_layer_load for each (None until a forward called it for all;
    layer-wise loads run only then), and `off`, set for good once a forward skipped a layer of
    a layer-wise load."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self.order: list[str] | None = None
        self.off = False
        self._step: dict[str, None] = {}  # this step's calls, in order

    def seen(self, name: str) -> None:
        """vLLM called wait_for_layer_load(name)."""
        if self.order is None and not self.off and name in self.names:
            self._step.setdefault(name, None)

    def step_done(self) -> None:
        """The step ended: learn the order from it when its forward waited for every layer."""
        if (self.order is None and not self.off and self.names
                and len(self._step) == len(self.names)):
            self.order = list(self._step)
            log.info("tpkv vLLM connector: vLLM waits for each of %d layers: loads run layer "
                     "by layer", len(self.order))
        self._step = {}

    def missed(self) -> None:
        """A forward did not wait for a layer of a layer-wise load: loads go whole from now."""
        if not self.off:
            log.warning("tpkv vLLM connector: a forward did not call wait_for_layer_load for "
                        "every layer; its loaded blocks are recomputed and loads are copied "
                        "whole before the forward from now on")
        self.off = True
        self.order = None


@dataclass
class LayerJob:
    """One step's layer-wise copies: `batch` (vLLM block ids and their stored bytes [layers,
    page_bytes], held by the caller until `finish`) copied layer after layer in `order`
    (indices of the copier's views; `names` are their layer names). By position in `order`:
    `copied` is set once that layer's copies are in (on a GPU: issued, and `events` holds the
    event after them); `waited` holds the positions the forward waited for."""

    batch: HostBatch
    order: list[int]
    names: dict[str, int]  # layer name -> position in order
    copied: list[threading.Event]
    events: list[Any]
    waited: set[int] = field(default_factory=set)
    start_event: Any = None  # on a GPU: recorded on the forward's stream when the job started
    error: BaseException | None = None


class LayerCopier(CopyThread[LayerJob]):
    """Runs LayerJobs on a daemon thread, one after the other, into `views` (each layer's KV
    cache as [num_blocks, page_bytes] uint8)."""

    def __init__(self, views: list[torch.Tensor], rank: int) -> None:
        super().__init__(views[0].device)
        self.views = views
        self.rows = KvRows(views)
        self._start(f"tpkv-layers-rank{rank}")

    def start(self, batch: HostBatch, order: list[int], names: list[str]) -> LayerJob:
        """Start copying `batch` layer by layer in `order`; returns at once."""
        job = LayerJob(batch, order, {name: pos for pos, name in enumerate(names)},
                       [threading.Event() for _ in order], [None] * len(order))
        job.start_event = self._caller_event()
        self._jobs.put(job)
        return job

    def wait(self, job: LayerJob, name: str) -> None:
        """Return once layer `name`'s copies are in (a name not in the job: every layer's, none
        of them counted as waited for)."""
        pos = job.names.get(name, len(job.order) - 1)
        job.copied[pos].wait()
        if name in job.names:
            job.waited.add(pos)
        event = job.events[pos]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def finish(self, job: LayerJob) -> bool:
        """Wait for every layer's copies (on a GPU, the forward's stream does, and the host
        waits until they read the job's host bytes); whether they all went in."""
        last = len(job.order) - 1
        job.copied[last].wait()
        if job.events[last] is not None:
            torch.cuda.current_stream(self.device).wait_event(job.events[last])
            job.events[last].synchronize()
        return job.error is None

    def _run_job(self, job: LayerJob, stream: Any) -> None:
        if stream is None:
            self._copy(job, None)
        else:
            with torch.cuda.stream(stream):
                stream.wait_event(job.start_event)  # after vLLM's writes to these blocks
                self._copy(job, stream)

    def _copy(self, job: LayerJob, stream: Any) -> None:
        pos = 0
        try:
            for pos, layer in enumerate(job.order):
                self.rows.load_batch(job.batch, [layer], stream)
                if stream is not None:
                    job.events[pos] = stream.record_event()
                job.copied[pos].set()
        except Exception as exc:  # this layer and the later ones are not known to be in
            log.exception("tpkv vLLM connector: layer-wise load failed at layer %d", pos)
            job.error = exc
            if stream is not None:  # what was issued still reads the job's host bytes
                stream.synchronize()
            for event in job.copied[pos:]:
                event.set()
