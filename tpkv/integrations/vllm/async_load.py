"""A rank's background loads: blocks read from host memory or disk into vLLM's KV cache on a
thread of its own, while vLLM's steps go on.

`submit` (on vLLM's worker thread, in start_load_kv) holds each block's record when host memory
holds it (its slot is not reused until the job ends), or pins its disk record (not deleted for
room until read), so nothing a later step stores or drops can take a block from under the load;
a key dropped outright (the index forgot it) is a miss. The thread then reads the pinned ones
from disk, checks the held records outside the lock, all at once, and copies the blocks into
the request's vLLM blocks (those are the request's alone, and vLLM neither reads nor frees them
before every rank named the request finished). On a GPU the copies run on the thread's stream
after what vLLM's stream held at submit (it zeroes freshly allocated blocks there). A job is
done once every block is in the KV cache (on a GPU, once its copy stream is synchronized);
`take_done` hands finished jobs back to the worker thread, which reports them to vLLM with
their failed blocks.
A job submitted `inline` (the scheduler's plan says so in a step without a forward) runs the
same way on the caller's thread instead, done when submit returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tpkv.integrations.vllm.copy_thread import CopyThread
from tpkv.integrations.vllm.plan import LoadSpec, StepReport
from tpkv.integrations.vllm.record import record_problems

if TYPE_CHECKING:
    from tpkv.integrations.vllm.record import BlockRecord
    from tpkv.integrations.vllm.store import HostBlockStore

log = logging.getLogger(__name__)



@dataclass
class LoadJob:
    """One request's background load on one rank, and what came of it."""

    spec: LoadSpec
    held: list[tuple[BlockRecord | None, bool]]  # per block: HostBlockStore.hold_for_load
    report: StepReport = field(default_factory=StepReport)
    failed_block_ids: set[int] = field(default_factory=set)
    loaded_blocks: int = 0
    disk_blocks: int = 0
    # On a GPU: recorded on the submitting thread's stream at submit, so the copies come after
    # what vLLM queued there for these blocks before (it zeroes freshly allocated blocks)
    start_event: Any = None


class BackgroundLoader(CopyThread[LoadJob]):
    """Runs LoadJobs one after the other on a daemon thread. `store` is the rank's store (None:
    every block fails), `lock` what every call into it holds, `copy_in(block_ids, records,
    stream)` writes held records into those vLLM blocks (on `stream` on a GPU; None: done on
    return), `fail(job, pos)` records a failed block."""

    def __init__(self, store: HostBlockStore | None, lock: threading.RLock,
                 copy_in: Callable[[list[int], list[BlockRecord], Any], None],
                 fail: Callable[[LoadJob, int], None], device: torch.device, rank: int) -> None:
        self.store = store
        self.lock = lock
        self.copy_in = copy_in
        self.fail = fail
        self._done: list[LoadJob] = []
        self._done_lock = threading.Lock()
        super().__init__(device)
        self._start(f"tpkv-loader-rank{rank}")

    def submit(self, spec: LoadSpec, inline: bool = False) -> None:
        """Start the load of `spec` on the thread, or with `inline` run it now on the
        caller's (done when this returns)."""
        held: list[tuple[BlockRecord | None, bool]] = [(None, False)] * len(spec.keys)
        if self.store is not None:
            with self.lock:
                held = [self.store.hold_for_load(key) for key in spec.keys]
        job = LoadJob(spec, held)
        if inline:
            self._run_job(job, None)
            return
        job.start_event = self._caller_event()
        self._jobs.put(job)

    def take_done(self) -> list[LoadJob]:
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def _run_job(self, job: LoadJob, stream: Any) -> None:
        """Load `job` (on `stream` when the KV cache is on a GPU; the caller's copies are
        synchronous without one) and hand it to take_done, failed blocks and all."""
        try:
            if stream is None:
                copied = self._load(job)
            else:
                if job.start_event is not None:
                    stream.wait_event(job.start_event)
                with torch.cuda.stream(stream):
                    copied = self._load(job, stream)
                stream.synchronize()
            job.loaded_blocks = copied
        except Exception:  # a block not known to be in place is a failed one
            log.exception("tpkv vLLM connector: background load of request %s failed",
                          job.spec.req_id)
            self._give_up(job)
            if stream is not None:  # copies issued may still read the held records
                stream.synchronize()
        finally:
            self._release(job)
        with self._done_lock:
            self._done.append(job)

    def _load(self, job: LoadJob, stream: Any = None) -> int:
        """Check or read each block, then copy them all in; a miss or a record that does not
        check out is a failed block (vLLM recomputes from the request's first one). Nothing
        is copied before every block was read, so on an error no block is in place. The
        records held in memory are checked outside the lock, all at once (their bytes do not
        change while held)."""
        store = self.store
        if store is None:
            for pos in range(len(job.spec.keys)):
                self.fail(job, pos)
            return 0
        keys = job.spec.keys
        check = [pos for pos, (rec, _) in enumerate(job.held) if rec is not None]
        with self.lock:
            for pos, key in enumerate(keys):
                rec, pinned = job.held[pos]
                if pinned:
                    store.release_load(key)
                if rec is None:
                    got = store.take([key])[0]  # checked as it is taken
                    job.held[pos] = (got, False)  # released with the others when the job ends
                    if got is not None:
                        job.report.disk_loads.setdefault(job.spec.req_id, set()).add(
                            job.spec.first_block + pos)
                        job.disk_blocks += 1
                else:
                    job.held[pos] = (rec, False)
        problems = record_problems(
            [(keys[pos], job.held[pos][0]) for pos in check],  # type: ignore[misc]
            store.block_shape)
        bad = {pos: problem for pos, problem in zip(check, problems) if problem}
        if bad:
            with self.lock:
                for pos, problem in bad.items():
                    store.reject(keys[pos], problem)
        block_ids: list[int] = []
        recs: list[BlockRecord] = []
        for pos, (rec, _) in enumerate(job.held):
            if rec is None or pos in bad:
                self.fail(job, pos)
                continue
            block_ids.append(job.spec.block_ids[pos])
            recs.append(rec)
        self.copy_in(block_ids, recs, stream)
        return len(recs)

    def _give_up(self, job: LoadJob) -> None:
        """After an error: every block of the job failed (none is known to be in place: the
        copies come after every read), and the disk pins still held go."""
        for pos in range(len(job.spec.keys)):
            self.fail(job, pos)
            rec, pinned = job.held[pos]
            if pinned and self.store is not None:
                with self.lock:
                    self.store.release_load(job.spec.keys[pos])
                job.held[pos] = (rec, False)

    def _release(self, job: LoadJob) -> None:
        """The job is over: the records it held may be reused."""
        if self.store is None:
            return
        with self.lock:
            for rec, _ in job.held:
                if rec is not None:
                    self.store.release(rec)
        job.held = [(None, pinned) for _, pinned in job.held]
