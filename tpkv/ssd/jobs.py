"""An L3 rank's threads: readers, writers, one committer, one dropper; reads go before writes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from tpkv.errors import SsdIoError

log = logging.getLogger(__name__)

T = TypeVar("T")

# A write waits at most this long per piece for reads to end, so that a run of reads cannot hold
# a spill back for ever (a resume may wait on that spill's L2 slots).
_PAUSE_MAX_S = 1.0


@dataclass
class ReadStats:
    """What this rank's L3 reads took: jobs (read_blocks calls), bytes asked, the jobs' time on
    their threads summed, and of it the time inside the record reads' syscalls."""

    jobs: int = 0
    bytes: int = 0
    job_s: float = 0.0
    syscall_s: float = 0.0


class ReadMeter:
    """Counts the read jobs of a rank, their bytes and their time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs = self._bytes = self._ns = 0
        self.step_blocks = 0  # blocks a step's reads took from the disk, not a read ahead

    def step_read(self, num_blocks: int) -> None:
        with self._lock:
            self.step_blocks += num_blocks

    def add(self, num_bytes: int, began_ns: int) -> None:
        """One job of `num_bytes` asked, begun at perf_counter_ns() `began_ns`, ends now."""
        with self._lock:
            self._jobs += 1
            self._bytes += num_bytes
            self._ns += time.perf_counter_ns() - began_ns

    def stats(self, syscall_ns: int) -> ReadStats:
        with self._lock:
            return ReadStats(self._jobs, self._bytes, self._ns / 1e9, syscall_ns / 1e9)


class ReadsFirst:
    """Reads of a rank's store go before its writes: a write, between its pieces, waits (up to
    _PAUSE_MAX_S a piece) while any read is submitted and not done. On the H200's disk, a
    resume's reads beside a spill of the same size ran at about half the disk's read speed.

    Except while someone waits for writes (`writes_first`: a step whose copies into L2 need
    slots a spill still reads): then no write pauses, since under a steady run of reads
    (prefetches staged step after step) a paused spill would hold that step for seconds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reads = 0
        self._urgent = 0  # callers inside writes_first()
        self.num_pauses = 0  # pieces that waited for reads
        self.num_urgent = 0  # writes_first() entries

    def begin(self) -> None:
        with self._cond:
            self._reads += 1

    def end(self, *_: object) -> None:
        with self._cond:
            self._reads -= 1
            if not self._reads:
                self._cond.notify_all()

    @contextmanager
    def reading(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    @contextmanager
    def writes_first(self) -> Iterator[None]:
        """Writes do not pause for reads inside this block (and those paused now go on)."""
        with self._cond:
            self._urgent += 1
            self.num_urgent += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._urgent -= 1

    def pause(self) -> None:
        with self._cond:
            if self._reads and not self._urgent:
                self.num_pauses += 1
                self._cond.wait_for(lambda: not self._reads or self._urgent > 0,
                                    timeout=_PAUSE_MAX_S)


class StoreThreads:
    """The thread pools of rank `rank`'s store, its reads-first gate, and the deletes pending on
    its drop thread (by session hash, hex): a later call about such a session waits for its
    delete first (await_drop)."""

    def __init__(self, rank: int, io_threads: int, write_threads: int) -> None:
        self.readers = ThreadPoolExecutor(io_threads, thread_name_prefix=f"tpkv-l3-r{rank}")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix=f"tpkv-l3-w{rank}")
        # drop_later: one thread deletes sessions' files in the order asked
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix=f"tpkv-l3-drop-r{rank}")
        # manifest commits (two fsyncs each) off the caller's thread, in order
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"tpkv-l3-commit-r{rank}")
        self.gate = ReadsFirst()
        self._lock = threading.Lock()  # guards _dropping
        self._dropping: dict[str, Future[int]] = {}  # session hash (hex) -> its pending delete

    def read(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """`fn` on a reader thread. Writes pause from this call on, not from when a reader
        takes the job up."""
        self.gate.begin()
        try:
            fut = self.readers.submit(fn, *args)
        except BaseException:
            self.gate.end()
            raise
        fut.add_done_callback(self.gate.end)
        return fut

    def write(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._writers.submit(fn, *args)

    def commit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """`fn` on the commit thread (one, so in the order submitted)."""
        return self._committer.submit(fn, *args)

    def drop_later(self, key: str, fn: Callable[..., int], *args: Any) -> None:
        """`fn`, the delete of session `key`, on the drop thread (one, so in the order asked)."""
        with self._lock:
            self._dropping[key] = self._janitor.submit(fn, *args)

    def await_drop(self, key: str) -> None:
        """Wait for a pending delete of session `key`; its error (SsdIoError) if it failed."""
        with self._lock:
            fut = self._dropping.get(key)
        if fut is None:
            return
        try:
            fut.result()
        finally:
            with self._lock:
                if self._dropping.get(key) is fut:
                    del self._dropping[key]

    def await_drops(self) -> None:
        """Wait for every pending delete (a failed one is logged)."""
        with self._lock:
            keys = list(self._dropping)
        for key in keys:
            try:
                self.await_drop(key)
            except SsdIoError as exc:
                log.warning("%s", exc)

    def shutdown(self) -> None:
        """Finish every submitted job (pending deletes too)."""
        self._committer.shutdown(wait=True)
        self._janitor.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self.readers.shutdown(wait=True)
