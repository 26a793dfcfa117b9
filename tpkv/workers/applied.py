"""AppliedPlan, AppliedStep, StepReport: a step as applied on this rank, and its confirmation."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tpkv.protocol.digest import slot_map_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MovePlan, MoveResult, Tier
from tpkv.workers.confirm import STATUS_MISSES, PendingConfirm, mismatch_error
from tpkv.workers.outcome import ExecOutcome

NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass
class AppliedPlan:
    """One plan as this rank applied it (the MoveResult is built once its copies are done)."""

    plan: MovePlan
    outcome: ExecOutcome
    moves_applied: int
    after: tuple[np.ndarray, np.ndarray]  # (tier, slot) of the plan's blocks after it, here
    status: int = 0
    misses: np.ndarray = field(default_factory=lambda: NO_IDS)

    def row(self) -> list[int]:
        """[epoch, moves_applied, digest of the plan's blocks as placed here, status]."""
        digest = slot_map_digest(self.plan.block_ids, *self.after)
        return [self.plan.epoch, self.moves_applied, digest, self.status]

    def result(self, rank: int, row_digest: int | None) -> MoveResult:
        """The report of rank `rank` for the controller: misses count as (NONE, -1) in its
        digest; `row_digest`: the digest of its row() sent at the confirmation, if any."""
        digest = row_digest
        if digest is None or len(self.misses):
            tier, slot = self.after
            hit = np.isin(self.plan.block_ids, self.misses)
            tier, slot = np.where(hit, int(Tier.NONE), tier), np.where(hit, -1, slot)
            digest = slot_map_digest(self.plan.block_ids, tier, slot)
        o = self.outcome
        return MoveResult(epoch=self.plan.epoch, rank=rank, moves_applied=self.moves_applied,
                          slot_map_digest=digest,
                          status=self.status & ~STATUS_MISSES,  # misses travel as ids
                          miss_block_ids=self.misses, bytes_h2d=o.bytes_h2d,
                          bytes_d2h=o.bytes_d2h, bytes_ssd_read=o.bytes_ssd_read,
                          bytes_ssd_write=o.bytes_ssd_write, elapsed_ns=o.elapsed_ns(),
                          spills_written_below=o.spills_written_below,
                          spill_write_bytes_per_s=o.spill_write_bytes_per_s)


@dataclass
class AppliedStep:
    """A StepResult applied on this rank, its confirmation possibly still in flight."""

    step: StepResult
    plans: list[AppliedPlan]
    pending: PendingConfirm | None = None
    # Its plans wait for Worker.apply_late (after the step's forward is launched); `late`
    # stays set once they are applied: the step is confirmed at the next one.
    waiting: bool = False
    late: bool = False


@dataclass
class StepReport:
    """A confirmed step: this rank's results, every rank's rows, and where they disagree."""

    step: StepResult
    results: list[MoveResult]  # this rank's, one per plan of the step
    gathered: np.ndarray  # [world, k, 4] rows of the k plans with moves (k may be 0)
    expected: np.ndarray  # [k, 4]
    mismatches: list[tuple[int, tuple[int, ...]]]  # (epoch, ranks)

    @property
    def any_misses(self) -> bool:
        return bool((self.gathered[..., 3] & STATUS_MISSES).any())

    def raise_if_mismatch(self) -> None:
        if self.mismatches:
            raise mismatch_error(self.gathered, self.expected, self.mismatches)
