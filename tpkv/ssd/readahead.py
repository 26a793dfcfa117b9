"""ReadAhead: a returning session's L3 records read into memory before the step that loads them.

A session whose turn arrives with blocks on L3 waits outside the batch while this rank reads its
records, checked as any read, into buffers of its own (not L2: the controller has not planned
the load yet). The step that loads the session then copies them from memory instead of reading
the disk: a read of a record the buffers hold is served from them, the rest from the disk.

Never wrong KV: a session's buffers are good only for the store state they were read from. Every
change to the session's records on this rank (a write, a manifest commit, a delete) bumps its
generation and discards them; a buffer read under an older generation is never served. A miss
read ahead is not served either (the disk is read again). The bytes held are bounded by a budget:
a read ahead that does not fit is refused (the caller loads the session the usual way).

The jobs' buffers are page-aligned (O_DIRECT reads land in them without a staging copy) and kept
for the next read ahead once given back, at most the budget's worth: the kernel faulted a fresh
buffer's pages in one by one while it copied into them (bench/l3_path.py on the CPU VM: a read
ahead into fresh buffers ran at 0.16 GB/s, 97% of it inside preadv). A new one is mapped on the
job's thread with its pages made present at once (MAP_POPULATE).

On a GPU the buffers are pinned as they are mapped (`pin_with`), and a step may lease a session's
blocks (`lease`): their addresses, for copies straight into L1 (workers/direct.py). A lease keeps
its buffers out of the pool until it is given back, which its caller does once those copies are
done; a change to the session after the lease began does not touch the bytes leased (a buffer is
only ever written by the job that reads into it).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from tpkv.errors import ArgumentError
from tpkv.ssd import kernels
from tpkv.ssd.backend import PAGE_BYTES, BlockViews, aligned_empty, row_addresses
from tpkv.ssd.pinned import PinnedBuffers, Register, Unregister

# A session's records are read in jobs of about this size across the read-ahead threads.
AHEAD_JOB_BYTES = 32 << 20

ReadFn = Callable[[str, np.ndarray, Sequence[np.ndarray]], np.ndarray]
_NO_BUFFER = np.empty((0, 0), np.uint8)  # a job's until its thread maps one (none was free)


@dataclass
class _Job:
    indices: np.ndarray  # sorted logical indices it reads
    base: np.ndarray  # [rows per job, block_bytes] uint8: the pooled buffer (or _NO_BUFFER)
    buffers: np.ndarray  # [len(indices), block_bytes] uint8: its first rows
    future: Future[np.ndarray] | None = None  # the hit mask when done
    pinned: bool = False  # its buffer is pinned (pin_with)


@dataclass
class _Session:
    generation: int
    jobs: list[_Job]
    num_bytes: int
    discarded: bool = False
    num_done: int = 0  # jobs done
    readers: int = 0  # take() calls copying out of its buffers now
    freed: bool = False  # its buffers are back in the pool
    # the last read-only index array covers() found held (jobs are only ever added: it stays)
    covered: np.ndarray | None = None


@dataclass
class Lease:
    """Blocks of a session held in read-ahead buffers for a caller's copies (ReadAhead.lease):
    `rows` (positions into the indices asked) are hits read under the session's current
    generation, at host `addresses`; `blocks` gives their rows as arrays (when asked). Give it
    back with ReadAhead.release once nothing reads those addresses any more."""

    rows: np.ndarray
    addresses: np.ndarray  # uint64, one per row
    blocks: list[np.ndarray]
    entry: _Session


class ReadAhead:
    """One rank's read-ahead buffers, at most `budget_bytes` of them, read by `read` (the
    store's checked read_blocks) on `threads` threads of their own (apart from the readers of
    a step's loads, which never queue behind them)."""

    def __init__(self, block_bytes: int, budget_bytes: int, threads: int, rank: int) -> None:
        self.block_bytes, self.budget_bytes = block_bytes, budget_bytes
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"tpkv-l3-ahead{rank}")
        self._job_rows = max(1, AHEAD_JOB_BYTES // block_bytes)
        # job buffers given back, for the next read aheads (at most the budget's worth)
        self._free: list[np.ndarray] = []
        self._free_cap = max(1, -(-budget_bytes // (self._job_rows * block_bytes)))
        # reentrant: a job done before start() adds its callback runs it inside start()
        self._lock = threading.RLock()
        self._generation: dict[str, int] = {}
        self._sessions: dict[str, _Session] = {}
        self._held = 0  # bytes of buffers not yet given back (discarded ones still reading too)
        self.num_served = 0  # blocks served from the buffers so far
        # bytes of the read aheads' jobs done so far, and the seconds in which any job was in
        # flight: their ratio is the rate the disk gives them together (per session times,
        # which overlap, would count a busy disk's time once per session read at once)
        self.read_bytes, self.read_s = 0, 0.0
        self._in_flight, self._mark = 0, 0.0
        # buffers pinned as mapped, once pin_with gave the hooks; unpinned as they leave
        self.pinned = PinnedBuffers()

    def pin_with(self, register: Register, unregister: Unregister) -> None:
        """Pin each buffer mapped from now on (copies into L1 may then read leased blocks)."""
        self.pinned.use(register, unregister)

    @property
    def pin_error(self) -> str | None:
        return self.pinned.error

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def holds(self, num_blocks: int) -> bool:
        """Whether the budget holds a read ahead of `num_blocks` blocks at all (when empty)."""
        return num_blocks * self.block_bytes <= self.budget_bytes

    def fits(self, num_blocks: int) -> bool:
        """Whether a read ahead of `num_blocks` blocks fits the budget now."""
        with self._lock:
            return self._held + num_blocks * self.block_bytes <= self.budget_bytes

    def start(self, sid: str, logical_idx: np.ndarray, read: ReadFn) -> bool:
        """Read the session's records `logical_idx` ahead (False: they do not fit the budget
        now, nothing started). A session read ahead already has those of `logical_idx` its
        jobs do not hold read by more jobs, as the budget allows (blocks that came to L3
        since without a write, whose records were on disk: no change discarded the read
        ahead); True either way."""
        idx = np.asarray(logical_idx, dtype=np.int64)
        if len(idx) > 1 and not (idx[1:] > idx[:-1]).all():  # (a map's are sorted, unique)
            idx = np.unique(idx)
        if len(idx) and idx[0] < 0:
            raise ArgumentError(f"session {sid}: logical index {int(idx[0])} is negative")
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is not None:
                idx = idx[~np.isin(idx, self._held_indices(entry))]
            need = len(idx) * self.block_bytes
            if self._held + need > self.budget_bytes or not len(idx):
                return entry is not None
            per_job = self._job_rows
            jobs = []
            for at in range(0, len(idx), per_job):
                base = self._free.pop() if self._free else _NO_BUFFER
                jobs.append(_Job(idx[at:at + per_job], base,
                                 base[:len(idx[at:at + per_job])]))
            if entry is None:
                entry = _Session(self._generation.get(sid, 0), jobs, need)
                self._sessions[sid] = entry
            else:
                entry.jobs += jobs
                entry.num_bytes += need
            self._held += need
            self._busy_until_now()
            self._in_flight += len(jobs)
            for job in jobs:
                job.future = self._pool.submit(self._run, job, sid, read)
                job.future.add_done_callback(functools.partial(self._job_done, entry, job))
        return True

    def covers(self, sid: str, logical_idx: np.ndarray) -> bool:
        """Whether the session's read ahead has a job for each of `logical_idx`. (Asked for
        every turn outside the batch each step: the answer for a read-only array, such as
        SlotMirror.session_logical's while the session is unchanged, is kept.)"""
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is None:
                return False
            if entry.covered is logical_idx:
                return True
            if not np.isin(logical_idx, self._held_indices(entry)).all():
                return False
            if isinstance(logical_idx, np.ndarray) and not logical_idx.flags.writeable:
                entry.covered = logical_idx
            return True

    @staticmethod
    def _held_indices(entry: _Session) -> np.ndarray:
        return (np.concatenate([job.indices for job in entry.jobs]) if entry.jobs
                else np.zeros(0, dtype=np.int64))

    def _run(self, job: _Job, sid: str, read: ReadFn) -> np.ndarray:
        """A job, on a read-ahead thread: a new buffer (none was free) is mapped here, its
        pages made present at once, not on the caller's thread."""
        if not job.base.size:
            job.base = aligned_empty(self._job_rows * self.block_bytes, populate=True).reshape(
                self._job_rows, self.block_bytes)
            job.buffers = job.base[:len(job.indices)]
            self.pinned.pin(job.base)
        job.pinned = self.pinned.holds(job.base)
        # its rows as views with their addresses at once (the read's CRCs take them so)
        rows = job.buffers
        return read(sid, job.indices, BlockViews(
            rows.__getitem__, np.arange(len(rows)), self.block_bytes,
            self.block_bytes % PAGE_BYTES == 0, functools.partial(row_addresses, rows)))

    def _release(self, entry: _Session) -> None:
        """(Under the lock) once a discarded session's jobs are done and nothing copies out of
        them: its bytes are no longer held, its buffers go back to the pool."""
        if entry.freed or not entry.discarded or entry.readers or (
                entry.num_done < len(entry.jobs)):
            return
        entry.freed = True
        self._held -= entry.num_bytes
        for job in entry.jobs:
            if not job.base.size:
                continue
            if len(self._free) < self._free_cap:
                self._free.append(job.base)
            else:
                self.pinned.unpin(job.base)

    def _busy_until_now(self) -> None:
        """(Under the lock) adds the time since the last start or job end to read_s if a job
        was in flight all along."""
        now = time.monotonic()
        if self._in_flight:
            self.read_s += now - self._mark
        self._mark = now

    def _job_done(self, entry: _Session, job: _Job, _: object) -> None:
        with self._lock:
            self._busy_until_now()
            self._in_flight -= 1
            self.read_bytes += len(job.indices) * self.block_bytes
            entry.num_done += 1
            self._release(entry)

    def pending_bytes(self) -> int:
        """Bytes of the read aheads held and not done yet."""
        with self._lock:
            return sum(e.num_bytes for e in self._sessions.values()
                       if e.num_done < len(e.jobs))

    def done(self, sid: str) -> bool | None:
        """Whether the session's read ahead is done; None when none is held."""
        with self._lock:
            entry = self._sessions.get(sid)
            return None if entry is None else entry.num_done == len(entry.jobs)

    def wait_any(self, sids: Sequence[str], timeout_s: float) -> None:
        """Wait until one of the sessions' read aheads is done (or none is held), bounded."""
        with self._lock:
            futures = [job.future for s in sids if (e := self._sessions.get(s)) is not None
                       for job in e.jobs if job.future is not None]
        pending, deadline = set(futures), time.monotonic() + timeout_s
        while pending and not any(self.done(s) for s in sids):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            _, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)

    def changed(self, sid: str) -> None:
        """The session's records changed on this rank: what is read ahead of it is stale."""
        with self._lock:
            self._generation[sid] = self._generation.get(sid, 0) + 1
            self._discard(sid)

    def drop(self, sid: str) -> None:
        """Give the session's buffers back (its load is planned, or it will not be loaded)."""
        with self._lock:
            self._discard(sid)

    def _discard(self, sid: str) -> None:
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return
        entry.discarded = True
        self._release(entry)

    def take(self, sid: str, logical_idx: np.ndarray, out: Sequence[np.ndarray],
             hits: np.ndarray) -> None:
        """Copy into out[i] each block logical_idx[i] that a finished job of the session holds
        as a hit read under its current generation; set hits[i] for those."""
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is None or entry.generation != self._generation.get(sid, 0):
                return
            jobs = [job for job in entry.jobs if job.future is not None and job.future.done()]
            entry.readers += 1  # its buffers stay out of the pool until this copy ends
        try:
            served = self._copy_out(jobs, logical_idx, out, hits)
        finally:
            with self._lock:
                entry.readers -= 1
                self._release(entry)
        with self._lock:
            # a change while copying makes this copy stale: the caller reads those again
            if self._generation.get(sid, 0) != entry.generation:
                hits[:] = False
                return
            self.num_served += served

    def lease(self, sid: str, logical_idx: np.ndarray, pinned: bool = True,
              views: bool = False) -> Lease | None:
        """The blocks of `logical_idx` that finished jobs of the session hold as hits read
        under its current generation (`pinned`: in pinned buffers only), held for the caller
        until release(), with their rows as arrays too if `views`; None when there are none."""
        want = np.asarray(logical_idx, dtype=np.int64)
        with self._lock:
            entry = self._sessions.get(sid)
            if entry is None or entry.generation != self._generation.get(sid, 0):
                return None
            jobs = [job for job in entry.jobs if job.future is not None and job.future.done()
                    and (job.pinned or not pinned)]
            taken = np.zeros(len(want), dtype=bool)
            rows, addresses, blocks = [], [], []
            for job, serve, pos in self._matches(jobs, want, taken):
                taken[serve] = True
                rows.append(serve)
                addresses.append(row_addresses(job.buffers, pos))
                if views:  # (about 0.8 us a block, under the GIL)
                    blocks += [job.buffers[int(p)] for p in pos]
            if not rows:
                return None
            entry.readers += 1  # its buffers stay out of the pool until release()
            self.num_served += int(taken.sum())
        return Lease(np.concatenate(rows), np.concatenate(addresses), blocks, entry)

    def release(self, lease: Lease) -> None:
        """Nothing reads the leased blocks any more: their buffers may go back to the pool."""
        with self._lock:
            lease.entry.readers -= 1
            self._release(lease.entry)

    @staticmethod
    def _matches(jobs: list[_Job], want: np.ndarray, skip: np.ndarray
                 ) -> Iterator[tuple[_Job, np.ndarray, np.ndarray]]:
        """For each job that holds hits of `want` not in `skip`: (the job, their positions in
        `want`, their rows in the job)."""
        if not len(want):
            return
        # a step reads a session in chunks, each against all of its jobs: a job whose indices
        # (sorted) lie outside the chunk's is passed over without an array op
        lo, hi = int(want.min()), int(want.max())
        for job in jobs:
            if (not len(job.indices) or int(job.indices[0]) > hi
                    or int(job.indices[-1]) < lo):
                continue
            if job.future is None or job.future.exception() is not None:
                continue
            good = np.asarray(job.future.result(), dtype=bool)
            pos = np.searchsorted(job.indices, want)
            inside = pos < len(job.indices)
            found = np.zeros(len(want), dtype=bool)
            found[inside] = job.indices[pos[inside]] == want[inside]
            found &= ~skip
            found[found] = good[pos[found]]
            serve = np.flatnonzero(found)
            if len(serve):
                yield job, serve, pos[serve]

    def _copy_out(self, jobs: list[_Job], logical_idx: np.ndarray, out: Sequence[np.ndarray],
                  hits: np.ndarray) -> int:
        want = np.asarray(logical_idx, dtype=np.int64)
        served = 0
        for job, serve, rows in self._matches(jobs, want, hits):
            # one compiled call for the job's blocks without the GIL, their addresses computed
            # at once (taking each view's address held the GIL ~2 us a block, beside the
            # step's host work); else one kernel call over the views, else a copy each
            dst = out.addresses(serve) if isinstance(out, BlockViews) else None
            if dst is None or not kernels.copy_addresses(
                    dst, row_addresses(job.buffers, rows), self.block_bytes):
                dsts = [out[int(i)].reshape(-1).view(np.uint8) for i in serve]
                srcs = [job.buffers[int(r)] for r in rows]
                if not kernels.copy_many(dsts, srcs):
                    for d, s in zip(dsts, srcs):
                        np.copyto(d, s)
            hits[serve] = True
            served += len(serve)
        return served

    def close(self) -> None:
        """Stop the jobs; unpin every buffer (nothing may read a lease after this)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            self.pinned.close()  # (before the buffers can be unmapped)
            self._free.clear()
