"""What the scheduler side tells the workers each step, and what a worker reports back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadSpec:
    """Copy the stored blocks `keys` into vLLM blocks `block_ids` (the request's logical blocks
    first_block, first_block + 1, ...): in this step, each layer before the forward's attention
    reads it (layer_load.py), or with `background` on the rank's loader thread, the request
    named finished by get_finished once all are in (with `inline` too, at once on the worker's
    thread: the step has no forward to overlap)."""

    req_id: str
    first_block: int
    block_ids: list[int]
    keys: list[bytes]
    background: bool = False
    inline: bool = False


@dataclass
class SaveSpec:
    """After this step's forward, store vLLM block `block_id` under `key`, the key of `parent`
    and `tokens`."""

    req_id: str
    block_id: int
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass
class StepPlan:
    """One step's work for every rank: loads for the forward; drops, then saves, after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    drops: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class RankFigures:
    """What one rank's store holds and gave up, for the dashboard (sent when it changed): blocks
    and bytes in host memory (blocks queued for disk included, `queued` of them), on disk,
    their caps, and the blocks and bytes a full disk write queue gave up since start with the
    bytes the queue needed to give up none; and the host memory pinned for copies (the store's
    pool: all of host_capacity_bytes once pinned where CUDA is present, 0 without). A block
    read back from disk is in both tiers."""

    rank: int
    block_bytes: int
    host_blocks: int
    host_bytes: int
    host_capacity_bytes: int
    queued_blocks: int = 0
    disk_enabled: bool = False
    disk_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    dropped_blocks: int = 0
    dropped_bytes: int = 0
    needed_queue_bytes: int = 0
    pinned_bytes: int = 0


@dataclass
class StepReport:
    """One step's outcome on one rank (or merged over ranks): keys written, keys whose save or
    load failed, per request the first logical block whose load failed, per request the logical
    blocks loaded from the disk tier, keys the rank no longer holds (given up before their
    disk write landed, or whose write failed), by rank its store's figures when they changed,
    and the ranks whose reports it holds."""

    saved: set[bytes] = field(default_factory=set)
    failed_saves: set[bytes] = field(default_factory=set)
    failed_loads: set[bytes] = field(default_factory=set)
    failed_load_reqs: dict[str, int] = field(default_factory=dict)
    disk_loads: dict[str, set[int]] = field(default_factory=dict)
    lost: set[bytes] = field(default_factory=set)
    figures: dict[int, RankFigures] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.saved or self.failed_saves or self.failed_loads or self.disk_loads
                    or self.lost or self.figures)

    def merge(self, other: StepReport) -> StepReport:
        """Ranks merged: a key counts as saved only when no rank failed or lost it (the
        scheduler forgets those), failures and losses are the union, each request's first
        failed block the lowest, each request's disk-loaded blocks those any rank loaded, the
        figures of every rank that sent them, the ranks of both."""
        reqs = dict(self.failed_load_reqs)
        for req_id, first in other.failed_load_reqs.items():
            reqs[req_id] = min(first, reqs.get(req_id, first))
        disk = {req_id: set(blocks) for req_id, blocks in self.disk_loads.items()}
        for req_id, blocks in other.disk_loads.items():
            disk.setdefault(req_id, set()).update(blocks)
        return StepReport(self.saved | other.saved, self.failed_saves | other.failed_saves,
                          self.failed_loads | other.failed_loads, reqs, disk,
                          self.lost | other.lost, {**self.figures, **other.figures},
                          self.ranks | other.ranks)
