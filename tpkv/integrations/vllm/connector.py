"""TpkvConnector: vLLM's KV connector (v1) over tpkv's content-addressed block store.

Turn it on with
`KVTransferConfig(kv_connector="TpkvConnector", kv_connector_module_path="tpkv.integrations.vllm",
kv_role="kv_both", kv_load_failure_policy="recompute")` (or the same as JSON in `vllm serve
--kv-transfer-config`); "recompute" makes vLLM recompute a block that fails tpkv's checks instead
of failing the request. `kv_connector_extra_config={"disk_dir": DIR}` adds the disk tier (see
ConnectorOptions). The scheduler side (a Planner) keeps the prefix index, which at start takes
the blocks an earlier process left in the disk tier (in this process, or with `controller`
"ray" in a Ray actor: see below); the worker side (a BlockCopier per rank)
copies blocks, whole blocks (a block read from disk comes back into host memory). A load runs
either in the step or, as vLLM's asynchronous load, in the background (`async_loads`, see
load_policy.LoadPolicy: by default a load that reads the disk tier or is 64 MiB or more a
rank). In the step, start_load_kv reads and checks every block, then copies them layer by layer
on the rank's copy thread and returns; vLLM's attention calls wait_for_layer_load(layer) before
each layer, which waits for that layer's copies only (layer_load.py; the layers' order is
learned from the first forward that called it for every layer: until then, and for good after
a forward that skipped a layer's wait, whose loaded blocks are then recomputed, the blocks are
copied whole before the forward). Their failed blocks go to vLLM after the forward, in
get_block_ids_with_load_errors; vLLM drops the step's output of their requests and recomputes
from the first. In the background, the request waits in vLLM's WAITING_FOR_REMOTE_KVS state,
each rank's loader thread copies its blocks into the KV cache (in a step without a forward, a
load under that size is copied at once on the worker's thread) and get_finished names the
request once they are all in; its failed blocks go out no later than that, in
get_block_ids_with_load_errors, and vLLM recomputes from the first. The blocks of a background
load are kept from eviction until it is done: in the index until every rank named it finished,
in a rank's store by taking the record in memory or pinning it on disk when the load starts.
Saves come after the forward. Blocks leave host memory for disk through a background writer
(ConnectorOptions.disk_queue_bytes): the step never waits on a disk write, and a block given
up because the writer fell behind is reported and forgotten (and counted, with a warning that
names disk_queue_bytes). With `dashboard_port` set the scheduler
side serves tpkv's dashboard of this instance (tpkv.integrations.vllm.dashboard): each rank's
report carries its store's figures when they changed.

With tensor or pipeline parallelism every rank keeps its own shard of each block (its own host
store and disk tier directory, `rank<N>`) and gets the same plan; vLLM merges the ranks'
reports, and the index holds a block only once every rank stored it. A block one rank failed
to save or load, or lost, is forgotten and dropped on every rank (a rank's save that went
through may hold KV another rank's failed load made wrong), and a load that fails on any rank
is a failed block that vLLM recomputes on all of them. vLLM takes a background load as
finished once every rank named it; a block any rank failed is recomputed on all (vLLM merges
their failed blocks), and the index forgets and drops it on all.

With `controller` "ray" the index lives in a named Ray actor (ray_index.py: one per vLLM
instance, named by model, block size, disk tier directory and vLLM's engine_id, made on first
use in the Ray cluster the scheduler's process is in, joins or starts, restarted by Ray when it
dies, killed at shutdown; it builds its index from the disk tier, so an instance finds what
another left there, never what another holds in memory; it answers only the scheduler that
made it, so an instance given another live one's engine_id makes an actor of its own, with a
warning). The scheduler answers vLLM's matches
from a mirror of the actor's key sets and calls it at most once a step, when the step has
blocks to store (remote_index.RemoteIndex; msgpack bytes, no pickled objects). When the
actor is dead or slower than controller_timeout_s the scheduler goes on without it, with one
warning: nothing matches (vLLM computes the prompts), nothing new is stored, loads promised
before still run (the ranks hold their blocks: only the scheduler's plans drop blocks). It
looks for the actor again every second without waiting on it (a restarted one, or a new one it
makes by the same name) and takes the index that actor rebuilt from the disk tier; blocks only
the ranks' memory held are no longer matched, and the ranks' stores push them out as they make
room.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpkv.errors import KvLayoutError
from tpkv.integrations.disk_blocks import check_disk_bytes, prepare_dir
from tpkv.integrations.disk_format import record_bytes
from tpkv.integrations.index_service import IndexSpec, build_index
from tpkv.integrations.prefix_index import PrefixIndex, chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.dashboard import ConnectorDashboard
from tpkv.integrations.vllm.layer_load import LayerHooks
from tpkv.integrations.vllm.load_policy import LoadPolicy
from tpkv.integrations.vllm.options import (
    ConnectorOptions,
    DiskSpec,
    instance_id,
    vllm_fingerprint,
    write_queue_blocks,
)
from tpkv.integrations.vllm.plan import StepPlan, StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.remote_index import RemoteIndex

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class TpkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one step's plan."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TpkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: one step's report (merged over ranks by vLLM)."""

    report: StepReport = field(default_factory=StepReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TpkvWorkerMetadata):
            raise TypeError(f"cannot merge a {type(other).__name__} into TpkvWorkerMetadata")
        return TpkvWorkerMetadata(self.report.merge(other.report))


