"""SpillTracker: a rank's background L2 -> L3 writes, their manifest commits, failures forgotten."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tpkv.errors import SsdError, TierFullError, WaitTimeoutError
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers.agreement import SpillLedger
from tpkv.workers.outcome import ExecOutcome, blocked
from tpkv.workers.pools import HostPool
from tpkv.workers.reads import by_session, plan_sessions

log = logging.getLogger(__name__)

LONG_WAIT_S = 0.25  # a wait for spills this long is logged with what it waited for
RATE_SAMPLE_S = 0.05  # the least time with spills in flight that a rate sample covers


@dataclass
class _Spill:
    """An L2 -> L3 write still running: its L2 source slots must not be refilled before it ends."""

    name: str
    epoch: int
    slots: np.ndarray  # L2 slots it reads
    future: Future[Any]
    submitted_ns: int = 0  # perf_counter_ns when queued
    # its session is being deleted (abandon): it writes nothing if not begun, and is neither
    # committed nor forgotten when it ends; until then a refill of its slots still waits
    abandoned: bool = False


@dataclass
class _Commit:
    """A session's manifest commit running on the store's commit thread:
    its L3 records are read, or its files deleted, only once it is done."""

    name: str
    future: Future[bool]
    epoch: int  # of the oldest spill it commits


class SpillTracker:
    """The spills (L2 -> L3) a PlanExecutor queued, running in the background, and their
    manifest commits. Whatever would overwrite their L2 source slots (an L1 -> L2 batch, an L3
    read) or needs their records (an L3 read or a drop of the session) first waits for them,
    bounded (wait). A spill that fails deletes the session's L3 records: its blocks there miss
    (recomputed), never read back stale. At TP > 1 (`ledger` and `agree`, set by the Worker
    through join_group) every rank then deletes them (SpillLedger), and a load of a session
    whose spills are not agreed settled agrees first (before_loads), so that no rank waits for
    a manifest another rank can no longer complete."""

    def __init__(self, store: SsdStore | None, host: HostPool, timeout_s: float) -> None:
        self.store = store
        self.host = host
        self.timeout_s = timeout_s
        self.running: list[_Spill] = []
        self.num_failed_spills = 0
        # The manifest commits of done spills (a file and a directory fsync each: 20-250 ms
        # on the H200's disk under spills) run on the store's commit thread, not in the step
        # that finds the spills done
        self.commits: list[_Commit] = []
        # Manifest commits: how many were made, and this thread's time making or awaiting them
        self.num_commits = 0
        self.commit_ns = 0
        # TP > 1: the spill outcomes the group agreed on, and the call that agrees before a
        # load (Worker._agree_loads: a collective on every rank); None: TP 1
        self.ledger: SpillLedger | None = None
        self.agree: Callable[[set[str], float], None] | None = None
        self.last_epoch = 0  # of the last plan run
        # The disk's write rate as spills measure it (bytes/s, a moving average; 0: none yet):
        # bytes written over the time any spill was in flight, in samples of RATE_SAMPLE_S
        # or more (_ended)
        self.write_bytes_per_s = 0.0
        self._in_flight = 0  # spills queued or writing
        self._busy_from_ns = 0  # since when the busy time below is not yet counted
        self._busy_ns = 0  # time with a spill in flight since the last sample
        self._wrote = 0  # bytes spills wrote since the last sample
        self._rate_lock = threading.Lock()
        self.num_long_waits = 0  # waits for spills of LONG_WAIT_S or more (logged)

    def join_group(self, ledger: SpillLedger, agree: Callable[[set[str], float], None]) -> None:
        """TP > 1: report spill outcomes through `ledger`; call `agree` before a load of
        sessions whose spills are not agreed settled."""
        self.ledger, self.agree = ledger, agree

    def ran(self, plan: MovePlan) -> None:
        """`plan` was run here (its spills, if any, queued)."""
        if self.ledger is not None:
            self.ledger.spilled(plan)
        self.last_epoch = plan.epoch

    def before_loads(self, plan: MovePlan, out: ExecOutcome, deadline: float) -> None:
        """At TP > 1, before `plan` loads from L3: agree with the group on the sessions it
        loads whose spills are not agreed settled (their own spills finished first)."""
        if self.agree is not None and self.ledger is not None:
            loading = plan_sessions(plan, plan.mask(Tier.SSD, Tier.DRAM))  # applied here or not
            if loading and self.ledger.needs_agreement(loading):
                with blocked(out):
                    self.wait(deadline, names=loading)
                    self.agree(loading, deadline)

    def submit(self, plan: MovePlan, idx: np.ndarray) -> None:
        """One background write per session of the plan's L2 -> L3 moves `idx`."""
        assert self.store is not None
        for part in by_session(plan.session_idx, np.asarray(idx, dtype=np.int64)):
            name = plan.session_names[int(plan.session_idx[part[0]])]
            # views made on the store's thread, not here (the step's forward waits for this)
            views = self.host.block_views(plan.src_slot[part])
            queued = time.perf_counter_ns()
            self._began()
            try:
                fut = self.store.submit_write(name, plan.logical_idx[part], views)
            except BaseException:
                self._ended(0, None)
                raise
            sp = _Spill(name, plan.epoch, plan.src_slot[part], fut, queued)
            fut.add_done_callback(partial(self._ended, len(part) * self.host.block_bytes))
            self.running.append(sp)

    def busy(self, name: str) -> bool:
        """Whether a spill of the session, or its manifest commit, is not finished: its
        records on L3 are not all readable yet."""
        return (any(sp.name == name and not sp.abandoned for sp in self.running)
                or any(c.name == name and not c.future.done() for c in self.commits))

    def abandon(self, names: set[str] | frozenset[str]) -> None:
        """The L3 records of sessions `names` are being deleted (closed, or dropped from L3):
        their spills not begun write nothing (SsdStore.submit_write), none is committed, and
        nothing here waits for them; a copy into L2 slots one still reads waits for it as
        for any spill. The store's delete waits for a write already writing."""
        for sp in self.running:
            if sp.name in names:
                sp.abandoned = True
        self.commits = [c for c in self.commits if c.name not in names]

    def wait(self, deadline: float, slots: np.ndarray | None = None,
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
        musts = [every or sp.name in names or (slots is not None and len(slots) > 0
                                               and bool(np.isin(sp.slots, slots).any()))
                 for sp in self.running]
        # the spills this call waits for (not done yet), and whether for their own records
        awaited = [(sp, sp.name in names) for m, sp in zip(musts, self.running)
                   if m and not sp.future.done()]
        waits = bool(awaited)
        started = time.perf_counter_ns()
        # (a wait for writes: they stop yielding to reads until it is over)
        with self.store.writes_first() if waits and self.store else contextlib.nullcontext():
            for must, sp in zip(musts, self.running):
                if not finish:  # (a failure is logged, and its session forgotten, when finished)
                    if must:
                        self._written(sp, deadline)
                    keep.append(sp)
                    continue
                if not must and not sp.future.done():
                    keep.append(sp)
                    continue
                exc = self._written(sp, deadline)
                if sp.abandoned:  # its records are deleted: nothing to commit or forget
                    continue
                if exc is None:
                    written[sp.name] = min(sp.epoch, written.get(sp.name, sp.epoch))
                else:
                    self.num_failed_spills += 1
                    failed.add(sp.name)
                    log.error("epoch %d: L3 write of session %r failed: %s", sp.epoch, sp.name,
                              exc)
        self.running = keep
        if waits:
            self._note_wait(awaited, started, every)
        for name in sorted(written.keys() - failed):
            assert self.store is not None
            self.num_commits += 1
            self.commits.append(_Commit(name, self.store.submit_commit(name), written[name]))
        for name in sorted(failed):
            self._forget(name, deadline)
        if finish and self.commits:
            self._finish_commits(deadline, names, every)

    def _note_wait(self, awaited: list[tuple[_Spill, bool]], started_ns: int,
                   every: bool) -> None:
        """A wait for spills longer than LONG_WAIT_S is logged with what it waited for: each
        spill's session, why (its own records, or L2 slots it reads), how long since it was
        queued, and the spills still running behind or beside it."""
        now = time.perf_counter_ns()
        waited_s = (now - started_ns) / 1e9
        if waited_s < LONG_WAIT_S:
            return
        self.num_long_waits += 1
        why = ("every spill" if every else
               ", ".join(f"{sp.name} ({'its records' if own else 'L2 slots'}, "
                         f"{len(sp.slots)} blocks, queued {(now - sp.submitted_ns) / 1e9:.2f} s"
                         f"{', abandoned' if sp.abandoned else ''})" for sp, own in awaited[:4])
               + (f" and {len(awaited) - 4} more" if len(awaited) > 4 else ""))
        queued = sum(len(sp.slots) for sp in self.running)
        log.warning("waited %.2f s for %d spills: %s; %d spills (%d blocks) still running, "
                    "disk writes %.2f GB/s as spills measure it", waited_s, len(awaited), why,
                    len(self.running), queued, self.write_bytes_per_s / 1e9)

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
            spent = time.perf_counter_ns() - started
            self.commit_ns += spent
        if spent >= LONG_WAIT_S * 1e9:
            self.num_long_waits += 1
            log.warning("waited %.2f s for manifest commits (%s); %d commits still queued",
                        spent / 1e9, "every session" if every else ", ".join(sorted(names)[:4]),
                        len(keep))
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

    def commit(self, name: str, deadline: float) -> bool | None:
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
        self.wait(deadline, names={name})  # none of its writes may land after the drop
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
        return min([sp.epoch for sp in self.running] + [c.epoch for c in self.commits],
                   default=self.last_epoch + 1)

    def _began(self) -> None:
        """A spill is queued: the disk is busy with spills from now if it was not."""
        with self._rate_lock:
            if self._in_flight == 0:
                self._busy_from_ns = time.perf_counter_ns()
            self._in_flight += 1

    def _ended(self, nbytes: int, fut: Future[Any] | None) -> None:
        """A spill's write ended (on a writer thread), or was never queued (`fut` None). The
        disk's write rate is the bytes spills wrote over the time any spill was in flight
        (queued or writing), sampled once that time reaches RATE_SAMPLE_S: spills that end
        together share their time, instead of the last of them taking a few microseconds
        as its own (which measured hundreds of GB/s on the H200 and let the pacer queue
        seconds of spills)."""
        with self._rate_lock:
            now = time.perf_counter_ns()
            self._busy_ns += now - self._busy_from_ns
            self._busy_from_ns = now
            self._in_flight -= 1
            if (fut is not None and not fut.cancelled() and fut.exception() is None
                    and fut.result()):  # (0: nothing written, its session dropped first)
                self._wrote += nbytes
            if self._busy_ns >= RATE_SAMPLE_S * 1e9 and self._wrote:
                sample = self._wrote / (self._busy_ns / 1e9)
                old = self.write_bytes_per_s
                self.write_bytes_per_s = sample if old == 0 else 0.75 * old + 0.25 * sample
                self._wrote = self._busy_ns = 0

    def wait_written(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` (no error past it) for the spills running to be written,
        then finish those done (manifest commits queued, failures forgotten)."""
        if self.running:
            wait_futures([sp.future for sp in self.running], timeout=timeout_s)
        self.wait(time.monotonic() + self.timeout_s)

    def progress(self) -> tuple[int, int]:
        """(the epoch below which this rank's spills have all written, so read their L2 slots
        no more, finished or not; the disk's write rate, bytes/s, 0 if not measured yet): for
        the controller's spill pacing (MoveResult.spills_written_below, spill_write_bytes_per_s)."""
        below = min([sp.epoch for sp in self.running if not sp.future.done()],
                    default=self.last_epoch + 1)
        return below, int(self.write_bytes_per_s)

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

    def await_manifest(self, name: str, deadline: float) -> None:
        """Records another rank wrote a moment ago are readable once the manifest covers them:
        complete it here if every rank has written (poll, bounded); else they read as misses.
        Every record of this rank's commit, not only the indices read: a block appended again
        (its L3 copy written since) is in an older manifest too, as its older record."""
        assert self.store is not None
        # This rank's spills of the session are finished (PlanExecutor.run waits for them
        # before a load), so what its own commit lacks was never written or was deleted: a
        # miss now, no wait.
        # At TP > 1 (agree) every rank's spills of it are finished and agreed on: one commit,
        # no wait (a manifest not complete now never will be; the reads miss).
        end = min(deadline, time.monotonic() + self.timeout_s / 2)
        while not self.store.manifest_covers_commit(name):
            complete = self.commit(name, deadline)
            if complete is None or complete or self.agree is not None \
                    or time.monotonic() > end:
                return
            time.sleep(0.001)
