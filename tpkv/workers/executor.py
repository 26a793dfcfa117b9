"""PlanExecutor: the data movement of one plan on one rank (copy streams, SSD I/O, layer events)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpkv.errors import SsdError, TierFullError, WaitTimeoutError
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers import cuda_rt
from tpkv.workers.agreement import SpillLedger
from tpkv.workers.copy_engine import CopyEngine, CopyHandle
from tpkv.workers.mirror import Relocation

log = logging.getLogger(__name__)

HBM, DRAM, SSD, NONE = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD), int(Tier.NONE)
# The moves a plan's executor issues, by (source tier * 4 + destination tier)
_KINDS = {"d2h": HBM * 4 + DRAM, "h2d": DRAM * 4 + HBM, "spill": DRAM * 4 + SSD,
          "load": SSD * 4 + DRAM}
_POLL_S = 0.0001
_POLL_FINE_S = 0.05


@dataclass
class _Spill:
    """An L2 -> L3 write still running: its L2 source slots must not be refilled before it ends."""

    name: str
    epoch: int
    slots: np.ndarray  # L2 slots it reads
    future: Future[Any]


@dataclass
class _Commit:
    """A session's manifest commit running on the store's commit thread:
    its L3 records are read, or its files deleted, only once it is done."""

    name: str
    future: Future[bool]
    epoch: int  # of the oldest spill it commits


@dataclass
class _Demotion:
    """A piece of an L1 -> L2 batch that may still run, and its serial number (the slots it
    reads and writes carry it in PlanExecutor's per-slot piece maps)."""

    handle: CopyHandle
    serial: int


@dataclass
class _Deferred:
    """An L1 -> L2 batch applied (the maps say the blocks are in L2) but not yet issued: it
    goes out at flush(), after `after` (compute queued before it was applied) on the GPU."""

    src: np.ndarray  # L1 slots it reads
    dst: np.ndarray  # L2 slots it writes
    after: torch.cuda.Event | None
    prev_h2d: CopyHandle | None  # the L2 -> L1 batch before its plan (may read its L2 slots)
    out: ExecOutcome


@dataclass
class Chain:
    """The next plan's L2 -> L1 moves of blocks this plan loads from L3, which the worker found
    safe to issue early (Worker._chain: the moves its check will pass once this plan is
    applied). Each goes out as soon as the read job that loads its block is done with a hit,
    beside the plan's later reads, instead of after all of them; the next plan's run() takes
    those issued as done."""

    plan: MovePlan  # the next plan
    rows: np.ndarray  # its moves that may go early (indices into plan)
    loads: np.ndarray  # per row: the move of this plan that loads its block into L2
    issued: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per row
    out: ExecOutcome | None = None  # the copies' spans and first issue time

    def issued_rows(self) -> np.ndarray:
        return self.rows[self.issued]


@dataclass
class ExecOutcome:
    """What one plan did on this rank: moves done (mask over the plan), L3 read misses, bytes."""

    done: np.ndarray
    misses: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_ssd_read: int = 0
    bytes_ssd_write: int = 0
    error: str = ""  # the first failure, if a group of moves could not be carried out
    host_ns: int = 0  # host time of the plan (SSD I/O included)
    spill_wait_ns: int = 0  # of it, waiting for spills before its L3 reads could start
    # of it, blocked on other work (spills and earlier copies the plan's moves must follow):
    # not the plan's own transfer time, so not in what the controller's rate meter sees
    blocked_ns: int = 0
    h2d_issued_ns: int = 0  # perf_counter_ns once its first L2 -> L1 copy was issued (0: none)
    # (direction, start, stop) of each copy batch on its stream (GPU only)
    timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    # the first `ahead_spans` of `timing`: copies issued during the plan before's reads (Chain),
    # apart from each other in time: their device time is their sum, not their span
    ahead_spans: int = 0
    num_ahead: int = 0  # moves issued so

    def elapsed_ns(self) -> int:
        """Host time, or the GPU time of its copies if longer (call once they are done)."""
        done = [a.elapsed_time(b) if b.query() else 0.0 for _, a, b in self.timing]
        gpu_ms = max([sum(done[:self.ahead_spans]), *done[self.ahead_spans:]], default=0.0)
        return max(self.host_ns - self.blocked_ns, int(gpu_ms * 1e6))


@contextmanager
def _blocked(out: ExecOutcome) -> Iterator[None]:
    """Count the time inside as the plan's time blocked on other work (ExecOutcome.blocked_ns)."""
    started = time.perf_counter_ns()
    try:
        yield
    finally:
        out.blocked_ns += time.perf_counter_ns() - started


def wait_handle(handle: CopyHandle | None, deadline: float, what: str) -> None:
    """Block the host until a copy batch is done, or raise WaitTimeoutError at the deadline.
    Polls every _POLL_S for the first _POLL_FINE_S (a resume waits a few ms for its copies, and
    a doubling back-off made those waits end up to 5 ms late: on the H200 resume waits
    clustered at 3.5, 6.8, 11.8 and 17 ms), then backs off to 5 ms."""
    delay, fine_until = _POLL_S, time.monotonic() + _POLL_FINE_S
    while handle is not None and not handle.done():
        now = time.monotonic()
        if now > deadline:
            raise WaitTimeoutError(f"{what}: {handle.direction} copy of {handle.num_blocks} "
                                   f"blocks ({handle.num_bytes} bytes) not done by its deadline")
        time.sleep(delay)
        if now > fine_until:
            delay = min(delay * 2, 0.005)


READ_CHUNK_BYTES = 32 << 20  # an L3 read job's share of a session
# An L1 -> L2 batch goes out in pieces of this size, each with its own event: a copy into L1
# slots that a piece empties waits for that piece only, so a resume into a full L1 streams
# both ways at once instead of after the whole demotion.
DEMOTION_PIECE_BYTES = 64 << 20
# The pieces of demotions out of L1 slots their own plan's promotions fill (a resume into a
# full L1): a promotion into such a slot waits for its piece, so smaller pieces let the
# promotions follow sooner (each piece costs one more copy call, ~0.1 ms of host time).
REFILL_PIECE_BYTES = 16 << 20


def _by_session(session_idx: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """`idx` split by session (session_idx[idx]), each part in plan order, the sessions in the
    order of their first row."""
    if len(idx) == 0:
        return []
    sessions = session_idx[idx]
    order = np.argsort(sessions, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(sessions[order])) + 1)
    groups.sort(key=lambda g: int(g[0]))  # (stable: each group's first is its first row)
    return [idx[g] for g in groups]


def _sessions(plan: MovePlan, mask: np.ndarray) -> set[str]:
    """Names of the sessions of the plan's moves in `mask`."""
    return {plan.session_names[s] for s in set(plan.session_idx[mask].tolist())}


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
    L1 slot it fills or writes the L2 slot it reads, and for no other (so a resume into free
    slots runs beside the demotions that make room for the next one, and one into slots being
    emptied follows the pieces that empty them); compute that writes
    new K/V waits the same way for the demotions out of its fresh slots (`fence_compute`). An
    L1 -> L2 batch waits for the previous L2 -> L1 batch (L2 slots), SSD writes on the host for
    the previous L1 -> L2 batch (their source) and SSD reads for both (an L2 slot they fill may
    still be read by an H2D, or written by the D2H of a block dropped since).

    Spills (L2 -> L3) run in the background: a plan returns once they are queued, and reports
    them done. Whatever would overwrite their L2 source slots (an L1 -> L2 batch, an L3 read)
    or needs their records (an L3 read or a drop of the session) first waits for them, bounded.
    A spill that fails deletes the session's L3 records: its blocks there miss (recomputed),
    never read back stale. At TP > 1 (`ledger` and `agree` set by the Worker) every rank then
    deletes them (SpillLedger), and a load of a session whose spills are not agreed settled
    agrees first, so that no rank waits for a manifest another rank can no longer complete.
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
        self.layer_events = layer_events
        g = self.hbm.geometry
        self.layer_bytes, self.num_layers = g.layer_bytes, g.num_layers
        self.layers_per_copy = min(g.num_layers, max(1, -(-layer_chunk_bytes // g.layer_bytes)))
        self.last: dict[str, CopyHandle | None] = {"h2d": None, "d2h": None}
        self.demotions: deque[_Demotion] = deque()  # L1 -> L2 batches, oldest first
        # Per L1 / L2 slot: the serial of the newest piece that read / wrote it (-1: none);
        # a serial below the oldest running piece's is of a piece long done.
        self.piece_of = (np.full(self.hbm.num_slots, -1, dtype=np.int64),
                         np.full(self.host.num_slots, -1, dtype=np.int64))
        self._serial = 0
        self._l1_mark = np.zeros(self.hbm.num_slots, dtype=bool)  # scratch, kept all False
        self._l2_mark = np.zeros(self.host.num_slots, dtype=bool)  # the same over L2
        self.events: list[torch.cuda.Event | None] = [None] * g.num_layers
        self.spills: list[_Spill] = []
        self.num_failed_spills = 0
        # The manifest commits of done spills (a file and a directory fsync each: 20-250 ms
        # on the H200's disk under spills) run on the store's commit thread, not in the step
        # that finds the spills done
        self.commits: list[_Commit] = []
        # Manifest commits: how many were made, and this thread's time making or awaiting them
        self.num_commits = 0
        self.commit_ns = 0
        self.defer_d2h = defer_d2h  # see above; set only through Worker.defer_demotions
        self.deferred: list[_Deferred] = []
        # Set while plans applied after the forward was launched run (Worker.apply_late): an
        # event recorded before that forward, which their copies wait for instead of it.
        self.compute_mark: torch.cuda.Event | None = None
        # The next plan's L2 -> L1 moves issued during this plan's L3 reads (run's `chain`),
        # until that plan runs; and how many moves went so in all
        self.chained: Chain | None = None
        self.num_chained = 0
        # TP > 1: the spill outcomes the group agreed on, and the call that agrees before a
        # load (Worker._agree_loads: a collective on every rank); None: TP 1
        self.ledger: SpillLedger | None = None
        self.agree: Callable[[set[str], float], None] | None = None
        self.last_epoch = 0  # of the last plan run

    # ---- one plan --------------------------------------------------------------------------
    def run(self, plan: MovePlan, ok: np.ndarray, later_l1: np.ndarray | None = None,
            chain: Chain | None = None) -> ExecOutcome:
        """Issue every move in `ok`; copies L1 <-> L2 may still run on return, SSD I/O is done.

        `later_l1`: the L1 slots the rest of the step fills (later plans' promotions, the
        step's new K/V), where the caller knows them. Demotions of a plan with promotions that
        empty none of them are for later steps: they start once the plan's promotions are
        done, so a resume's copies do not share the link with them.

        `chain`: the next plan's L2 -> L1 moves of blocks this plan loads from L3 (Chain), each
        issued once its block's read job is done; that plan's run() takes them as done."""
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
        prev_d2h, prev_h2d = self.last["d2h"], self.last["h2d"]
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
                with _blocked(out):
                    self.wait_spills(deadline, slots=plan.dst_slot[refill], finish=False)
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
            with _blocked(out):
                self.wait_spills(deadline, slots=plan.dst_slot[i], finish=False)
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
        with _blocked(out):
            self.wait_spills(deadline)
        jobs: list[tuple[np.ndarray, Future[Any]]] = []
        if self.agree is not None and self.ledger is not None:
            loading = _sessions(plan, plan.mask(Tier.SSD, Tier.DRAM))  # applied here or not
            if loading and self.ledger.needs_agreement(loading):
                with _blocked(out):
                    self.wait_spills(deadline, names=loading)
                    self.agree(loading, deadline)
        if self.store is None:
            if len(pick["spill"]) or len(pick["load"]):
                out.error = f"epoch {plan.epoch}: moves to or from L3, but L3 is disabled here"
        elif len(i := pick["load"]):  # into L2 slots earlier batches may still read or fill
            with _blocked(out):
                wait_handle(prev_h2d, deadline, f"epoch {plan.epoch} L3 -> L2")
                wait_handle(prev_d2h, deadline, f"epoch {plan.epoch} L3 -> L2")
                names = {plan.session_names[s] for s in set(plan.session_idx[i].tolist())}
                waited = time.perf_counter_ns()
                self.wait_spills(deadline, slots=plan.dst_slot[i], names=names)
                out.spill_wait_ns = time.perf_counter_ns() - waited
            jobs += self._read_jobs(plan, i, deadline)
        if chain is not None and len(chain.rows) and self.store is not None:
            chain.issued = np.zeros(len(chain.rows), dtype=bool)
            chain.out = ExecOutcome(done=np.zeros(0, dtype=bool))
            self.chained = chain
        self._collect(plan, jobs, out, deadline, self.chained)
        # Spills only after the plan's reads: a resume waits for its reads, never for the
        # spills (background writes) beside them, and the disk does not split its bandwidth
        # between the two (on the H200, reads beside a spill of the same size ran at 1.0 GB/s
        # against the disk's 1.75). The two touch other L2 slots (PlanBuilder).
        if self.store is not None and len(i := pick["spill"]):
            with _blocked(out):
                wait_handle(prev_d2h, deadline, f"epoch {plan.epoch} L2 -> L3")
            self._submit_spills(plan, i)
            out.done[i], out.bytes_ssd_write = True, len(i) * block_bytes
        if self.ledger is not None:
            self.ledger.spilled(plan)
        self.last_epoch = plan.epoch
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
        for piece, rows in self._demotion_groups(plan.dst_slot[i], plan.src_slot[i]):
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
                self.track(handle, src[part], dst[part])
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

    def _submit_spills(self, plan: MovePlan, idx: np.ndarray) -> None:
        """One background write per session of the plan's L2 -> L3 moves `idx`."""
        assert self.store is not None
        for part in _by_session(plan.session_idx, np.asarray(idx, dtype=np.int64)):
            name = plan.session_names[int(plan.session_idx[part[0]])]
            # views made on the store's thread, not here (the step's forward waits for this)
            views = self.host.block_views(plan.src_slot[part])
            fut = self.store.submit_write(name, plan.logical_idx[part], views)
            self.spills.append(_Spill(name, plan.epoch, plan.src_slot[part], fut))

    def _read_jobs(self, plan: MovePlan, idx: np.ndarray, deadline: float
                   ) -> list[tuple[np.ndarray, Future[Any]]]:
        """The plan's L3 -> L2 moves `idx` as read jobs on the store's readers: (the moves of
        each job, its future)."""
        assert self.store is not None
        jobs: list[tuple[np.ndarray, Future[Any]]] = []
        for part in _by_session(plan.session_idx, np.asarray(idx, dtype=np.int64)):
            name = plan.session_names[int(plan.session_idx[part[0]])]
            logical = plan.logical_idx[part]
            # views made on the store's thread, not here (the step's forward waits for this)
            views = self.host.block_views(plan.dst_slot[part])
            self._await_manifest(name, deadline)
            # A session's reads in chunks across the store's threads: one thread reading and
            # checking a whole session reached about half the disk's speed.
            step = max(1, READ_CHUNK_BYTES // self.hbm.block_bytes)
            for at in range(0, len(part), step):
                jobs.append((part[at:at + step], self.store.submit_read(
                    name, logical[at:at + step], views[at:at + step])))
        return jobs

    def _collect(self, plan: MovePlan, jobs: list[tuple[np.ndarray, Future[Any]]],
                 out: ExecOutcome, deadline: float, chain: Chain | None = None) -> None:
        """Wait for the plan's read jobs; their hits are done, their misses reported; with
        `chain`, the chained moves of each job's hits go at once (_issue_chained)."""
        block_bytes = self.hbm.block_bytes
        misses: list[np.ndarray] = []
        loaded = np.zeros(plan.num_moves, dtype=bool)
        for part, fut in jobs:
            try:
                result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise WaitTimeoutError(
                    f"epoch {plan.epoch}: L3 read of {len(part)} blocks not done after "
                    f"{self.timeout_s:g} s") from None
            except (SsdError, TierFullError, OSError) as exc:
                out.error = out.error or f"epoch {plan.epoch}: L3 read failed: {exc}"
                log.error("%s", out.error)
                continue
            out.done[part] = True
            hits = np.asarray(result, dtype=bool)
            misses.append(plan.block_ids[part[~hits]])
            out.bytes_ssd_read += int(hits.sum()) * block_bytes
            if chain is not None:
                loaded[part[hits]] = True
                self._issue_chained(chain, loaded)
        if misses:
            out.misses = np.concatenate(misses).astype(np.int64)

    def _issue_chained(self, chain: Chain, loaded: np.ndarray) -> None:
        """Issue the chain's moves whose blocks are loaded (with a hit) and not yet issued:
        after the demotion pieces emptying their L1 slots, as the next plan would."""
        ready = loaded[chain.loads] & ~chain.issued
        if not ready.any():
            return
        assert chain.out is not None
        start = self._promote(chain.plan, chain.rows[ready], chain.out)
        self._span(chain.out, "h2d", start)
        chain.issued |= ready

    def _take_chained(self, plan: MovePlan, ok: np.ndarray, out: ExecOutcome
                      ) -> np.ndarray | None:
        """The moves of `plan` issued during the plan before's reads (Chain), now done here;
        a chain left for another plan (its step failed half-way) is dropped."""
        chain, self.chained = self.chained, None
        if chain is None or chain.plan is not plan:
            return None
        rows = chain.issued_rows()
        rows = rows[ok[rows]]  # Worker.apply_plan dealt with any its check refused
        if not len(rows):
            return None
        assert chain.out is not None
        out.done[rows] = True
        out.bytes_h2d += len(rows) * self.hbm.block_bytes
        out.timing = list(chain.out.timing)
        out.ahead_spans = len(out.timing)
        out.h2d_issued_ns = chain.out.h2d_issued_ns
        out.num_ahead = len(rows)
        self.num_chained += len(rows)
        return rows

    def wait_spills(self, deadline: float, slots: np.ndarray | None = None,
                    names: set[str] | frozenset[str] = frozenset(), every: bool = False,
                    finish: bool = True) -> None:
        """Finish the background spills that read any of `slots` or write a session in `names`
        (all of them with `every`), waiting for them up to `deadline`; spills already done are
        finished too. Finishing: commit the session's manifest (complete once the last rank to
        write has written), or log the failure (its records then read as misses). The commit
        is queued on the store's commit thread, and waited for here when its session is in
        `names` (or with `every`).

        `finish=False` (before copies into L2 `slots`): only wait until the spills that read
        them are done writing; finishing them (manifest fsyncs, failures) is left to a later
        call, after the plan's copies are issued."""
        keep: list[_Spill] = []
        written: dict[str, int] = {}  # session -> epoch of its oldest spill written
        failed: set[str] = set()
        for sp in self.spills:
            must = every or sp.name in names or (slots is not None and len(slots) > 0
                                                 and bool(np.isin(sp.slots, slots).any()))
            if not finish:  # (a failure is logged, and its session forgotten, when finished)
                if must:
                    self._written(sp, deadline)
                keep.append(sp)
                continue
            if not must and not sp.future.done():
                keep.append(sp)
                continue
            exc = self._written(sp, deadline)
            if exc is None:
                written[sp.name] = min(sp.epoch, written.get(sp.name, sp.epoch))
            else:
                self.num_failed_spills += 1
                failed.add(sp.name)
                log.error("epoch %d: L3 write of session %r failed: %s", sp.epoch, sp.name, exc)
        self.spills = keep
        for name in sorted(written.keys() - failed):
            assert self.store is not None
            self.num_commits += 1
            self.commits.append(_Commit(name, self.store.submit_commit(name), written[name]))
        for name in sorted(failed):
            self._forget(name, deadline)
        if finish and self.commits:
            self._finish_commits(deadline, names, every)

    def _finish_commits(self, deadline: float, names: set[str] | frozenset[str],
                        every: bool) -> None:
        """Collect the background commits that are done, and wait (until `deadline`) for
        those of `names` (all with `every`); a failed one forgets its session."""
        keep: list[_Commit] = []
        failed: list[tuple[str, BaseException]] = []
        started = time.perf_counter_ns()
        try:
            for c in self.commits:
                if not (every or c.name in names or c.future.done()):
                    keep.append(c)
                    continue
                try:
                    c.future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise WaitTimeoutError(f"the manifest commit of session {c.name!r} not "
                                           f"done after {self.timeout_s:g} s") from None
                except (SsdError, OSError) as exc:
                    failed.append((c.name, exc))
        finally:
            self.commit_ns += time.perf_counter_ns() - started
        self.commits = keep
        for name, error in failed:
            self._commit_failed(name, error, deadline)

    def _written(self, sp: _Spill, deadline: float) -> BaseException | None:
        """Wait (until `deadline`, else WaitTimeoutError) for a spill's write to end; the error
        it failed with, or None."""
        try:
            sp.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise WaitTimeoutError(f"epoch {sp.epoch}: L3 write of {len(sp.slots)} blocks not "
                                   f"done after {self.timeout_s:g} s") from None
        except (SsdError, TierFullError, OSError) as exc:
            return exc
        return None

    def _commit(self, name: str, deadline: float) -> bool | None:
        """Commit a session's manifest: whether it is complete (every rank wrote), or None when
        writing it failed (e.g. a full disk) and the session was forgotten."""
        assert self.store is not None
        started = time.perf_counter_ns()
        try:
            return self.store.commit_manifest(name)
        except (SsdError, OSError) as exc:  # as the commit thread's failures (_finish_commits)
            self._commit_failed(name, exc, deadline)
            return None
        finally:
            self.num_commits += 1
            self.commit_ns += time.perf_counter_ns() - started

    def _commit_failed(self, name: str, exc: BaseException, deadline: float) -> None:
        self.num_failed_spills += 1
        log.error("manifest of session %r not written: %s", name, exc)
        self._forget(name, deadline)

    def _forget(self, name: str, deadline: float, elsewhere: bool = False) -> None:
        """A spill of the session failed after its plan was confirmed (here, or on another
        rank: `elsewhere`, agreed through the ledger): the controller counts its blocks as in
        L3, and older records of the same blocks (a last block written again with more
        tokens since) may still be on disk, where a read would take them as hits. Delete
        every L3 record of the session: its blocks there miss and are recomputed. A failure
        here is reported to the other ranks (SpillLedger), which then do the same."""
        assert self.store is not None
        self.wait_spills(deadline, names={name})  # none of its writes may land after the drop
        where = "on some rank of the TP group" if elsewhere else "here"
        if self.ledger is not None and not elsewhere:
            self.ledger.forgot(name)
        try:
            self.store.drop_session(name)
        except (SsdError, OSError) as exc:
            log.error("L3 records of session %r not deleted after a failed spill %s: %s", name,
                      where, exc)
        else:
            (log.warning if elsewhere else log.error)(
                "L3 records of session %r deleted after a failed spill %s: its blocks in L3 "
                "will miss and be recomputed", name, where)

    def finished_below(self) -> int:
        """The epoch below which this rank's spills are all finished (written and committed,
        or failed and forgotten)."""
        return min([sp.epoch for sp in self.spills] + [c.epoch for c in self.commits],
                   default=self.last_epoch + 1)

    def report(self) -> tuple[bytes, int]:
        """This rank's SpillLedger report for the next confirmation or agreement."""
        assert self.ledger is not None
        return self.ledger.report(self.finished_below())

    def settle(self, forgotten: frozenset[str], settled_below: int, deadline: float,
               loaded: set[str] | frozenset[str] = frozenset()) -> None:
        """What every rank agreed on (a confirmation, or an agreement before a load of
        `loaded`): forget here every session some rank forgot."""
        assert self.ledger is not None
        for name in self.ledger.agreed(forgotten, settled_below, loaded):
            self._forget(name, deadline, elsewhere=True)

    def _await_manifest(self, name: str, deadline: float) -> None:
        """Records another rank wrote a moment ago are readable once the manifest covers them:
        complete it here if every rank has written (poll, bounded); else they read as misses.
        Every record of this rank's commit, not only the indices read: a block appended again
        (its L3 copy written since) is in an older manifest too, as its older record."""
        assert self.store is not None
        # This rank's spills of the session are finished (run() waits for them before a load),
        # so what its own commit lacks was never written or was deleted: a miss now, no wait.
        # At TP > 1 (agree) every rank's spills of it are finished and agreed on: one commit,
        # no wait (a manifest not complete now never will be; the reads miss).
        end = min(deadline, time.monotonic() + self.timeout_s / 2)
        while not self.store.manifest_covers_commit(name):
            complete = self._commit(name, deadline)
            if complete is None or complete or self.agree is not None \
                    or time.monotonic() > end:
                return
            time.sleep(0.001)

    # ---- copies ----------------------------------------------------------------------------
    def _h2d(self, host_slots: np.ndarray, hbm_slots: np.ndarray) -> None:
        if not self.layer_events:  # the stream is ordered after compute (_mark)
            handle = self.engine.h2d(host_slots, hbm_slots, ordered=True)
            self.last["h2d"] = handle
            self.events = [handle.event] * self.num_layers
            return
        n, step = len(hbm_slots), self.layers_per_copy
        handle = CopyHandle(n, n * self.hbm.block_bytes, "layers", "h2d")
        if not self.engine.on_gpu:
            for start in range(0, self.num_layers, step):
                self._copy_layers_torch(host_slots, hbm_slots, start, start + step)
            self.last["h2d"] = handle
            return
        stream = self.engine.streams["h2d"]
        stream.wait_stream(torch.cuda.current_stream(self.hbm.device))
        use_dma = self.engine.choose_method("h2d") == "dma"
        src0, dst0 = self.host.slot_ptrs(host_slots), self.hbm.slot_ptrs(hbm_slots)
        with torch.cuda.stream(stream):
            for start in range(0, self.num_layers, step):
                stop = min(self.num_layers, start + step)
                if use_dma:
                    off, size = start * self.layer_bytes, (stop - start) * self.layer_bytes
                    cuda_rt.memcpy_batch(dst0 + off, src0 + off, np.full(n, size, np.uint64),
                                         stream.cuda_stream)
                else:
                    self._copy_layers_torch(host_slots, hbm_slots, start, stop)
                event = torch.cuda.Event()
                event.record(stream)
                self.events[start:stop] = [event] * (stop - start)
        handle.event = self.events[-1]
        self.last["h2d"] = handle

    def _copy_layers_torch(self, host_slots: np.ndarray, hbm_slots: np.ndarray, start: int,
                           stop: int) -> None:
        """Layers [start, stop) of each block by index ops per L2 arena (CPU, or no batch API)."""
        device = self.hbm.device
        for arena, pos, index in self.host.group_by_arena(host_slots):
            rows = self.host.arenas[arena][torch.from_numpy(index), start:stop]
            if self.engine.on_gpu:
                rows = rows.pin_memory().to(device, non_blocking=True)
            self.hbm.tensor[torch.from_numpy(hbm_slots[pos]).to(device), start:stop] = rows

    # ---- what the engine waits on ----------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` of every block copied into L1 so far
        (no host wait). On the CPU copies are done when issued."""
        event = self.events[layer]
        if event is not None and self.engine.on_gpu:
            torch.cuda.current_stream(self.hbm.device).wait_event(event)

    def fence_compute(self, fresh_l1_slots: np.ndarray) -> None:
        """Make the current stream wait for the L1 -> L2 batches that empty any of the L1 slots
        the engine writes new K/V into (the step's fresh slots); no wait when none does.
        Deferred batches that read one of them go out first."""
        fresh = np.asarray(fresh_l1_slots, dtype=np.int64)
        if any(self._l1_among(d.src, fresh).any() for d in self.deferred):
            self.flush()
        handle = self._demotion_into(fresh_l1_slots, None)
        if handle is not None and handle.event is not None:
            torch.cuda.current_stream(self.hbm.device).wait_event(handle.event)

    def track(self, handle: CopyHandle, l1_slots: np.ndarray, l2_slots: np.ndarray) -> None:
        """Keep an L1 -> L2 piece (issued after every piece tracked before it, on one stream)
        until its handle is done: copies into its L1 slots or out of its L2 slots wait for it."""
        self.piece_of[0][l1_slots] = self._serial
        self.piece_of[1][l2_slots] = self._serial
        self.demotions.append(_Demotion(handle, self._serial))
        self._serial += 1

    def _demotion_into(self, l1_slots: np.ndarray, l2_slots: np.ndarray | None
                       ) -> CopyHandle | None:
        """The newest L1 -> L2 piece still running that reads one of `l1_slots` or writes one
        of `l2_slots` (the d2h stream runs in order: waiting for it waits for all before it)."""
        l1 = np.asarray(l1_slots, dtype=np.int64)
        l2 = np.full(len(l1), -1, dtype=np.int64) if l2_slots is None else l2_slots  # no slot
        return self._demotion_groups(l1, l2)[-1][0]

    def _demotion_groups(self, l1_slots: np.ndarray, l2_slots: np.ndarray
                         ) -> list[tuple[CopyHandle | None, np.ndarray]]:
        """Copies into L1 (positions into l1_slots / l2_slots) grouped by the newest L1 -> L2
        piece still running that reads one of the copy's L1 slot or writes its L2 slot: that
        piece's handle (None: no wait), oldest piece first, so the groups can be issued in
        order on one stream as their pieces finish."""
        while self.demotions and self.demotions[0].handle.done():
            self.demotions.popleft()
        n = len(l1_slots)
        if not n or not self.demotions:
            return [(None, np.arange(n))]
        l1 = np.asarray(l1_slots, dtype=np.int64)
        l2 = np.asarray(l2_slots, dtype=np.int64)
        dep = self.piece_of[0][l1]  # a copy, as fancy indexing makes one
        named = l2 >= 0
        dep[named] = np.maximum(dep[named], self.piece_of[1][l2[named]])
        dep -= self.demotions[0].serial  # positions in the deque; < 0: done or none
        dep[dep < 0] = -1
        if dep.max() < 0:
            return [(None, np.arange(n))]
        order = np.argsort(dep, kind="stable")
        cuts = np.flatnonzero(np.diff(dep[order])) + 1
        return [(None if dep[g[0]] < 0 else self.demotions[int(dep[g[0]])].handle, g)
                for g in np.split(order, cuts)]

    def synchronize(self) -> None:
        """Wait on the host for every copy (deferred ones issued first) and background spill
        (bounded)."""
        self.flush()
        deadline = time.monotonic() + self.timeout_s
        for direction, handle in self.last.items():
            wait_handle(handle, deadline, f"synchronize {direction}")
        self.wait_spills(deadline, every=True)

    # ---- resync ----------------------------------------------------------------------------
    def relocate(self, rel: Relocation) -> np.ndarray:
        """Move bytes so this rank matches the controller's table after a resync: every source
        is staged in host memory first, so a chain of moves cannot overwrite its own input.
        Returns the ids of blocks this rank holds nowhere (lost here; their bytes are zeros)."""
        self.synchronize()
        n, block_bytes = rel.num_blocks, self.hbm.block_bytes
        staging = np.zeros((n, block_bytes), dtype=np.uint8)
        have = np.zeros(n, dtype=bool)
        for i in range(n):
            tier, slot = int(rel.src_tier[i]), int(rel.src_slot[i])
            if tier == HBM:
                staging[i] = self.hbm.tensor[slot].reshape(-1).view(torch.uint8).cpu().numpy()
                have[i] = True
            elif tier == DRAM:
                staging[i], have[i] = self.host.block_bytes_view(slot), True
            elif tier == SSD and self.store is not None:
                have[i] = bool(self.store.read_blocks(rel.sessions[i], rel.logical_idx[i:i + 1],
                                                      [staging[i]])[0])
        for i in range(n):
            tier, slot = int(rel.dst_tier[i]), int(rel.dst_slot[i])
            if tier == HBM:
                dst = self.hbm.tensor[slot].reshape(-1).view(torch.uint8)
                dst.copy_(torch.from_numpy(staging[i]).to(dst.device))
            elif tier == DRAM:
                self.host.block_bytes_view(slot)[:] = staging[i]
            elif tier == SSD and self.store is not None and have[i]:
                self.store.write_blocks(rel.sessions[i], rel.logical_idx[i:i + 1], [staging[i]])
                self._commit(rel.sessions[i], time.monotonic() + self.timeout_s)
        if self.engine.on_gpu:
            done = CopyHandle(n, n * block_bytes, "relocate", "h2d", torch.cuda.Event())
            assert done.event is not None
            done.event.record(torch.cuda.current_stream(self.hbm.device))
            wait_handle(done, time.monotonic() + self.timeout_s, "resync relocation")
        lost = rel.block_ids[~have]
        if len(lost):
            log.error("resync: %d blocks have no copy on this rank (e.g. %d); their bytes are "
                      "zeros here", len(lost), int(lost[0]))
        return lost