def _block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block over every attention layer on one rank (one KV cache group only)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KvLayoutError(f"TpkvConnector handles one KV cache group, the model has "
                            f"{len(groups)}")
    return int(groups[0].kv_cache_spec.page_size_bytes) * len(groups[0].layer_names)


def _num_ranks(vllm_config: VllmConfig) -> int:
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def _worker_rank() -> int:
    """This worker's rank over tensor and pipeline parallelism (its disk tier directory)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return int(tp.rank_in_group) + int(tp.world_size) * int(get_pp_group().rank_in_group)


class TpkvConnector(KVConnectorBase_V1):
    """vLLM serves prompt prefixes from tpkv: see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = ConnectorOptions.from_extra(
            self._kv_transfer_config.kv_connector_extra_config)
        self.block_tokens = int(vllm_config.cache_config.block_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("TpkvConnector: kv_load_failure_policy is %r: a block that fails its "
                        "check fails its request; set it to 'recompute' to have vLLM recompute "
                        "the block", self._kv_transfer_config.kv_load_failure_policy)
        self.planner: Planner | None = None
        self.copier: BlockCopier | None = None
        self.hooks = LayerHooks(())
        self.dashboard: ConnectorDashboard | None = None
        fingerprint = vllm_fingerprint(vllm_config, self.options)
        seed = chain_seed(fingerprint, self.block_tokens)
        disk_dir = self.options.disk_dir
        if role == KVConnectorRole.SCHEDULER:
            block_bytes = _block_bytes(kv_cache_config)
            capacity = max(self.options.host_bytes // block_bytes, 1)
            disk_blocks = 0
            if disk_dir is not None:  # bad settings fail here, before any request
                disk_blocks = check_disk_bytes(self.options.disk_bytes,
                                               record_bytes(self.block_tokens, block_bytes),
                                               block_bytes)
                # blocks queued for disk stay in host memory: the index holds what is left
                capacity -= write_queue_blocks(self.options.host_bytes,
                                               self.options.disk_queue_bytes, block_bytes)
                for rank in range(_num_ranks(vllm_config)):
                    prepare_dir(disk_dir, rank)
            policy = LoadPolicy(self.options.async_loads, self.options.async_load_bytes,
                                block_bytes, capacity)
            spec = IndexSpec(capacity + disk_blocks, self.block_tokens, seed,
                             _num_ranks(vllm_config), disk_dir, disk_blocks,
                             instance_id(self._kv_transfer_config.engine_id))
            self.planner = Planner(self.block_tokens, seed, capacity + disk_blocks,
                                   _num_ranks(vllm_config), policy, self._index(spec))
            if self.options.dashboard_port is not None:
                info = {"model": str(vllm_config.model_config.model),
                        "block_tokens": self.block_tokens, "block_bytes": block_bytes,
                        "num_ranks": _num_ranks(vllm_config), "disk_tier": disk_dir is not None,
                        "host_capacity_blocks": capacity, "disk_capacity_blocks": disk_blocks}
                self.dashboard = ConnectorDashboard(self.planner, self.options, info)
                self.dashboard.start()
        else:
            disk = None if disk_dir is None else DiskSpec(
                disk_dir, self.options.disk_bytes, seed, self.block_tokens, fingerprint,
                self.options.disk_queue_bytes)
            self.copier = BlockCopier(self.options.host_bytes, disk)

    def _index(self, spec: IndexSpec) -> PrefixIndex | RemoteIndex:
        """The prefix index where `controller` says: built here from the disk tier, or on
        the named Ray actor (which builds it there)."""
        if self.options.controller == "local":
            return build_index(spec)
        from tpkv.integrations.vllm.ray_index import RayTransport

        return RemoteIndex(RayTransport(spec), spec.capacity_blocks,
                           self.options.controller_timeout_s)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, never lost work

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.copier is not None
        self.copier.register(kv_caches, int(self._kv_cache_config.num_blocks), _worker_rank())
        self.hooks = LayerHooks(self.copier.layer_names)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TpkvConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.copier is not None
        self._end_layer_loads()
        self.copier.load(self._plan().loads, self.hooks.order)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.copier is not None
        self.hooks.seen(layer_name)
        self.copier.wait_layer(layer_name)

    def _end_layer_loads(self) -> None:
        """Wait for this step's layer-wise loads; a forward that skipped a layer's wait turns
        them off (its blocks are failed loads)."""
        assert self.copier is not None
        if not self.copier.finish_layer_loads():
            self.hooks.missed()

    def clear_connector_metadata(self) -> None:
        self.hooks.step_done()
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        assert self.copier is not None
        return None, self.copier.take_finished() or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # whole blocks are copied in wait_for_save

    def wait_for_save(self) -> None:
        assert self.copier is not None
        self._end_layer_loads()
        self.copier.apply_after_forward(self._plan())

    def shutdown(self) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()
        if self.copier is not None:
            self.copier.close()  # background loads end, the disk tier's directory is given up
        if self.planner is not None and isinstance(self.planner.index, RemoteIndex):
            self.planner.index.close()  # the instance's index actor ends with it
        super().shutdown()

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.copier is None:
            return set()
        self._end_layer_loads()
        return self.copier.take_failed_block_ids()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.copier is not None:
            self._end_layer_loads()
        report = self.copier.take_report() if self.copier is not None else None
        return None if report is None else TpkvWorkerMetadata(report)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.planner is not None
        tokens = self.planner.matched_tokens(request, num_computed_tokens)
        return tokens, self.planner.loads_async(request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.planner is not None
        self.planner.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.planner is not None and self._kv_cache_manager is not None
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [(r.req_id, r.num_computed_tokens + counts.get(r.req_id, 0))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [(req_id, cached.num_computed_tokens[i] + counts.get(req_id, 0))
                      for i, req_id in enumerate(cached.req_ids)]
        manager = self._kv_cache_manager
        plan = self.planner.plan(scheduled, lambda req_id: manager.get_block_ids(req_id)[0],
                                 idle=scheduler_output.total_num_scheduled_tokens == 0)
        return TpkvConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self.planner is not None and isinstance(meta, TpkvWorkerMetadata):
            self.planner.report(meta.report)
        if self.planner is not None and connector_output.finished_recving:
            self.planner.loads_finished(connector_output.finished_recving)

    def reset_cache(self) -> bool | None:
        if self.planner is None:
            return None
        self.planner.reset()
        return True

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.planner is not None
        return False, {"tpkv": self.planner.finished(request.request_id)}
