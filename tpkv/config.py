"""Frozen, validated config: KV geometry, tiers, policy; from_env lays TPKV_* variables over it.

Every field is checked at construction (tpkv.checks): a wrong type, NaN, inf or a value out of
range is a ConfigError naming the field and the value. The environment is read by tpkv.settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tpkv import settings
from tpkv.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_str,
    check_type,
    check_watermarks,
)
from tpkv.errors import ConfigError
from tpkv.settings import parse_bytes  # noqa: F401  (tpkv.config.parse_bytes stays public)

GiB = 1 << 30
MiB = 1 << 20
# L3 files are written in units of this (O_DIRECT): each block's record is a header of this size
# plus the block's bytes padded to it (docs/ssd-format.md).
SSD_ALIGN_BYTES = 4096


def ssd_record_bytes(block_bytes: int) -> int:
    """Bytes one block of `block_bytes` (one rank's shard) takes in an L3 segment."""
    return SSD_ALIGN_BYTES + -(-block_bytes // SSD_ALIGN_BYTES) * SSD_ALIGN_BYTES

# Element sizes of the dtypes a KV cache is stored in (names as torch spells them).
DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class KvGeometry:
    """Shape of the KV cache, and of one block on one TP rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 16
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            check_int(name, getattr(self, name))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.num_kv_heads % self.tp_size != 0:
            raise ConfigError(
                f"kv_heads % tp != 0: {self.num_kv_heads} KV heads cannot be split evenly "
                f"over {self.tp_size} TP ranks"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block on one rank: [layers, 2 (K, V), block_tokens, heads_per_rank, head_dim]."""
        return (self.num_layers, 2, self.block_tokens, self.heads_per_rank, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block on one rank."""
        return 2 * self.block_tokens * self.heads_per_rank * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on one rank."""
        return self.num_layers * self.layer_bytes

    @property
    def token_bytes_all_ranks(self) -> int:
        """KV bytes of one token summed over all ranks."""
        return self.block_bytes * self.tp_size // self.block_tokens

    def fingerprint(self) -> str:
        """Stable digest of every field; part of what makes an SSD record valid."""
        text = "|".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class HbmConfig:
    """L1, per GPU (each rank has its own HBM): size in blocks or bytes, and watermarks."""

    num_blocks: int | None = None
    budget_bytes: int | None = None
    high_watermark: float = 0.90
    low_watermark: float = 0.75

    def __post_init__(self) -> None:
        if (self.num_blocks is None) == (self.budget_bytes is None):
            raise ConfigError("L1 needs exactly one of num_blocks or budget_bytes")
        if self.num_blocks is not None:
            check_int("L1 num_blocks", self.num_blocks)
        if self.budget_bytes is not None:
            check_int("L1 budget_bytes", self.budget_bytes)
        check_watermarks("L1", self.high_watermark, self.low_watermark)

    def slots(self, geometry: KvGeometry) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        assert self.budget_bytes is not None
        slots = self.budget_bytes // geometry.block_bytes
        if slots < 1:
            raise ConfigError(
                f"L1 budget of {self.budget_bytes} bytes holds no block of "
                f"{geometry.block_bytes} bytes"
            )
        return slots


@dataclass(frozen=True)
class HostConfig:
    """L2: one node-wide budget of pinned host memory, divided across the TP ranks."""

    budget_bytes: int = 1 * GiB
    arena_bytes: int = 1 * GiB
    pin: Literal["auto", "always", "never"] = "auto"
    high_watermark: float = 0.85
    low_watermark: float = 0.70
    max_memory_fraction: float = 0.8

    def __post_init__(self) -> None:
        check_int("L2 budget_bytes", self.budget_bytes)
        check_int("L2 arena_bytes", self.arena_bytes)
        check_watermarks("L2", self.high_watermark, self.low_watermark)
        check_choice("L2 pin", self.pin, ("auto", "always", "never"))
        check_float("L2 max_memory_fraction", self.max_memory_fraction, 0.0, 1.0, lo_open=True)
        limit = int(machine_memory_bytes() * self.max_memory_fraction)
        if self.budget_bytes > limit:
            raise ConfigError(
                f"L2 budget of {self.budget_bytes / GiB:.2f} GiB is above "
                f"{self.max_memory_fraction:.0%} of this machine's "
                f"{machine_memory_bytes() / GiB:.2f} GiB of memory ({limit / GiB:.2f} GiB)"
            )

    def bytes_per_rank(self, tp_size: int) -> int:
        return self.budget_bytes // tp_size

    def slots_per_rank(self, geometry: KvGeometry) -> int:
        slots = self.bytes_per_rank(geometry.tp_size) // geometry.block_bytes
        if slots < 1:
            raise ConfigError(
                f"L2 budget of {self.budget_bytes} bytes over {geometry.tp_size} ranks holds no "
                f"block of {geometry.block_bytes} bytes"
            )
        return slots


@dataclass(frozen=True)
class SsdConfig:
    """L3: a directory of append-only segment files; None disables the tier."""

    root: str | None = None
    budget_bytes: int = 64 * GiB
    backend: Literal["auto", "posix", "kvikio"] = "auto"
    o_direct: bool = True
    io_threads: int = 4  # threads that read (a resume's reads); spills have their own
    # Threads that write spills: apart from the readers, so that a resume's reads never queue
    # behind spills submitted before them.
    write_threads: int = 4
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    # Writes (spills) go out in pieces and pause between them while this rank reads (a resume
    # waits for its reads, not for spills). The most bytes one write carries between pauses:
    # a resume's reads start behind at most this much of a spill per writing thread.
    write_piece_bytes: int = 4 << 20
    # Host memory (node-wide, split over the ranks like the budget) for the records of
    # returning sessions read ahead of the step that loads them (tpkv.ssd.readahead); 0: none.
    read_ahead_bytes: int = 2 * GiB

    def __post_init__(self) -> None:
        if self.root is not None and (not isinstance(self.root, (str, os.PathLike))
                                      or not str(self.root).strip()):
            raise ConfigError(f"L3 root must be a directory path or None, got {self.root!r}")
        check_int("L3 budget_bytes", self.budget_bytes)
        check_int("L3 io_threads", self.io_threads)
        check_int("L3 write_threads", self.write_threads)
        check_int("L3 write_piece_bytes", self.write_piece_bytes)
        check_int("L3 read_ahead_bytes", self.read_ahead_bytes, lo=0)
        check_watermarks("L3", self.high_watermark, self.low_watermark)
        check_choice("L3 backend", self.backend, ("auto", "posix", "kvikio"))
        check_bool("L3 o_direct", self.o_direct)
        if self.root is not None:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"L3 directory {self.root!r} cannot be created: {exc}") from exc
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise ConfigError(f"L3 directory {self.root!r} is not writable")

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def bytes_per_rank(self, tp_size: int) -> int:
        """Each rank's share of the budget: it stores its own shard of every block."""
        return self.budget_bytes // tp_size

    def capacity_blocks(self, geometry: KvGeometry) -> int:
        """Blocks the budget holds, counted as the store counts them: one record of
        ssd_record_bytes(block_bytes) per block and rank (a segment's header aside)."""
        return self.bytes_per_rank(geometry.tp_size) // ssd_record_bytes(geometry.block_bytes)

    @staticmethod
    def budget_for(num_blocks: int, geometry: KvGeometry) -> int:
        """The budget_bytes whose capacity_blocks is num_blocks."""
        return num_blocks * ssd_record_bytes(geometry.block_bytes) * geometry.tp_size


@dataclass(frozen=True)
class PolicyConfig:
    """Placement policy knobs (see the controller)."""

    kind: Literal["heat", "lru", "lruk"] = "heat"
    w_attn: float = 0.7
    w_recency: float = 0.3
    lru_k: int = 2
    cooldown_s: float = 30.0
    auto_pin_fraction: float = 0.10
    max_auto_pin_blocks: int = 4096
    prefetch_steps: int = 2
    # "cost": L2 spills to L3 ahead of need as fast as the disk writes (spill pacing below); a
    # step whose copies into L2 would wait longer than spill_queue_s for the disk drops the
    # coldest L2 sessions for clean slots instead (their sessions are recomputed when they
    # return; blocks L3 holds records of leave as kept spills). Whether a return loads or
    # recomputes is decided when it comes back, with the GPU's and the disk's queues
    # (models/returns.py). "always": spill whatever must leave L2, the step waiting for the
    # disk if it must (keeps the most).
    spill: Literal["cost", "always"] = "cost"
    # Controller knobs (checked by tpkv.controller when it starts):
    max_moves_per_step: int = 512  # watermark moves per step (bounds copy time); demand uncapped
    prefetch_max_blocks: int = 1024  # speculative promotions per step
    # of those, L3 -> L2 stages per step (a turn in line's L3 blocks come up in parts of at
    # most this many): what the host copies beside one forward when the step's plans wait for
    # its launch (Worker.apply_step's late_ok). 0 (default): as many as the ranks' measured
    # L3 -> L2 rate moves in three quarters of a step (the lower decile of recent step gaps:
    # a decode step without staging), at least 16 (RateMeter.stage_blocks); N > 0: at most N
    prefetch_stage_max_blocks: int = 0
    auto_pin_refresh_steps: int = 64  # how often the auto-pin attention threshold is recomputed
    gpu_share_weight: float = 1.0  # a recompute delays the other sessions of its step by this much
    prefill_tokens_per_s: float = 70_000.0  # start value until prefill speed is measured
    h2d_bytes_per_s: float = 55e9  # per rank, L2 -> L1; start value until measured
    ssd_read_bytes_per_s: float = 2.1e9  # per rank, L3 -> L2; start value until measured
    # Spills paced (controller/spillpace.py): the L2 slots a spill still reads are handed out
    # after every other free slot, and L2 is spilled ahead of need so that clean slots cover
    # the next steps' copies into L2 (the largest intake of recent steps, plus the mean intake
    # over the steps a spill takes to be reported written), never queueing more than the disk
    # writes in spill_queue_s at the rate the ranks' spills measure (ssd_write_bytes_per_s
    # until then). A larger queue spills further ahead, but a session spilled ahead and
    # resumed at once waits for the queue before it: 0.25-0.5 s gave steps blocked 57-61 ms
    # in tests/multiproc/test_spill_pacing.py, 0.05-0.1 s at most 9 ms. Off: spilled slots
    # are free slots like the others, and L2 spills only at need and past its high mark.
    spill_pacing: bool = True
    ssd_write_bytes_per_s: float = 1.5e9  # per rank, L2 -> L3; start value until measured
    spill_queue_s: float = 0.1
    max_tracked_blocks: int = 1 << 25  # block table rows per node (metadata only)
    max_pending_plans: int = 256  # plans sent but not yet confirmed by every rank

    def __post_init__(self) -> None:
        check_choice("policy kind", self.kind, ("heat", "lru", "lruk"))
        check_choice("policy spill", self.spill, ("cost", "always"))
        try:
            check_float("policy w_attn", self.w_attn)
            check_float("policy w_recency", self.w_recency)
            if not self.w_attn + self.w_recency > 0:
                raise ConfigError("sum")
        except ConfigError:
            raise ConfigError(f"heat weights must be finite numbers >= 0 with a positive sum, "
                              f"got w_attn={self.w_attn!r} w_recency={self.w_recency!r}") from None
        check_int("lru_k", self.lru_k, 1, 64)
        check_float("policy cooldown_s", self.cooldown_s, 0.0, settings.MAX_WAIT_S)
        check_float("policy auto_pin_fraction", self.auto_pin_fraction, 0.0, 1.0)
        check_int("policy max_auto_pin_blocks", self.max_auto_pin_blocks, 0)
        check_int("policy prefetch_steps", self.prefetch_steps, 0)
        for name in ("max_moves_per_step", "prefetch_max_blocks",
                     "auto_pin_refresh_steps", "max_tracked_blocks", "max_pending_plans"):
            check_int(f"PolicyConfig.{name}", getattr(self, name))
        check_int("PolicyConfig.prefetch_stage_max_blocks", self.prefetch_stage_max_blocks, 0)
        check_float("PolicyConfig.gpu_share_weight", self.gpu_share_weight)
        for name in ("prefill_tokens_per_s", "h2d_bytes_per_s", "ssd_read_bytes_per_s",
                     "ssd_write_bytes_per_s"):
            check_float(f"PolicyConfig.{name}", getattr(self, name), lo_open=True)
        check_float("PolicyConfig.spill_queue_s", self.spill_queue_s, 0.0, settings.MAX_WAIT_S)
        check_bool("PolicyConfig.spill_pacing", self.spill_pacing)


@dataclass(frozen=True)
class TpkvConfig:
    """Everything one tpkv node needs; per-rank copies come from `dataclasses.replace`."""

    geometry: KvGeometry
    l1: HbmConfig
    l2: HostConfig = field(default_factory=HostConfig)
    l3: SsdConfig = field(default_factory=SsdConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    model_fingerprint: str = ""
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8470
    dashboard_token: str | None = None
    dashboard_cache_s: float = 0.5  # a dashboard snapshot is built at most this often
    wait_timeout_s: float = 30.0
    ray_address: str | None = None
    # TP workers (tpkv.workers.worker) and their all-gather confirmation:
    confirm_backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: gloo (see bench/consistency)
    heartbeat_s: float = 0.5  # liveness beats in the rendezvous store; names dead or stuck ranks
    # L2 -> L1 copies issued layer by layer, one event per layer: attention that waits layer by
    # layer (the transformers cache) starts on layer 0 before the rest has arrived. A forward
    # that waits for every layer first (the paged engine's graphs) gains nothing and pays a
    # descriptor per chunk per block in host time (bench/copy_issue.py): turn it off there
    # (bench/e2e.py runs TieredEngine with it off: ~2.4 ms less host time a 768-block resume).
    layer_events: bool = True
    layer_chunk_bytes: int = 64 << 10  # fewest bytes per block per per-layer copy (layers merge)

    def __post_init__(self) -> None:
        for name, kind in (("geometry", KvGeometry), ("l1", HbmConfig), ("l2", HostConfig),
                           ("l3", SsdConfig), ("policy", PolicyConfig)):
            check_type(name, getattr(self, name), kind)
        check_str("model_fingerprint", self.model_fingerprint)
        settings.check_host("dashboard_host", self.dashboard_host)
        check_int("dashboard_port", self.dashboard_port, 0, 65535)
        check_float("dashboard_cache_s", self.dashboard_cache_s, 0.0, settings.MAX_WAIT_S)
        if self.dashboard_token is not None:
            settings.check_token("dashboard_token", self.dashboard_token)
        check_float("wait_timeout_s", self.wait_timeout_s, 0.0, settings.MAX_WAIT_S,
                    lo_open=True)
        check_str("ray_address", self.ray_address, optional=True)
        check_choice("confirm_backend", self.confirm_backend, ("auto", "gloo", "nccl"))
        # used as min(heartbeat_s, wait_timeout_s / 8)
        check_float("heartbeat_s", self.heartbeat_s, 0.0, settings.MAX_WAIT_S, lo_open=True)
        check_bool("layer_events", self.layer_events)
        check_int("layer_chunk_bytes", self.layer_chunk_bytes, 0)


def from_env(config: TpkvConfig, env: Mapping[str, str] | None = None) -> TpkvConfig:
    """Overlay the TPKV_* environment variables (and RAY_ADDRESS) on `config`; every one is
    checked by tpkv.settings.read_env (a bad value: ConfigError naming the variable)."""
    s = settings.read_env(env)
    out = config
    if s.ssd_dir is not None:
        out = dataclasses.replace(out, l3=dataclasses.replace(out.l3, root=s.ssd_dir))
    if s.l2_bytes is not None:
        out = dataclasses.replace(out, l2=dataclasses.replace(out.l2, budget_bytes=s.l2_bytes))
    top: dict[str, Any] = {
        "dashboard_host": s.dashboard_host, "dashboard_port": s.dashboard_port,
        "dashboard_token": s.dashboard_token, "wait_timeout_s": s.wait_timeout_s,
        "ray_address": s.ray_address}
    changes = {k: v for k, v in top.items() if v is not None}
    return dataclasses.replace(out, **changes) if changes else out
