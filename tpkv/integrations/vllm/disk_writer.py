"""Writes a rank's host blocks to its disk tier on a thread of its own, off the step's path.

The host store hands over the blocks it moves out of memory (`submit`); they stay in memory,
and are served from there, until their record is written. The queue holds at most `max_jobs`
blocks (the store counts them against its host budget), and nothing here ever waits on the
step's behalf: when the store needs room the oldest queued write is dropped (`drop_oldest`), a
block the index drops while queued is never written (`cancel`), and one dropped while its
record is being written is deleted once written, so the disk never keeps a record the index
gave up. Writes that fail, or whose block no longer checks out, are reported by `take_lost`.
A queued block holds the store's slot until its job ends (`release` is called once per block
handed over, however it ends; `take_back` hands the hold back to the store instead).
Blocks given up because the queue was full are counted (`num_dropped`, `bytes_dropped`) and
logged as a warning naming disk_queue_bytes and the bytes the writer needed: at the first drop,
then at most every `warn_interval_s` with the running count, and once more at close.
Every call into the DiskBlockStore, from either thread, holds `lock`; the file write itself
does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpkv.checks import check_int
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.vllm.record import crc_value
from tpkv.ssd.format import crc_of

if TYPE_CHECKING:
    from tpkv.integrations.vllm.record import BlockRecord

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
DROP_WARN_INTERVAL_S = 60.0  # at most one warning about dropped blocks this often


@dataclass
class _Job:
    rec: BlockRecord
    cancelled: bool = False


class DiskWriter:
    """One background writer of block records into `disk` (see the module docstring).
    `queue_bytes`: the disk_queue_bytes setting in effect, for the drop warning only;
    `release(rec)`: called, with `lock` held, when a block handed over is done with."""

    def __init__(self, disk: DiskBlockStore, max_jobs: int, queue_bytes: int | None = None,
                 warn_interval_s: float = DROP_WARN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 release: Callable[[BlockRecord], None] = lambda rec: None) -> None:
        check_int("max_jobs", max_jobs)
        self.disk = disk
        self.release = release
        self.max_jobs = max_jobs
        self.queue_bytes = queue_bytes
        self.warn_interval_s = warn_interval_s
        self.clock = clock
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._queue: OrderedDict[bytes, _Job] = OrderedDict()  # oldest first
        self._running: _Job | None = None
        self._lost: list[bytes] = []
        self._closing = False
        self.num_written = 0
        self.num_failed = 0
        self.num_dropped = 0  # blocks given up unwritten because the queue was full
        self.bytes_dropped = 0
        self.peak_needed_bytes = 0  # the most the queue would have had to hold to drop none
        self._burst_dropped = 0  # blocks dropped since the writer was last idle
        self._warned_at: float | None = None
        self._unwarned = 0  # drops since the last warning
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tpkv-disk-writer-rank{disk.layout.rank}")
        self._thread.start()

    # Every method below but close() and flush() is called with `lock` held.

    def __len__(self) -> int:
        """Blocks queued or being written (still in memory)."""
        return len(self._queue) + (self._running is not None)

    @property
    def has_room(self) -> bool:
        return len(self) < self.max_jobs

    def submit(self, rec: BlockRecord) -> None:
        """Queue a block's write (the caller checked has_room)."""
        self._queue[rec.key] = _Job(rec)
        self._changed.notify_all()

    def pending(self, key: bytes) -> BlockRecord | None:
        """The record of a block queued or being written (and not cancelled)."""
        job = self._queue.get(key)
        if job is None and self._running is not None and self._running.rec.key == key:
            job = self._running
        return None if job is None or job.cancelled else job.rec

    def take_back(self, key: bytes) -> BlockRecord | None:
        """Take a queued (not yet started) block out of the queue, its write not made."""
        job = self._queue.pop(key, None)
        return None if job is None else job.rec

    def drop_oldest(self) -> bytes | None:
        """Give up the oldest queued write; its key (None when nothing is queued)."""
        if not self._queue:
            return None
        queued = len(self)
        key, job = self._queue.popitem(last=False)
        self.release(job.rec)
        self.count_drop(job.rec.data.nbytes, queued)
        return key

    def count_drop(self, nbytes: int, queued: int | None = None) -> None:
        """Count a block of `nbytes` given up for room while `queued` blocks (default: those
        now) waited for the writer, and warn (see the module docstring)."""
        self.num_dropped += 1
        self.bytes_dropped += nbytes
        self._burst_dropped += 1
        self._unwarned += 1
        # what the queue would hold had it dropped nothing since it was last empty
        needed = ((len(self) if queued is None else queued) + self._burst_dropped) * nbytes
        self.peak_needed_bytes = max(self.peak_needed_bytes, needed)
        now = self.clock()
        if self._warned_at is None or now - self._warned_at >= self.warn_interval_s:
            self._warned_at = now
            self._warn_drops()

    def _warn_drops(self) -> None:
        self._unwarned = 0
        setting = ("disk_queue_bytes is not known" if self.queue_bytes is None
                   else f"disk_queue_bytes is {self.queue_bytes}")
        log.warning("tpkv disk tier rank %d: the disk write queue was full: %d blocks (%d bytes) "
                    "given up unwritten so far (the index forgets them; prompts that need them "
                    "recompute them). %s (%d blocks); the writer needed %d bytes to keep up: "
                    "raise disk_queue_bytes (a part of host_bytes) or use a faster disk",
                    self.disk.layout.rank, self.num_dropped, self.bytes_dropped, setting,
                    self.max_jobs, self.peak_needed_bytes)

    def cancel(self, key: bytes) -> bool:
        """The index dropped the key: a queued write is not made, a running one is deleted
        once written. False when the key is neither queued nor being written."""
        job = self._queue.pop(key, None)
        if job is not None:
            self.release(job.rec)
            return True
        if self._running is not None and self._running.rec.key == key:
            if self._running.cancelled:
                return False
            self._running.cancelled = True
            return True
        return False

    def take_lost(self) -> list[bytes]:
        """Keys whose write failed since the last call (memory no longer holds them either)."""
        lost, self._lost = self._lost, []
        return lost

    # ---- without the lock ----------------------------------------------------------------

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and self._running is None,
                                          timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Write what is queued, then stop the thread; False when it did not stop in time."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            if self._unwarned:  # drops since the last warning: said once more
                self._warn_drops()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tpkv disk tier rank %d: the writer did not finish %d queued writes "
                        "in %.0f s", self.disk.layout.rank, len(self), timeout_s)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue) or self._closing)
                if not self._queue:
                    return
                _, job = self._queue.popitem(last=False)
                self._running = job
                rec = job.rec
                reserved = written = False
                try:
                    reserved = self.disk.reserve(rec.key, rec.parent, rec.tokens, rec.data)
                except Exception:  # never let one block stop the writer
                    log.exception("tpkv disk tier: making room for block %s failed",
                                  rec.key.hex())
            try:
                if reserved and crc_of(rec.data) != crc_value(rec):
                    log.warning("tpkv disk tier: block %s changed in memory (CRC32C); not "
                                "written", rec.key.hex())
                elif reserved:
                    written = self.disk.write(rec.key, rec.parent, rec.tokens, rec.data)
            except Exception:
                log.exception("tpkv disk tier: writing block %s failed", rec.key.hex())
            with self._changed:
                try:
                    if reserved:
                        self.disk.finish(rec.key, written)
                    if written and job.cancelled:
                        self.disk.drop(rec.key)
                    elif written:
                        self.num_written += 1
                    elif not job.cancelled:
                        self.num_failed += 1
                        self._lost.append(rec.key)
                finally:
                    self._running = None
                    self.release(rec)
                    if not self._queue:  # idle: a later drop starts a new burst
                        self._burst_dropped = 0
                    self._changed.notify_all()
