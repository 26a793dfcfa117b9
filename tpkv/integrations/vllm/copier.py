"""Worker side: copies vLLM's paged KV blocks to and from the rank's block store, exactly."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.disk_format import DiskLayout
from tpkv.integrations.vllm.async_load import BackgroundLoader, LoadJob
from tpkv.integrations.vllm.block_io import HostBatch, KvRows, batch_of, block_views
from tpkv.integrations.vllm.layer_load import LayerCopier, LayerJob
from tpkv.integrations.vllm.options import DiskSpec, queue_bytes_in_effect, write_queue_blocks
from tpkv.integrations.vllm.plan import LoadSpec, RankFigures, SaveSpec, StepPlan, StepReport
from tpkv.integrations.vllm.record import BlockRecord
from tpkv.integrations.vllm.stats import rank_figures
from tpkv.integrations.vllm.store import HELD, REFUSED, HostBlockStore

log = logging.getLogger(__name__)


class BlockCopier:
    """A rank's half of the connector: applies each step's plan to vLLM's KV cache and the
    block store, and reports what happened. A block that cannot be served exactly is reported
    as a failed load (vLLM recomputes it); a save of a request whose load failed this step is
    not made (its KV was computed over blocks that were not loaded). Loads marked `background`
    run on a BackgroundLoader; take_finished names the requests whose loads are done and adds
    their failed blocks and report to this step's. The others are read and checked in `load`
    and copied at once, or with a layer order layer by layer on a LayerCopier (wait_layer,
    finish_layer_loads). Every call into the store holds `lock`."""

    def __init__(self, capacity_bytes: int, disk: DiskSpec | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.disk = disk
        self.layer_names: list[str] = []
        self._views: list[torch.Tensor] = []
        self.rows: KvRows | None = None
        self._stream: Any = None  # on a GPU: the stream of the step's saves and whole loads
        self.store: HostBlockStore | None = None
        self._report = StepReport()
        self._failed_block_ids: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_disk_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.rank = 0
        self._sent: RankFigures | None = None  # the figures last reported
        self.lock = threading.RLock()
        self.loader: BackgroundLoader | None = None
        self.num_async_loads = 0
        self.layers: LayerCopier | None = None
        self._layer_job: LayerJob | None = None
        self._layer_owners: list[tuple[LoadSpec, int]] = []  # by block of the job: spec, pos
        self._layer_held: list[BlockRecord] = []  # the job's records, held until it is done
        self.num_layer_loaded_blocks = 0  # of num_loaded_blocks, those copied layer-wise
        self.num_layer_misses = 0  # layer-wise loads the forward did not wait for every layer of

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                 rank: int = 0) -> None:
        """Take vLLM's KV caches of rank `rank`; open the stores (the disk tier's errors, a
        cap below one record or a directory that cannot be written, are ConfigErrors)."""
        names, views = block_views(kv_caches, num_blocks)
        shape = (len(views), int(views[0].shape[1]))
        disk = None
        queue = 0
        queue_bytes = None
        if self.disk is not None:
            spec = self.disk
            queue = write_queue_blocks(self.capacity_bytes, spec.queue_bytes, shape[0] * shape[1])
            queue_bytes = queue_bytes_in_effect(self.capacity_bytes, spec.queue_bytes)
            layout = DiskLayout(spec.seed, rank, spec.block_tokens, shape)
            disk = DiskBlockStore(spec.root, spec.capacity_bytes, layout, spec.model_fingerprint)
        try:
            store = HostBlockStore(self.capacity_bytes, shape, disk, queue, queue_bytes)
        except BaseException:
            if disk is not None:
                disk.close()
            raise
        self.layer_names, self._views, self.store, self.rank = names, views, store, rank
        self.rows = KvRows(views)

    def _loader(self) -> BackgroundLoader:
        if self.loader is None:
            device = self._views[0].device if self._views else torch.device("cpu")
            self.loader = BackgroundLoader(self.store, self.lock, self._copy_in,
                                           self._fail_job_block, device, self.rank)
        return self.loader

    def load(self, loads: list[LoadSpec], layer_order: list[str] | None = None) -> None:
        """Copy each load's stored blocks into its vLLM blocks, the background ones on the
        loader's thread (see take_finished), the others now: read and checked now, and copied
        now or, with `layer_order` (this rank's layer names in the order the forward runs
        them), layer by layer on the LayerCopier's thread (wait_layer waits for a layer,
        finish_layer_loads for all). A miss or a record that does not check out is a failed
        block (reported by take_failed_block_ids)."""
        self.finish_layer_loads()
        now = [spec for spec in loads if not spec.background]
        for spec in loads:
            if spec.background:
                self.num_async_loads += 1
                self._loader().submit(spec, inline=spec.inline)
        with self.lock:
            got = self._read(now)
        block_ids = [block_id for _, _, block_id, _ in got]
        owners = [(spec, pos) for spec, pos, _, _ in got]
        held = [rec for _, _, _, rec in got]
        if held and layer_order is None:
            try:
                self._copy_in(block_ids, held)
            except Exception:  # not known to be in place: failed loads, recomputed
                log.exception("tpkv vLLM connector: rank %d's load of %d blocks failed",
                              self.rank, len(held))
                for spec, pos in owners:
                    _fail(self._report, self._failed_block_ids, spec, pos)
            else:
                self.num_loaded_blocks += len(held)
            finally:
                self._release(held)
        elif held and layer_order is not None:
            if self.layers is None:
                self.layers = LayerCopier(self._views, self.rank)
            index = {name: i for i, name in enumerate(self.layer_names)}
            batch = self._batch(block_ids, held)
            try:
                self._layer_job = self.layers.start(batch, [index[n] for n in layer_order],
                                                    layer_order)
            except BaseException:
                self._release(held)
                raise
            self._layer_held = held  # released once the copies are in (finish_layer_loads)
            self._layer_owners = owners

    def _read(self, loads: list[LoadSpec]) -> list[tuple[LoadSpec, int, int, BlockRecord]]:
        """The blocks of `loads` that check out, all taken at once: (spec, pos, vLLM block id,
        its record, held: the caller releases it); the others are failed blocks."""
        wanted = [(spec, pos) for spec in loads for pos in range(len(spec.keys))]
        if self.store is None:
            for spec, pos in wanted:
                _fail(self._report, self._failed_block_ids, spec, pos)
            return []
        keys = [spec.keys[pos] for spec, pos in wanted]
        from_disk = [not self.store.in_memory(key) for key in keys]
        got = []
        for (spec, pos), disk, rec in zip(wanted, from_disk, self.store.take(keys)):
            if rec is None:
                _fail(self._report, self._failed_block_ids, spec, pos)
                continue
            if disk:  # the planner counts those before the request's first failure
                self._report.disk_loads.setdefault(spec.req_id, set()).add(
                    spec.first_block + pos)
                self.num_disk_loaded_blocks += 1
            got.append((spec, pos, spec.block_ids[pos], rec))
        return got

    def _release(self, recs: list[BlockRecord]) -> None:
        if self.store is not None:
            with self.lock:
                for rec in recs:
                    self.store.release(rec)

    def wait_layer(self, name: str) -> None:
        """Return once this step's layer-wise loads copied layer `name` (at once without)."""
        if self._layer_job is not None and self.layers is not None:
            self.layers.wait(self._layer_job, name)

    def finish_layer_loads(self) -> bool:
        """Wait for this step's layer-wise loads. Their blocks are failed loads when a copy
        failed or when the forward did not wait for every layer (it may have read one before
        its copy); False in that last case."""
        job, self._layer_job = self._layer_job, None
        if job is None or self.layers is None:
            return True
        copied = self.layers.finish(job)
        held, self._layer_held = self._layer_held, []
        self._release(held)
        waited = len(job.waited) == len(job.order)
        if copied and waited:
            self.num_loaded_blocks += len(job.batch)
            self.num_layer_loaded_blocks += len(job.batch)
            return True
        if not waited:
            self.num_layer_misses += 1
        for spec, pos in self._layer_owners:
            _fail(self._report, self._failed_block_ids, spec, pos)
        return waited

    def _copy_in(self, block_ids: list[int], recs: list[BlockRecord], stream: Any = None
                 ) -> None:
        """Copy held records into vLLM blocks `block_ids` (KvRows): on the CPU done on
        return; on a GPU on `stream` (the caller synchronizes it), or without one on the
        copier's stream after the current one, synchronized here."""
        assert self.rows is not None
        batch = self._batch(block_ids, recs)
        if not self.rows.on_gpu or stream is not None:
            self.rows.load_batch(batch, None, stream)
            return
        own = self._copy_stream()
        own.wait_stream(torch.cuda.current_stream(self.rows.device))
        with torch.cuda.stream(own):  # row-by-row copies, too
            self.rows.load_batch(batch, None, own)
        own.synchronize()

    def _batch(self, block_ids: list[int], recs: list[BlockRecord]) -> HostBatch:
        assert self.rows is not None
        return batch_of(block_ids, recs, self.store.slots if self.store else None,
                        self.rows.on_gpu)

    def _copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._views[0].device)
        return self._stream

    def _fail_job_block(self, job: LoadJob, pos: int) -> None:
        _fail(job.report, job.failed_block_ids, job.spec, pos)

    def take_finished(self) -> set[str]:
        """Requests whose background loads are done on this rank (every block in the KV cache
        or failed); their failed blocks join take_failed_block_ids and their outcome this
        step's report."""
        if self.loader is None:
            return set()
        done = self.loader.take_done()
        for job in done:
            self._report = self._report.merge(job.report)
            self._failed_block_ids |= job.failed_block_ids
            self.num_loaded_blocks += job.loaded_blocks
            self.num_disk_loaded_blocks += job.disk_blocks
        return {job.spec.req_id for job in done}

    def close(self) -> None:
        """Finish the background loads, then close the store (its disk tier's directory)."""
        self.finish_layer_loads()
        if self.layers is not None:
            self.layers.close()
        if self.loader is not None and not self.loader.close():
            log.warning("tpkv vLLM connector: rank %d's background loads did not finish",
                        self.rank)
            return
        if self.store is not None:
            with self.lock:
                self.store.close()

    def save(self, saves: list[SaveSpec]) -> None:
        """Copy the named vLLM blocks into the store."""
        self.finish_layer_loads()
        with self.lock:
            self._save(saves)

    def _save(self, saves: list[SaveSpec]) -> None:
        """Reserve a slot for each block and copy them in one batch, then keep them; when the
        store has no slot left for the next block, the batch reserved so far is copied and
        kept first (their slots may then go to disk or be given up for room), and the block
        asks again."""
        store = self.store
        todo: list[tuple[SaveSpec, int]] = []
        for spec in saves:
            slot = None
            if spec.req_id not in self._report.failed_load_reqs and store is not None:
                slot = store.reserve(spec.key, spec.parent, spec.tokens)
                if slot is None and todo:
                    self._save_batch(todo)
                    todo = []
                    slot = store.reserve(spec.key, spec.parent, spec.tokens)
                if slot is None:
                    store.full(spec.key)
            if slot is None or slot == REFUSED:
                self._report.failed_saves.add(spec.key)
            elif slot == HELD:
                self._report.saved.add(spec.key)
                self.num_saved_blocks += 1
            else:
                todo.append((spec, slot))
        self._save_batch(todo)

    def _save_batch(self, todo: list[tuple[SaveSpec, int]]) -> None:
        """Copy the reserved blocks `todo` ((spec, slot)) from vLLM's KV cache, keep them."""
        store = self.store
        if not todo or store is None or self.rows is None:
            return
        on_gpu = self.rows.on_gpu
        slots = [slot for _, slot in todo]
        try:
            self.rows.save([spec.block_id for spec, _ in todo],
                           [store.slots.view(slot) for slot in slots],
                           self._copy_stream() if on_gpu else None,
                           pinned=on_gpu and store.slots.pinned_for(slots))
        except BaseException:
            for spec, _ in todo:
                store.cancel(spec.key)
            raise
        store.admit([spec.key for spec, _ in todo])
        for spec, _ in todo:
            self._report.saved.add(spec.key)
            self.num_saved_blocks += 1

    def drop(self, keys: list[bytes]) -> None:
        if self.store is not None:
            with self.lock:
                for key in keys:
                    self.store.drop(key)

    def apply_after_forward(self, plan: StepPlan) -> None:
        """Drops first (they free room in memory and on disk for the saves; none is a block this
        step loaded or saves, and a key dropped by a reset and saved again is kept), then
        saves."""
        self.finish_layer_loads()
        self.drop(plan.drops)
        self.save(plan.saves)

    def take_failed_block_ids(self) -> set[int]:
        self.finish_layer_loads()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def take_report(self) -> StepReport | None:
        """This step's report (None when nothing happened), with the store's figures when they
        changed since the last report that carried them, naming this rank."""
        self.finish_layer_loads()
        if self.store is not None:
            with self.lock:
                self._report.lost.update(self.store.take_lost())
                figures = rank_figures(self.rank, self.store)
            if figures != self._sent:
                self._report.figures[self.rank] = self._sent = figures
        report, self._report = self._report, StepReport()
        report.ranks = {self.rank}
        return report if report else None



def _fail(report: StepReport, failed_block_ids: set[int], spec: LoadSpec, pos: int) -> None:
    """Block `pos` of a load failed: vLLM recomputes its request from there."""
    failed_block_ids.add(spec.block_ids[pos])
    report.failed_loads.add(spec.keys[pos])
    first = spec.first_block + pos
    prev = report.failed_load_reqs.get(spec.req_id, first)
    report.failed_load_reqs[spec.req_id] = min(prev, first)

