"""Worker: one TP rank applies the controller's plans in epoch order; the TP group confirms them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from tpkv.config import TpkvConfig
from tpkv.errors import PlanOrderError
from tpkv.protocol.digest import plan_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MovePlan, MoveResult, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers import cuda_rt, kernels
from tpkv.workers.agreement import SpillLedger
from tpkv.workers.applied import NO_IDS, AppliedPlan, AppliedStep, StepReport
from tpkv.workers.chain import Chain, find_chain
from tpkv.workers.confirm import (
    NO_REPORT,
    ROW,
    STATUS_DIVERGED,
    STATUS_FAILED,
    STATUS_MISSES,
    BoundedGroup,
    Confirmer,
    PendingConfirm,
    disagreements,
)
from tpkv.workers.copy_engine import CopyEngine
from tpkv.workers.executor import PlanExecutor
from tpkv.workers.mirror import HBM, SlotMirror
from tpkv.workers.outcome import ExecOutcome
from tpkv.workers.pools import HbmPool, HostPool
from tpkv.workers.reads import plan_sessions
from tpkv.workers.rest import PlanRest
from tpkv.workers.returning import ReturningReads

log = logging.getLogger(__name__)


class Worker:
    """One rank's tiers (L1 pool, L2 pool, L3 store), its slot map and the plan loop.

    Decides nothing: a move that does not start where this rank's map says is refused and
    reported (status DIVERGED), which the all-gather turns into a PlanMismatchError.
    """

    def __init__(self, config: TpkvConfig, rank: int, device: torch.device | str | None = None,
                 group: BoundedGroup | None = None) -> None:
        g = config.geometry
        self.config, self.rank = config, rank
        self.hbm = HbmPool(g, config.l1.slots(g), device)
        self.host = HostPool(g, config.l2.slots_per_rank(g), config.l2)
        kernels.warm()  # the plan check and the copy descriptors, compiled before serving
        self.engine = CopyEngine(self.hbm, self.host)
        self.store = (SsdStore(config.l3, g, config.model_fingerprint, rank)
                      if config.l3.enabled else None)
        self.executor = PlanExecutor(self.engine, self.store, config.wait_timeout_s,
                                     config.layer_events, config.layer_chunk_bytes)
        if self.store is not None and self.engine.on_gpu:  # read ahead straight into L1
            self.store.ahead.pin_with(cuda_rt.host_register, cuda_rt.host_unregister)
        self.mirror = SlotMirror(self.hbm.slots, self.host.slots)
        # returning sessions' L3 blocks read ahead (models/returns.py decides which)
        self.returning = ReturningReads(self.store, self.mirror, self.executor.spills)
        self.confirmer = Confirmer(group) if group is not None and group.world_size > 1 else None
        self.world_size = group.world_size if group is not None else 1
        if self.confirmer is not None and self.store is not None:
            # a spill that fails on one rank is forgotten on every rank (SpillLedger)
            self.executor.spills.join_group(SpillLedger(), self._agree_loads)
        self.epoch = 0  # last plan applied
        self.last_applied: list[AppliedPlan] = []  # the plans of the last step, as applied here
        self.tick = 0
        self.fault_skip: dict[int, int] = {}  # tests: epoch -> index of a move to skip silently
        self.fault_miss_from: int | None = None  # tests: first L3 read from this epoch misses
        self.late: AppliedStep | None = None  # a step whose plans wait (apply_step's late_ok)
        self.num_late = 0  # steps whose plans waited so
        # a late step's last plan, its L3 reads still running, with what records its outcome
        # here (apply_late); and that step, confirmed once the plan is recorded
        self._rest: tuple[PlanRest, Callable[[ExecOutcome], AppliedPlan]] | None = None
        self._rest_step: AppliedStep | None = None
        self.num_reads_later = 0  # late plans whose reads were waited for at the next call
        # compute queued before the last step's forward (late_ok): what plans applied after
        # that forward was launched (apply_late) wait for instead of it
        self._step_mark: torch.cuda.Event | None = None

    # ---- the step loop ---------------------------------------------------------------------
    def apply_step(self, step: StepResult, late_ok: bool = False) -> AppliedStep:
        """Apply a step in the documented order; start its confirmation; return at once.

        With `late_ok`, a step whose plans move only blocks of sessions outside its batch
        (`_may_wait`: the watermarks' demotions and spills, the prefetch of the turns next in
        line) gets its new blocks at once but its plans later: at apply_late(), which the
        engine calls once the step's forward is launched (the plans' host time then runs
        beside the forward), or at the next call that needs this rank's map whole. Nothing
        the step's forward reads or writes depends on them."""
        self.apply_late()
        if self.executor.direct is not None:  # read-ahead buffers whose copies are done
            self.executor.direct.reap()
        if late_ok and self.executor.engine.on_gpu:
            self._step_mark = torch.cuda.Event()
            self._step_mark.record(torch.cuda.current_stream(self.hbm.device))
        if late_ok and self._may_wait(step):
            self.mirror.release(step.released_block_ids)
            lost = self._add_fresh(step)
            if not len(lost):  # as expected: the plans can wait
                self._after_plans(step)
                self.last_applied = []
                self.num_late += 1
                self.late = AppliedStep(step, [], None, waiting=True, late=True)
                return self.late
            applied = self._apply_plans(step)  # this rank held blocks in those slots
        else:
            self.mirror.release(step.released_block_ids)
            applied = self._apply_plans(step)
            lost = self._add_fresh(step)
        self._note_lost(applied, lost)
        self._after_plans(step)
        return self._confirm(AppliedStep(step, applied, None))

    def apply_late(self) -> None:
        """Apply the plans of a step applied with late_ok, if they still wait, and start its
        confirmation (finish() collects it as any other). At TP 1 the wait for its last
        plan's L3 reads (blocks read ahead, copied into L2 on the store's threads) and the
        rest of that plan are left to the next call (the next step's begin, or any call that
        needs this rank's map whole): nothing of the step reads those blocks, and the wait
        held the step's host past its forward (decode steps that staged such blocks took 13
        ms against 7.6 for quiet ones on the H200, bench/e2e.py (c2-em14))."""
        if self.late is None:
            self._end_rest()
            return
        late, self.late = self.late, None
        late.plans = self._apply_plans_after_mark(late.step)
        late.waiting = False
        if self._rest is not None:
            self._rest_step = late
        else:
            self._confirm(late)

    def _end_rest(self) -> None:
        """The late step's last plan once its reads are done (apply_late), then the step's
        confirmation."""
        if self._rest is None:
            return
        (rest, record), late = self._rest, self._rest_step
        assert late is not None  # (apply_late sets both)
        self._rest = self._rest_step = None
        late.plans.append(record(rest.finish()))
        self.last_applied = late.plans
        self._confirm(late)

    def _apply_plans_after_mark(self, step: StepResult) -> list[AppliedPlan]:
        """_apply_plans once the step's forward is launched: its copies wait for the compute
        queued before that forward (the step mark), not for the forward; its last plan's
        reads from L3 are waited for later (apply_late)."""
        self.executor.compute_mark = self._step_mark
        try:
            return self._apply_plans(step, reads_later=self.world_size == 1)
        finally:
            self.executor.compute_mark = None

    def _may_wait(self, step: StepResult) -> bool:
        """Whether the step's plans may wait until its forward is launched: they move only
        blocks of sessions outside its batch (watermark demotions and spills, and prefetch of
        the turns next in line), drop nothing, take no L1 slot the step's new K/V fills, and
        read from L3 only at TP 1 and only records this rank holds read ahead (a copy from
        memory, not a disk read while the host should be launching the next step)."""
        if not any(p.num_moves for p in step.plans) or any(len(d) for d in step.drops):
            return False
        # sessions the step's forward uses, or whose L3 records it closes or drops
        keep = {*step.session_ids, *step.closed_sessions, *step.ssd_dropped_sessions}
        fresh = np.sort(np.asarray(step.fresh_slots, dtype=np.int64))
        for plan in step.plans:
            if not plan.num_moves:
                continue
            if not keep.isdisjoint(plan.session_names):
                return False
            down = plan.mask(Tier.HBM, Tier.DRAM)  # out of L1 slots
            up = plan.mask(Tier.DRAM, Tier.HBM)  # into L1 slots
            if bool(np.isin(plan.src_slot[down], fresh).any()) or bool(
                    np.isin(plan.dst_slot[up], fresh).any()):
                return False
            # L3 reads wait only at TP 1, from what the rank holds read ahead: at TP > 1 a load
            # may agree on spills with the group (_agree_loads, a collective), so every rank
            # must take the same choice from the step alone, and read ahead differs by rank
            reads = plan.mask(Tier.SSD, Tier.DRAM)
            if reads.any() and (self.world_size > 1 or not all(
                    self.returning.done(name) for name in plan_sessions(plan, reads))):
                return False
        return True

    def _apply_plans(self, step: StepResult, reads_later: bool = False) -> list[AppliedPlan]:
        """The step's plans and drops in order. `reads_later`: a last plan that reads from L3
        is left running (`_rest`: apply_late)."""
        applied = []
        # Per plan: the L1 slots the rest of the step fills (see PlanExecutor.run).
        later = [np.asarray(step.fresh_slots, dtype=np.int64)]
        for plan in reversed(step.plans[1:]):
            later.append(np.concatenate([later[-1],
                                         plan.dst_slot[plan.mask(Tier.DRAM, Tier.HBM)]]))
        for i, plan in enumerate(step.plans):
            drops = step.drops[i] if i < len(step.drops) else NO_IDS
            self.mirror.drop(drops)
            nxt = step.plans[i + 1] if i + 1 < len(step.plans) else None
            if reads_later and nxt is None and plan.mask(Tier.SSD, Tier.DRAM).any():
                ok, refused, skip, _ = self._check_plan(plan, None)
                self._rest = (self.executor.run_reads_later(plan, ok, later[0]),
                              partial(self._record, plan, refused, skip))
                self.num_reads_later += 1
                break
            then = None
            if nxt is not None:
                then = (nxt, step.drops[i + 1] if i + 1 < len(step.drops) else NO_IDS)
            applied.append(self.apply_plan(plan, later[len(step.plans) - 1 - i], then=then))
        self.mirror.drop(step.drops[-1] if step.drops else NO_IDS)
        self.last_applied = applied
        return applied

    def _add_fresh(self, step: StepResult) -> np.ndarray:
        names = [step.session_ids[i] for i in step.fresh_session_idx.tolist()]
        return self.mirror.add_fresh(step.fresh_block_ids, step.fresh_slots, names,
                                     step.fresh_logical)

    def _after_plans(self, step: StepResult) -> None:
        """What follows the plans and the new blocks: tokens, closed sessions, the fence."""
        self.mirror.tokens.update(zip(step.session_ids, step.num_tokens.tolist()))
        for name in step.closed_sessions:
            self.mirror.tokens.pop(name, None)
        if self.store is not None:  # their L3 records are of no more use
            gone = (*step.closed_sessions, *step.ssd_dropped_sessions)
            if gone:
                self.executor.spills.abandon(set(gone))  # (no wait for their writes)
            for name in gone:  # in the background: later calls about them wait for it
                self.store.drop_session_later(name)
            if self.executor.spills.ledger is not None:
                self.executor.spills.ledger.closed(gone)
        self.executor.fence_compute(step.fresh_slots)
        self.tick = step.tick

    def _confirm(self, applied: AppliedStep) -> AppliedStep:
        """Start the step's confirmation (none without moves)."""
        with_moves = [a for a in applied.plans if a.plan.num_moves]
        if with_moves:  # digests and the all-gather run on the confirmation thread
            def rows() -> tuple[np.ndarray, np.ndarray]:
                return (np.asarray([a.row() for a in with_moves], dtype=np.int64),
                        np.asarray([[a.plan.epoch, a.plan.num_moves, plan_digest(a.plan), 0]
                                    for a in with_moves], dtype=np.int64))
            applied.pending = (self.confirmer.start(rows, self._report()) if self.confirmer
                               else PendingConfirm.local(rows))
        return applied

    def _report(self) -> tuple[bytes, int]:
        """What this confirmation tells the other ranks of its spills (SpillLedger)."""
        spills = self.executor.spills
        return spills.report() if spills.ledger is not None else NO_REPORT

    def _agree_loads(self, names: set[str], deadline: float) -> None:
        """SpillTracker.agree: every rank has finished its spills of `names`, which a plan is
        about to load; agree now on the sessions some rank forgot (one all-gather through the
        confirmation thread, in order with the confirmations, so bounded and in the same order
        on every rank), and forget them here: their loads miss instead of waiting."""
        ledger = self.executor.spills.ledger
        assert self.confirmer is not None and ledger is not None
        empty = np.zeros((0, ROW), dtype=np.int64)
        pending = self.confirmer.start(lambda: (empty, empty), self._report())
        self.confirmer.wait(pending)
        ledger.num_agreements += 1
        self.executor.spills.settle(pending.forgotten, pending.settled, deadline, loaded=names)

    def apply_plan(self, plan: MovePlan, later_l1: np.ndarray | None = None,
                   then: tuple[MovePlan, np.ndarray] | None = None) -> AppliedPlan:
        """Check epoch order, apply the moves this rank's map allows, record them. `later_l1`:
        the L1 slots later plans of the step and its new K/V fill (PlanExecutor.run); `then`:
        the step's next plan and
        the drops applied before it, whose L2 -> L1 moves of blocks this plan loads from L3
        may go during this plan's reads (find_chain)."""
        ok, refused, skip, chain = self._check_plan(plan, then)
        return self._record(plan, refused, skip,
                            self.executor.run(plan, ok, later_l1, chain=chain))

    def _check_plan(self, plan: MovePlan, then: tuple[MovePlan, np.ndarray] | None
                    ) -> tuple[np.ndarray, int, int | None, Chain | None]:
        """apply_plan's checks: (the moves this rank's map allows, how many it refuses, the
        move a test skips, the next plan's moves that may go during this one's reads)."""
        if plan.epoch != self.epoch + 1:
            raise PlanOrderError(f"rank {self.rank}: plan {plan.epoch} arrived after plan "
                                 f"{self.epoch}; plans apply strictly in epoch order")
        ok = self.mirror.check(plan)
        self._refused_ahead(plan, ok)
        refused = int((~ok).sum())
        if refused:
            log.error("rank %d: plan %d: %d of %d moves do not start where this rank's map says",
                      self.rank, plan.epoch, refused, plan.num_moves)
        skip = self.fault_skip.pop(plan.epoch, None)
        if skip is not None and plan.num_moves:
            ok[skip % plan.num_moves] = False  # an unknown bug: counted as applied below
        # A step's L2 -> L1 moves of blocks its plan before loads from L3 go as each read
        # job is done (find_chain), not after all of them
        chain = (find_chain(plan, ok, *then, self.mirror, self.hbm.num_slots)
                 if then is not None and plan.epoch + 1 not in self.fault_skip else None)
        return ok, refused, skip, chain

    def _record(self, plan: MovePlan, refused: int, skip: int | None, outcome: ExecOutcome
                ) -> AppliedPlan:
        """apply_plan's end: the plan's outcome into this rank's map, as an AppliedPlan."""
        if self.fault_miss_from is not None and plan.epoch >= self.fault_miss_from:
            self._inject_miss(plan, outcome)
        self.mirror.apply(plan, outcome.done)
        self.epoch = plan.epoch
        self.returning.staged(plan)
        status = ((STATUS_DIVERGED if refused else 0) | (STATUS_FAILED if outcome.error else 0)
                  | (STATUS_MISSES if len(outcome.misses) else 0))
        applied = int(outcome.done.sum()) + (1 if skip is not None and plan.num_moves else 0)
        return AppliedPlan(plan, outcome, applied, self.mirror.where(plan.block_ids), status,
                           outcome.misses)

    def _refused_ahead(self, plan: MovePlan, ok: np.ndarray) -> None:
        """Moves of `plan` issued during the plan before's reads (find_chain) that this rank's
        check refuses now (never expected: find_chain takes only moves the check passes):
        their copies wrote L1 slots this map may give to other blocks, which are lost here."""
        chain = self.executor.chained
        if chain is None or chain.plan is not plan:
            return
        rows = chain.issued_rows()
        bad = rows[~ok[rows]]
        if not len(bad):
            return
        held = self.mirror.holder(HBM, plan.dst_slot[bad])
        held = held[held >= 0]
        log.error("rank %d: plan %d: %d moves issued ahead are refused by the check; %d blocks in "
                  "their L1 slots are lost here", self.rank, plan.epoch, len(bad), len(held))
        self.mirror.drop(held)

    def finish(self, applied: AppliedStep) -> StepReport:
        """Wait (bounded) for the step's confirmation; report where ranks disagree."""
        self.apply_late()
        p = applied.pending
        gathered: np.ndarray | None = np.zeros((self.world_size, 0, ROW), dtype=np.int64)
        expected = np.zeros((0, ROW), dtype=np.int64)
        own: dict[int, int] = {}  # epoch -> this rank's row digest
        if p is not None:
            gathered = self.confirmer.wait(p) if self.confirmer else p.gathered
            expected = p.expected
            if self.executor.spills.ledger is not None:  # sessions some rank forgot: here too
                self.executor.spills.settle(p.forgotten, p.settled,
                                            time.monotonic() + self.config.wait_timeout_s)
            own = {int(e): int(d) for e, d in zip(p.rows[:, 0], p.rows[:, 2])}
        assert gathered is not None
        results = [a.result(self.rank, own.get(a.plan.epoch)) for a in applied.plans]
        return StepReport(applied.step, results, gathered, expected,
                          disagreements(gathered, expected))

    def confirm(self, applied: AppliedStep) -> list[MoveResult]:
        """finish(), raising RankMismatchError (a PlanMismatchError) if the ranks disagree."""
        report = self.finish(applied)
        report.raise_if_mismatch()
        return report.results

    # ---- what the engine waits on ----------------------------------------------------------
    def defer_demotions(self) -> None:
        """For a caller that calls `executor.flush()` once it has launched each step's forward
        (TieredEngine does, from its `launched` hook): from now on a plan of demotions only is
        applied at once but its copies are issued at that flush (PlanExecutor's defer_d2h).
        Other callers leave it off; their demotions are issued as their plans are applied."""
        self.executor.defer_d2h = True

    def wait_layer(self, layer: int) -> None:
        """Attention on `layer` waits for that layer of every block brought into L1 (no host
        wait on the GPU; nothing to wait for on the CPU)."""
        self.executor.wait_layer(layer)

    def wait_all(self) -> None:
        self.executor.wait_layer(self.hbm.geometry.num_layers - 1)

    # ---- the slot map ----------------------------------------------------------------------
    def slot_map(self) -> dict[str, Any]:
        """This rank's map in the form Controller.rebuild takes (and slot_map() gives)."""
        self.apply_late()
        out = self.mirror.export()
        out.update(rank=self.rank, epoch=self.epoch, tick=self.tick)
        return out

    def resync(self, slot_map: dict[str, Any]) -> np.ndarray:
        """Take the controller's map; move bytes this rank holds elsewhere to where it says.
        Returns the ids of blocks this rank could not restore (their bytes are zeros here)."""
        self.apply_late()  # the map has their moves: none may come after it
        relocation = self.mirror.restore(slot_map)
        self.epoch = int(slot_map["epoch"])
        self.tick = int(slot_map.get("tick", self.tick))
        log.warning("rank %d: resync to epoch %d; %d blocks move here", self.rank, self.epoch,
                    relocation.num_blocks)
        return self.executor.relocate(relocation)

    def close(self) -> None:
        # Plans still waiting are not applied: that would start a confirmation (a collective)
        # while closing, perhaps after a failure; the blocks' bytes stay where they are. A
        # late plan's reads into L2 are waited for (L2 goes below), nothing else of it done.
        self.late = None
        if self._rest is not None:
            self._rest[0].settle()
            self._rest = self._rest_step = None
        if self.confirmer is not None:
            self.confirmer.close()
        self.executor.synchronize()
        if self.store is not None:
            self.store.close()
        self.host.close(background=True)  # a restart need not wait for L2's release

    # ---- internals -------------------------------------------------------------------------
    def _note_lost(self, applied: list[AppliedPlan], lost: np.ndarray) -> None:
        """Blocks overwritten here are reported as misses of the latest plan of the step that
        moved them (the controller then drops them); others can only be logged."""
        for a in reversed(applied if len(lost) else ()):
            hit = lost[np.isin(lost, a.plan.block_ids)]
            if len(hit):
                a.misses = np.union1d(a.misses, hit)
                lost = lost[~np.isin(lost, hit)]
        for a in applied:
            if len(a.misses):
                a.status |= STATUS_MISSES
        if len(lost):
            log.error("rank %d: %d blocks lost here outside this step's plans (e.g. %d)",
                      self.rank, len(lost), int(lost[0]))

    def _inject_miss(self, plan: MovePlan, outcome: ExecOutcome) -> None:
        """Tests: the first L3 read done from `fault_miss_from` on reads as a miss here."""
        loads = np.flatnonzero(outcome.done & plan.mask(Tier.SSD, Tier.DRAM))
        if len(loads):
            i = int(loads[0])
            self.host.block_bytes_view(int(plan.dst_slot[i])).fill(0)
            outcome.misses = np.union1d(outcome.misses, plan.block_ids[i:i + 1])
            self.fault_miss_from = None
