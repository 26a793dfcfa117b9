"""Epochs: plans sent and not yet confirmed, commits, resyncs, and what the next step carries."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.controller.builder import PlanBuilder, group_sorted
from tpkv.controller.sessions import SessionTable, add_counts
from tpkv.controller.table import DRAM, SSD, BlockTable
from tpkv.errors import ArgumentTypeError, BadRequestError, PlanOrderError
from tpkv.limits import check_count, check_counts
from tpkv.protocol.digest import plan_digest, slot_map_digest
from tpkv.protocol.messages import CommitOutcome
from tpkv.protocol.plan import MovePlan, MoveResult, Tier


@dataclass
class PendingPlan:
    plan: MovePlan
    rows: np.ndarray  # table rows it moved (ids in plan.block_ids tell if a row was reused)


def _checked(results: object) -> list[MoveResult]:
    """The reports as a list of MoveResults with integer fields (ArgumentTypeError if not)."""
    if not isinstance(results, (Sequence, np.ndarray)) or isinstance(results, (str, bytes)):
        raise ArgumentTypeError(f"results must be a list of MoveResult, got "
                                f"{type(results).__name__}")
    out = list(results)
    for i, r in enumerate(out):
        if not isinstance(r, MoveResult):
            raise ArgumentTypeError(f"results[{i}] must be a MoveResult, got {type(r).__name__}")
        for name in ("epoch", "rank", "status", "slot_map_digest", "spills_written_below",
                     "spill_write_bytes_per_s"):
            check_count(f"results[{i}].{name}", getattr(r, name), (1 << 64) - 1, "uint64",
                        low=-(1 << 63))
        check_counts(f"results[{i}].miss_block_ids", r.miss_block_ids, (1 << 63) - 1, "int64")
    return out


class Epochs:
    """The plans handed to the ranks and not confirmed yet (oldest first), the epochs numbered
    so far, and the outbox: what happened since the last step (blocks released by closed
    sessions, blocks lost, sessions closed, L3 segments to delete), sent with the next step.

    Invariant: the pending plans' epochs run committed_epoch + 1 .. next_epoch - 1, in order;
    a block is in flight (BlockTable.in_flight) only while a pending plan moves it. The table
    and sessions are the controller's, passed in to each method that changes them."""

    def __init__(self) -> None:
        self.next_epoch = 1
        self.committed_epoch = 0
        self.pending: deque[PendingPlan] = deque()
        self.released: list[np.ndarray] = []  # block ids of closed sessions
        self.lost: list[np.ndarray] = []  # block ids that became Tier.NONE
        self.closed: list[str] = []
        self.ssd_dropped: list[str] = []  # sessions whose L3 files go with the next step
        # Sessions whose last L3 block moved up in the last step: their files are deleted with
        # the next step (see outbox).
        self.l3_emptied: list[str] = []

    # ---- plans out -------------------------------------------------------------------------
    def hand_out(self, b: PlanBuilder) -> None:
        """The builder's plans not handed out yet are pending (sent to the ranks) from now on."""
        for plan, rows in zip(b.plans[b.handed:], b.plan_rows[b.handed:]):
            self.pending.append(PendingPlan(plan, rows))
        b.handed = len(b.plans)
        self.next_epoch = b.epoch

    def has_news(self) -> bool:
        """Blocks released or lost since the last step (the ranks apply them first)."""
        return bool(self.released or self.lost)

    def note_closed(self, session_id: str, block_ids: np.ndarray) -> None:
        """A session was closed: its blocks and name go out with the next step."""
        self.released.append(block_ids)
        self.closed.append(session_id)

    def in_flight_rows(self) -> np.ndarray:
        """Every table row a pending plan moves (rows reused since included)."""
        if not self.pending:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([p.rows for p in self.pending])

    def outbox(self, T: BlockTable, S: SessionTable, b: PlanBuilder,
               drops: list[np.ndarray]) -> dict[str, Any]:
        """A step's plans and drops with what happened since the last step (closed sessions,
        lost blocks, L3 files to delete); empties the outbox."""
        if self.lost:
            lost = np.concatenate(self.lost)
            lost = lost[T.rows_of(lost)[1]]  # not those of sessions closed since
            drops[0] = np.concatenate([lost, drops[0]]).astype(np.int64)
        ssd_dropped = self.ssd_dropped + [S.name(s) for s in b.ssd_dropped]
        # A session whose last L3 block moved up in the previous step has its files deleted now,
        # not then: another rank may still be reading them in that step, and its read needs the
        # session's manifest; every rank has applied (and confirmed) that step before it
        # applies this one. Not if blocks of it went back to L3 since (or it was closed).
        for name in self.l3_emptied:
            s = S.index.get(name)
            if s is not None and S.counts[SSD + 1][s] == 0 and name not in ssd_dropped:
                ssd_dropped.append(name)
        self.l3_emptied = [S.name(s) for s in b.emptied_l3()]
        released = self.released
        out = {"plans": tuple(b.plans), "drops": tuple(drops),
               "released_block_ids": (np.concatenate(released) if released
                                      else np.zeros(0, dtype=np.int64)),
               "closed_sessions": tuple(self.closed),
               "ssd_dropped_sessions": tuple(ssd_dropped),
               "l2_room": T.pace.intake_room(T.free[DRAM], T.num_kept)}
        self.released, self.lost = [], []
        self.closed, self.ssd_dropped = [], []
        T.end_l3_step(len(self.l3_emptied))
        return out

    # ---- confirmations ---------------------------------------------------------------------
    def commit(self, T: BlockTable, S: SessionTable, results: Sequence[MoveResult],
               tp_size: int) -> CommitOutcome:
        """All ranks' reports for the oldest unconfirmed epoch. Misses become Tier.NONE."""
        results = _checked(results)
        epochs = sorted({int(r.epoch) for r in results})
        if len(epochs) != 1:
            raise BadRequestError(f"one epoch per commit, got reports for epochs {epochs}")
        epoch = epochs[0]
        if not self.pending:
            raise PlanOrderError(f"epoch {epoch} confirmed, but no plan awaits confirmation "
                                 f"(last committed {self.committed_epoch})")
        head = self.pending[0]
        if epoch != head.plan.epoch:
            raise PlanOrderError(f"epoch {epoch} confirmed out of order: epoch "
                                 f"{head.plan.epoch} is next ({len(self.pending)} pending, "
                                 f"latest {self.pending[-1].plan.epoch})")
        ranks = sorted(int(r.rank) for r in results)
        if ranks != list(range(tp_size)):
            raise BadRequestError(f"epoch {epoch}: reports from ranks {ranks}, need one from "
                                  f"each of 0..{tp_size - 1}")
        misses = np.concatenate([np.asarray(r.miss_block_ids, dtype=np.int64).reshape(-1)
                                 for r in results])
        if len(misses):
            misses = np.unique(misses)
        stray = misses[~np.isin(misses, head.plan.block_ids)] if len(misses) else misses
        if len(stray):
            raise BadRequestError(f"epoch {epoch}: {len(stray)} reported misses are not in the "
                                  f"plan, e.g. block {int(stray[0])}")
        bad = tuple(int(r.rank) for r in results
                    if r.status != 0 or r.slot_map_digest != plan_digest(head.plan,
                                                                        r.miss_block_ids))
        num_misses = self.lose(T, S, misses)
        self.pending.popleft()
        later = [p.rows for p in self.pending]
        rows, alive = T.rows_of(head.plan.block_ids)
        done = rows[alive]
        if later and len(done):
            done = done[~np.isin(done, np.concatenate(later))]
        T.in_flight[done] = 0
        self.committed_epoch = epoch
        T.pace.written(T.free[Tier.DRAM], min(int(r.spills_written_below) for r in results),
                       min(int(r.spill_write_bytes_per_s) for r in results))
        return CommitOutcome(epoch, not bad, bad, num_misses, plan_digest(head.plan), bool(bad))

    def lose(self, T: BlockTable, S: SessionTable, block_ids: np.ndarray) -> int:
        """Blocks whose only copy failed: Tier.NONE, slot freed, recomputed when next needed."""
        rows, ok = T.rows_of(block_ids)
        rows = rows[ok]
        rows = rows[T.tier[rows] != Tier.NONE]
        if len(rows) == 0:
            return 0
        old, _ = T.set_tier(rows, Tier.NONE, np.full(len(rows), -1, dtype=np.int32),
                            free_src=True, dead=S.l3_other)
        sess = T.session[rows].astype(np.int64)
        S.dirty[sess] = True
        add_counts(S.counts, S.count_keys(old.astype(np.int64) + 1, sess), -1)
        add_counts(S.counts, S.count_keys(0, sess), 1)
        self.lost.append(T.ids(rows))
        return len(rows)

    def slot_map(self, T: BlockTable, S: SessionTable, tick: int) -> dict[str, Any]:
        """The authoritative map of every live block (for resync and for tests)."""
        rows = np.flatnonzero(T.session >= 0)
        uniq, local = group_sorted(T.session[rows])
        out: dict[str, Any] = {
            "epoch": self.next_epoch - 1, "tick": tick, "block_ids": T.ids(rows),
            "tiers": T.tier[rows].astype(np.int8), "slots": T.slot[rows].astype(np.int64),
            "session_idx": local.astype(np.int32),
            "logical_idx": T.logical[rows].astype(np.int64),
            "session_names": [S.name(int(i)) for i in uniq],
            "session_tokens": {S.name(int(i)): int(S.tokens[i]) for i in uniq}}
        out["digest"] = slot_map_digest(out["block_ids"], out["tiers"], out["slots"])
        return out

    def resync(self, T: BlockTable, S: SessionTable, tick: int) -> dict[str, Any]:
        """After a mismatch: the full map for workers to restore; pending plans are superseded."""
        out = self.slot_map(T, S, tick)
        T.clear_kept()  # what a rank's L2 slots hold is no longer vouched for
        T.l3copy[:] = 0  # nor its L3 records (they stay, as dead room, until they go)
        self.pending.clear()
        T.in_flight[:] = 0
        self.committed_epoch = self.next_epoch - 1
        self.released, self.lost = [], []
        return out

    def restart(self, next_epoch: int, ssd_dropped: list[str]) -> None:
        """A rebuilt table: nothing pending, epochs go on from `next_epoch`; `ssd_dropped`: the
        segments the rebuild gave up (deleted with the first step)."""
        self.pending.clear()
        self.next_epoch = next_epoch
        self.committed_epoch = next_epoch - 1
        self.ssd_dropped = ssd_dropped
        self.l3_emptied = []  # rebuilt from the files as they are
