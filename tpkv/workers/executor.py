"""PlanExecutor: the data movement of one plan on one rank (copy streams, SSD I/O, layer events)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers.chain import Chain
from tpkv.workers.copy_engine import CopyEngine, CopyHandle
from tpkv.workers.direct import DirectLoads
from tpkv.workers.layer_copies import LayerCopies
from tpkv.workers.mirror import Relocation
from tpkv.workers.outcome import ExecOutcome, blocked, spill_waits, wait_handle
from tpkv.workers.pieces import DemotionPieces
from tpkv.workers.reads import L3Reader, ReadJobs
from tpkv.workers.relocate import relocate_bytes
from tpkv.workers.rest import PlanRest
from tpkv.workers.spills import SpillTracker

HBM, DRAM, SSD = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
# The moves a plan's executor issues, by (source tier * 4 + destination tier)
_KINDS = {"d2h": HBM * 4 + DRAM, "h2d": DRAM * 4 + HBM, "spill": DRAM * 4 + SSD,
          "load": SSD * 4 + DRAM}


@dataclass
class _Deferred:
    """An L1 -> L2 batch applied (the maps say the blocks are in L2) but not yet issued: it
    goes out at flush(), after `after` (compute queued before it was applied) on the GPU."""

    src: np.ndarray  # L1 slots it reads
    dst: np.ndarray  # L2 slots it writes
    after: torch.cuda.Event | None
    prev_h2d: CopyHandle | None  # the L2 -> L1 batch before its plan (may read its L2 slots)
    out: ExecOutcome


# An L1 -> L2 batch goes out in pieces of this size, each with its own event: a copy into L1
# slots that a piece empties waits for that piece only, so a resume into a full L1 streams
# both ways at once instead of after the whole demotion.
DEMOTION_PIECE_BYTES = 64 << 20
# The pieces of demotions out of L1 slots their own plan's promotions fill (a resume into a
# full L1): a promotion into such a slot waits for its piece, so smaller pieces let the
# promotions follow sooner (each piece costs one more copy call, ~0.1 ms of host time).
REFILL_PIECE_BYTES = 16 << 20


def _among(mark: np.ndarray, slots: np.ndarray, among: np.ndarray) -> np.ndarray:
    """Mask of `slots` that are in `among`, through `mark`, a scratch mask over the pool's
    slots kept all False."""
    mark[among] = True
    out = mark[slots]
    mark[among] = False
    return out


class PlanExecutor:
    """Carries out plans through one rank's CopyEngine and SsdStore; never decides a move.

    Ordering across plans (within a plan no slot is both vacated and filled): an L2 -> L1 copy
    waits on the GPU for the newest piece of an L1 -> L2 batch still running that empties the
    L1 slot it fills or writes the L2 slot it reads (DemotionPieces), and for no other (so a
    resume into free slots runs beside the demotions that make room for the next one, and one
    into slots being emptied follows the pieces that empty them); compute that writes
    new K/V waits the same way for the demotions out of its fresh slots (`fence_compute`). An
    L1 -> L2 batch waits for the previous L2 -> L1 batch (L2 slots). On the host, SSD writes
    wait for the L1 -> L2 pieces that write their source slots, and SSD reads for the previous
    L2 -> L1 batch and the pieces that write the L2 slots they fill (a block dropped since), so
    a resume's reads run beside the demotion that makes its L1 room.

    Spills (L2 -> L3) run in the background (SpillTracker, `spills`): a plan returns once they
    are queued, and reports them done. Whatever would overwrite their L2 source slots (an
    L1 -> L2 batch, an L3 read) or needs their records (an L3 read or a drop of the session)
    first waits for them, bounded; one that fails deletes its session's L3 records (on every
    rank at TP > 1), so its blocks miss and are recomputed, never read back stale.
    """

    def __init__(self, engine: CopyEngine, store: SsdStore | None, timeout_s: float,
                 layer_events: bool = True, layer_chunk_bytes: int = 64 << 10,
                 defer_d2h: bool = False) -> None:
        """defer_d2h: a plan of demotions only is applied (reported done) but its copies wait
        for flush(), which a caller that launches its forward between applying plans calls once
        the forward is queued (TieredEngine.launched, through Worker.defer_demotions): their
        host time then runs beside the forward. Anything that could touch their slots first
        (a plan with other moves, fence_compute on their L1 slots, synchronize) flushes them.
        Off for callers without that hook: the copies are issued as the plan is applied."""
        self.engine = engine
        self.hbm, self.host = engine.hbm, engine.host
        self.store = store
        self.timeout_s = timeout_s
        self.layers = LayerCopies(engine, layer_events, layer_chunk_bytes)
        self.last: dict[str, CopyHandle | None] = {"h2d": None, "d2h": None}
        # L1 -> L2 pieces that may still run, and the slots they read and write
        self.demotions = DemotionPieces(self.hbm.num_slots, self.host.num_slots)
        self._l1_mark = np.zeros(self.hbm.num_slots, dtype=bool)  # scratch, kept all False
        self.spills = SpillTracker(store, self.host, timeout_s)
        self.reads = (L3Reader(store, self.host, self.hbm.block_bytes, timeout_s,
                               self.spills.await_manifest) if store is not None else None)
        # chained loads of blocks read ahead, copied from those buffers into L1 (direct.py)
        self.direct = DirectLoads(store, self.layers) if store is not None else None
        self.defer_d2h = defer_d2h  # see above; set only through Worker.defer_demotions
        self.deferred: list[_Deferred] = []
        # Set while plans applied after the forward was launched run (Worker.apply_late): an
        # event recorded before that forward, which their copies wait for instead of it.
        self.compute_mark: torch.cuda.Event | None = None
        # The next plan's L2 -> L1 moves issued during this plan's L3 reads (run's `chain`),
        # until that plan runs; and how many moves went so in all
        self.chained: Chain | None = None
        self.num_chained = 0

    # ---- one plan --------------------------------------------------------------------------
    def run(self, plan: MovePlan, ok: np.ndarray, later_l1: np.ndarray | None = None,
            chain: Chain | None = None) -> ExecOutcome:
        """Issue every move in `ok`; copies L1 <-> L2 may still run on return, SSD I/O is done
        (run_reads_later: the same, the wait for its L3 reads and what follows them apart).

        `later_l1`: the L1 slots the rest of the step fills (later plans' promotions, the
        step's new K/V), where the caller knows them. Demotions of a plan with promotions that
        empty none of them are for later steps: they start once the plan's promotions are
        done, so a resume's copies do not share the link with them.

        `chain`: the next plan's L2 -> L1 moves of blocks this plan loads from L3 (Chain), each
        issued once its block's read job is done; that plan's run() takes them as done."""
        return self._run(plan, ok, later_l1, chain).finish()

    def _run(self, plan: MovePlan, ok: np.ndarray, later_l1: np.ndarray | None = None,
             chain: Chain | None = None) -> PlanRest:
        """run() up to the wait for its L3 reads (submitted): what is left of it."""
        started = time.perf_counter_ns()
        out = ExecOutcome(done=np.zeros(plan.num_moves, dtype=bool))
        ahead = self._take_chained(plan, ok, out)
        deadline = time.monotonic() + self.timeout_s
        # One code per move, (src * 4 + dst); a move refused (not ok) or kept gets none of
        # the four below. Kept: L2 holds the block's bytes already; only the maps change.
        code = plan.src_tier * np.int8(4) + plan.dst_tier
        off = ~ok
        if ahead is not None:
            off[ahead] = True
        if plan.num_kept:
            kept = ok & plan.kept_mask()
            out.done[kept] = True
            off |= kept
        code[off] = -1
        pick = {k: np.flatnonzero(code == c) for k, c in _KINDS.items()}
        demotions_only = len(pick["d2h"]) + out.done.sum() == int(ok.sum())
        if self.deferred and not (self.defer_d2h and demotions_only):
            self.flush()
        prev_h2d = self.last["h2d"]
        block_bytes = self.hbm.block_bytes

        # A plan's moves touch disjoint slots (PlanBuilder), but for L1 slots its demotions
        # empty and its promotions fill (PlanBuilder.free_vacated). The promotions go first,
        # which a resume waits for: those into other slots, then those demotions (in pieces),
        # then the promotions into their slots, which wait for their pieces on the GPU (on the
        # CPU copies are done when issued). The other demotion pieces follow on their own
        # stream (a next plan's promotions into the slots they empty wait for each piece).
        up = pick["h2d"]
        refill = up[:0]
        if len(up) and len(i := pick["d2h"]):
            emptied = self._l1_among(plan.src_slot[i], plan.dst_slot[up])
            refill, pick["d2h"] = i[emptied], i[~emptied]
        if len(up):
            into = (self._l1_among(plan.dst_slot[up], plan.src_slot[refill]) if len(refill)
                    else None)
            start = self._promote(plan, up if into is None else up[~into], out)
            if into is not None:
                with spill_waits(out):
                    self.spills.wait(deadline, slots=plan.dst_slot[refill], finish=False)
                # in smaller pieces: the promotions into their slots start sooner
                self._demote(plan.src_slot[refill], plan.dst_slot[refill], prev_h2d, out,
                             piece_bytes=REFILL_PIECE_BYTES)
                out.done[refill], out.bytes_d2h = True, len(refill) * block_bytes
                second = self._promote(plan, up[into], out)
                start = second if start is None else start
            self._span(out, "h2d", start)
            out.done[up] = True
            out.bytes_h2d += len(up) * block_bytes
        if len(i := pick["d2h"]):
            with spill_waits(out):
                self.spills.wait(deadline, slots=plan.dst_slot[i], finish=False)
            src, dst = plan.src_slot[i], plan.dst_slot[i]
            if self.defer_d2h and demotions_only:
                after = self.compute_mark
                if after is None and self.engine.on_gpu:
                    after = torch.cuda.Event()
                    after.record(torch.cuda.current_stream(self.hbm.device))
                self.deferred.append(_Deferred(src, dst, after, prev_h2d, out))
            elif len(pick["h2d"]) and later_l1 is not None:
                # Those that empty a slot filled later in the step go now, beside this plan's
                # promotions; the rest wait for the promotions (which come after prev_h2d on
                # one stream), so that a resume's copies do not share the link with them.
                needed = self._l1_among(src, later_l1)
                if needed.any():
                    self._demote(src[needed], dst[needed], prev_h2d, out)
                if not needed.all():
                    self._demote(src[~needed], dst[~needed], self.last["h2d"], out)
            else:
                self._demote(src, dst, prev_h2d, out)
            out.done[i] = True
            out.bytes_d2h += len(i) * block_bytes
        # Spills already done: their manifests are committed (fsyncs: after the copies above
        # are issued, which a resume waits for; not the plan's own time).
        with blocked(out):
            self.spills.wait(deadline)
        jobs: ReadJobs = []
        self.spills.before_loads(plan, out, deadline)  # TP > 1: agreed before a load
        if chain is not None and len(chain.rows) and self.store is not None:
            chain.begin()
            self.chained = chain
        if self.reads is None:  # (no store)
            if len(pick["spill"]) or len(pick["load"]):
                out.error = f"epoch {plan.epoch}: moves to or from L3, but L3 is disabled here"
        elif len(i := pick["load"]):  # into L2 slots earlier batches may still read or fill
            with blocked(out):
                wait_handle(prev_h2d, deadline, f"epoch {plan.epoch} L3 -> L2")
                wait_handle(self.demotions.newest_writing(plan.dst_slot[i]), deadline,
                            f"epoch {plan.epoch} L3 -> L2")
            names = {plan.session_names[s] for s in set(plan.session_idx[i].tolist())}
            with spill_waits(out):
                self.spills.wait(deadline, slots=plan.dst_slot[i], names=names)
            if self.chained is not None and self.direct is not None and self.direct.usable:
                i = np.setdiff1d(i, self._load_direct(plan, i, self.chained, out),
                                 assume_unique=True)
            jobs += self.reads.submit(plan, i, deadline)
        return PlanRest(plan, jobs, deadline, partial(self._after_reads, plan, pick, jobs,
                                                      out, deadline, started,
                                                      self.chained))

    def run_reads_later(self, plan: MovePlan, ok: np.ndarray,
                        later_l1: np.ndarray | None = None) -> PlanRest:
        """run() up to its L3 reads, which go on on the store's threads; the PlanRest's finish()
        waits for them, does the rest (the spills, after the reads) and returns the outcome,
        whose time the rate meter does not sample (the wait for its reads began late). For
        the last plan of a step applied after its forward is launched (Worker.apply_late):
        reads from the read-ahead buffers into L2 that nothing of the step reads, whose wait
        held the step's host past its forward."""
        rest = self._run(plan, ok, later_l1)
        rest.later = True
        return rest

    def _after_reads(self, plan: MovePlan, pick: dict[str, np.ndarray], jobs: ReadJobs,
                     out: ExecOutcome, deadline: float, started: int, chained: Chain | None
                     ) -> ExecOutcome:
        """run()'s end: wait for the plan's L3 reads, then start its spills."""
        if self.reads is not None:
            self.reads.collect(plan, jobs, out, deadline,
                               None if chained is None else partial(self._issue_chained, chained))
        # Spills only after the plan's reads: a resume waits for its reads, never for the
        # spills (background writes) beside them, and the disk does not split its bandwidth
        # between the two (on the H200, reads beside a spill of the same size ran at 1.0 GB/s
        # against the disk's 1.75). The two touch other L2 slots (PlanBuilder).
        if self.store is not None and len(i := pick["spill"]):
            with blocked(out):  # (the pieces that write their source slots)
                wait_handle(self.demotions.newest_writing(plan.src_slot[i]), deadline,
                            f"epoch {plan.epoch} L2 -> L3")
            self.spills.submit(plan, i)
            out.done[i], out.bytes_ssd_write = True, len(i) * self.hbm.block_bytes
        self.spills.ran(plan)
        out.spills_written_below, out.spill_write_bytes_per_s = self.spills.progress()
        out.host_ns = time.perf_counter_ns() - started
        return out

    def _l1_among(self, slots: np.ndarray, among: np.ndarray) -> np.ndarray:
        """Mask of the L1 `slots` that are in `among` (a scratch mask over L1: no sort, as
        np.isin takes, ~0.1 ms on a resume's 700 moves on the CPU)."""
        return _among(self._l1_mark, slots, among)

    def _promote(self, plan: MovePlan, i: np.ndarray, out: ExecOutcome
                 ) -> torch.cuda.Event | None:
        """Issue the plan's L2 -> L1 moves `i` in groups by the demotion piece each must wait
        for (none first): a copy into slots a demotion is emptying starts once that piece is
        out, not all of it. Returns the start event of the first group (GPU)."""
        start = None
        if not len(i):
            return start
        for piece, rows in self.demotions.groups(plan.dst_slot[i], plan.src_slot[i]):
            mark = self._mark("h2d", piece)
            if start is None:
                start = mark
            self._h2d(plan.src_slot[i[rows]], plan.dst_slot[i[rows]])
            out.h2d_issued_ns = out.h2d_issued_ns or time.perf_counter_ns()
        return start

    def flush(self) -> None:
        """Issue the deferred L1 -> L2 batches, oldest first."""
        pending, self.deferred = self.deferred, []
        for d in pending:
            self._demote(d.src, d.dst, d.prev_h2d, d.out, d.after)

    def _demote(self, src: np.ndarray, dst: np.ndarray, prev_h2d: CopyHandle | None,
                out: ExecOutcome, after: torch.cuda.Event | None = None,
                piece_bytes: int = 0) -> None:
        """Issue an L1 -> L2 batch in pieces, each kept (with its slots) until it is done; after
        `prev_h2d` (the L2 -> L1 batch before its plan) and `after` (the compute it must follow;
        default: all compute queued now)."""
        start = self._mark("d2h", prev_h2d, after)
        step = max(1, (piece_bytes or DEMOTION_PIECE_BYTES) // self.hbm.block_bytes)
        handles = self.engine.d2h_pieces(src, dst, step, after)
        self.last["d2h"] = handles[-1]
        if self.engine.on_gpu:
            for k, handle in enumerate(handles):
                part = slice(k * step, (k + 1) * step)
                self.demotions.track(handle, src[part], dst[part])
        self._span(out, "d2h", start)

    def _mark(self, direction: str, prev: CopyHandle | None,
              after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Order `direction`'s stream after compute (all queued now, or `after`) and after the
        previous batch the other way; on the GPU return a timing event recorded there (the
        start of this batch)."""
        if not self.engine.on_gpu:
            return None
        stream = self.engine.streams[direction]
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.hbm.device))
        if prev is not None and prev.event is not None:
            stream.wait_event(prev.event)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def _span(self, out: ExecOutcome, direction: str, start: torch.cuda.Event | None) -> None:
        if start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record(self.engine.streams[direction])
            out.timing.append((direction, start, stop))

    def _issue_chained(self, chain: Chain, loaded: np.ndarray) -> None:
        """Issue the chain's moves whose blocks are loaded (with a hit) and not yet issued:
        after the demotion pieces emptying their L1 slots, as the next plan would."""
        ready = chain.ready(loaded)
        if not ready.any():
            return
        assert chain.out is not None
        start = self._promote(chain.plan, chain.rows[ready], chain.out)
        self._span(chain.out, "h2d", start)
        chain.mark_issued(ready)

    def _load_direct(self, plan: MovePlan, i: np.ndarray, chain: Chain, out: ExecOutcome
                     ) -> np.ndarray:
        """The loads `i` whose blocks the chain promotes and the read ahead holds: copied from
        the read-ahead buffers into their L1 slots now, then from L1 into their L2 slots as a
        demotion piece (DirectLoads). Returns those loads, done."""
        assert self.direct is not None and chain.out is not None
        got = self.direct.lease(plan, i, chain)
        if got is None:
            return i[:0]
        l1 = chain.plan.dst_slot[chain.rows[got.rows]]
        start = None
        for piece, part in self.demotions.groups(l1, np.full(len(l1), -1)):
            mark = self._mark("h2d", piece)
            start = mark if start is None else start
            self.last["h2d"] = self.layers.issue_from(
                got.addresses[part], [got.blocks[int(k)] for k in part] if got.blocks else [],
                l1[part])
        chain.out.h2d_issued_ns = chain.out.h2d_issued_ns or time.perf_counter_ns()
        self._span(chain.out, "h2d", start)
        issued = np.zeros(len(chain.rows), dtype=bool)
        issued[got.rows] = True
        chain.mark_issued(issued)
        h2d = self.last["h2d"]
        assert h2d is not None
        self._demote(l1, plan.dst_slot[got.loads], None, out, after=h2d.event)
        self.direct.hold(h2d, got.leases)
        out.done[got.loads] = True
        out.bytes_ssd_read += len(got.loads) * self.hbm.block_bytes
        return got.loads

    def _take_chained(self, plan: MovePlan, ok: np.ndarray, out: ExecOutcome
                      ) -> np.ndarray | None:
        """The moves of `plan` issued during the plan before's reads (Chain), now done here;
        a chain left for another plan (its step failed half-way) is dropped."""
        chain, self.chained = self.chained, None
        if chain is None or chain.plan is not plan:
            return None
        rows = chain.take(ok, out, self.hbm.block_bytes)
        if rows is not None:
            self.num_chained += len(rows)
        return rows

    # ---- background spills -----------------------------------------------------------------
    def wait_spills(self, deadline: float, names: set[str] | frozenset[str] = frozenset(),
                    every: bool = False) -> None:
        """Finish the spills of sessions in `names` (all with `every`), and those done
        (SpillTracker.wait)."""
        self.spills.wait(deadline, names=names, every=every)

    @property
    def commit_ns(self) -> int:
        """This thread's time making or awaiting manifest commits so far."""
        return self.spills.commit_ns

    # ---- copies ----------------------------------------------------------------------------
    def _h2d(self, host_slots: np.ndarray, hbm_slots: np.ndarray) -> None:
        self.last["h2d"] = self.layers.issue(host_slots, hbm_slots)

    # ---- what the engine waits on ----------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` of every block copied into L1 so far
        (LayerCopies.wait_layer)."""
        self.layers.wait_layer(layer)

    def fence_compute(self, fresh_l1_slots: np.ndarray) -> None:
        """Make the current stream wait for the L1 -> L2 batches that empty any of the L1 slots
        the engine writes new K/V into (the step's fresh slots); no wait when none does.
        Deferred batches that read one of them go out first."""
        fresh = np.asarray(fresh_l1_slots, dtype=np.int64)
        if any(self._l1_among(d.src, fresh).any() for d in self.deferred):
            self.flush()
        handle = self.demotions.newest_into(fresh_l1_slots, None)
        if handle is not None and handle.event is not None:
            torch.cuda.current_stream(self.hbm.device).wait_event(handle.event)

    def synchronize(self) -> None:
        """Wait on the host for every copy (deferred ones issued first) and background spill
        (bounded)."""
        self.flush()
        deadline = time.monotonic() + self.timeout_s
        for direction, handle in self.last.items():
            wait_handle(handle, deadline, f"synchronize {direction}")
        if self.direct is not None:
            self.direct.drain()
        self.spills.wait(deadline, every=True)

    # ---- resync ----------------------------------------------------------------------------
    def relocate(self, rel: Relocation) -> np.ndarray:
        """Move bytes so this rank matches the controller's table after a resync (every copy
        and spill done first; relocate_bytes). Returns the ids of blocks this rank holds
        nowhere (lost here; their bytes are zeros)."""
        self.synchronize()
        return relocate_bytes(self.engine, self.store, self.spills.commit, rel, self.timeout_s)
