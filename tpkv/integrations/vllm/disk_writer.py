"""Writes a rank's host blocks to its disk tier on a thread of its own, off the step's path.

The host store hands over the blocks it moves out of memory (`submit`); they stay in memory,
and are served from there, until their record is written. The queue holds at most `max_jobs`
blocks (the store counts them against its host budget), and nothing here ever waits on the
step's behalf: when the store needs room the oldest queued write is dropped (`drop_oldest`), a
block the index drops while queued is never written (`cancel`), and one dropped while its
record is being written is deleted once written, so the disk never keeps a record the index
gave up. Writes that fail, or whose block no longer checks out, are reported by `take_lost`.
Every call into the DiskBlockStore, from either thread, holds `lock`; the file write itself
does not.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpkv.checks import check_int
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.ssd.format import crc_of

if TYPE_CHECKING:
    from tpkv.integrations.vllm.record import BlockRecord

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0


@dataclass
class _Job:
    rec: BlockRecord
    cancelled: bool = False


class DiskWriter:
    """One background writer of block records into `disk` (see the module docstring)."""

    def __init__(self, disk: DiskBlockStore, max_jobs: int) -> None:
        check_int("max_jobs", max_jobs)
        self.disk = disk
        self.max_jobs = max_jobs
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._queue: OrderedDict[bytes, _Job] = OrderedDict()  # oldest first
        self._running: _Job | None = None
        self._lost: list[bytes] = []
        self._closing = False
        self.num_written = 0
        self.num_failed = 0
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
        key, _ = self._queue.popitem(last=False)
        return key

    def cancel(self, key: bytes) -> bool:
        """The index dropped the key: a queued write is not made, a running one is deleted
        once written. False when the key is neither queued nor being written."""
        if self._queue.pop(key, None) is not None:
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
                if reserved and crc_of(rec.data) != rec.crc:
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
                    self._changed.notify_all()
