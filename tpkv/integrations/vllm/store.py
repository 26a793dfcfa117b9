"""One rank's host copies of vLLM KV blocks, keyed by chain key, over an optional disk tier;
every read checks the record."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.prefix_index import KEY_BYTES, block_key
from tpkv.integrations.vllm.disk_writer import DiskWriter
from tpkv.integrations.vllm.record import BlockRecord
from tpkv.ssd.format import crc_of

log = logging.getLogger(__name__)


class HostBlockStore:
    """Blocks in host memory, at most `capacity_bytes` of them, put and dropped as the scheduler's
    index says. `get` returns a block's bytes only when the record checks out: its key is the one
    asked, the key recomputed from its parent and tokens is that key, its shape is the rank's
    block shape and its CRC32C matches; anything else is a miss (the caller recomputes).

    With a `disk` tier, the least recently used blocks move to disk. With `queue_blocks` > 0 a
    DiskWriter thread writes them: once more than `capacity - queue_blocks` blocks are in
    memory, the oldest are queued (at most queue_blocks), still counted against the capacity
    and served from memory until written; a put that finds no room gives up the oldest queued
    write (or, with none queued, the oldest block) instead of waiting, and `take_lost` names
    the keys so given up, for the index to forget (the writer counts and logs them;
    `queue_bytes`, the disk_queue_bytes in effect, names the setting in its warning). With
    queue_blocks 0 the move is a write on
    the caller's path. A get that misses in memory reads the disk and brings the block back
    into memory as the most recently used when memory has free room (with a writer it keeps
    queue_blocks free; without, a full memory takes none). Its record stays on disk, marked
    as cached: moving the block out again writes nothing, and the disk gives up such records
    first when it needs room (the block then lives in memory only)."""

    def __init__(self, capacity_bytes: int, block_shape: tuple[int, int],
                 disk: DiskBlockStore | None = None, queue_blocks: int = 0,
                 queue_bytes: int | None = None) -> None:
        check_int("capacity_bytes", capacity_bytes)
        check_int("num_layers", block_shape[0])
        check_int("page_bytes", block_shape[1])
        check_int("queue_blocks", queue_blocks, lo=0)
        self.capacity_bytes = capacity_bytes
        self.block_shape = block_shape
        self.block_bytes = block_shape[0] * block_shape[1]
        self.capacity_blocks = capacity_bytes // self.block_bytes
        if capacity_bytes < self.block_bytes:
            raise ConfigError(f"host_bytes {capacity_bytes} holds no block of {self.block_bytes} "
                              f"bytes ({block_shape[0]} layers of {block_shape[1]})")
        if disk is not None and disk.layout.block_shape != block_shape:
            raise ConfigError(f"disk tier blocks are {disk.layout.block_shape}, host blocks "
                              f"{block_shape}")
        if disk is not None and queue_blocks >= self.capacity_blocks:
            raise ConfigError(f"a disk write queue of {queue_blocks} blocks leaves no room in "
                              f"host_bytes {capacity_bytes} ({self.capacity_blocks} blocks of "
                              f"{self.block_bytes} bytes)")
        self.disk = disk
        self.writer = (DiskWriter(disk, queue_blocks, queue_bytes)
                       if disk is not None and queue_blocks else None)
        self._lock: contextlib.AbstractContextManager[Any] = (
            self.writer.lock if self.writer is not None else contextlib.nullcontext())
        self._records: dict[bytes, BlockRecord] = {}  # oldest use first
        self._lost: list[bytes] = []
        self.num_bad_reads = 0
        self.num_spilled = 0  # blocks moved to disk (queued, with a writer)
        self.num_dropped = 0  # blocks given up for room before they were written
        self.num_promoted = 0  # blocks brought back from disk

    def __len__(self) -> int:
        return len(self._records)

    @property
    def lock(self) -> contextlib.AbstractContextManager[Any]:
        """What every call into the disk tier holds (the writer's lock; none without one)."""
        return self._lock

    @property
    def num_pending(self) -> int:
        """Blocks queued for disk or being written: in memory, counted in used_bytes."""
        if self.writer is None:
            return 0
        with self._lock:
            return len(self.writer)

    @property
    def used_bytes(self) -> int:
        return (len(self._records) + self.num_pending) * self.block_bytes

    def keys(self) -> list[bytes]:
        """Keys held in memory, least recently used first (not those queued for disk)."""
        return list(self._records)

    def in_memory(self, key: bytes) -> bool:
        """Whether memory holds the key (as a block or a block queued for disk)."""
        if key in self._records:
            return True
        with self._lock:
            return self.writer is not None and self.writer.pending(key) is not None

    def holds(self, key: bytes) -> bool:
        """Whether memory or disk holds the key."""
        if self.in_memory(key):
            return True
        with self._lock:
            return self.disk is not None and key in self.disk

    def put(self, key: bytes, parent: bytes, tokens: tuple[int, ...], data: np.ndarray) -> bool:
        """Keep a copy of `data`; False (nothing kept) when it has the wrong shape or dtype, the
        key is not the one of parent and tokens, or the store is full (and has no disk tier). A
        key held already, in memory or on disk, is kept as it is (True)."""
        if key in self._records:
            return True
        with self._lock:
            if self.writer is not None and self.writer.pending(key) is not None:
                return True
            if self.disk is not None and key in self.disk:
                return self.disk.put(key, parent, tokens, data)  # touched, not written again
        if data.shape != self.block_shape or data.dtype != np.uint8:
            log.warning("tpkv vLLM store: block %s has shape %s %s, expected %s uint8; not kept",
                        key.hex(), data.shape, data.dtype, self.block_shape)
            return False
        if len(key) != KEY_BYTES or block_key(parent, tokens) != key:
            log.warning("tpkv vLLM store: key %s is not the key of its parent and %d tokens; "
                        "not kept", key.hex(), len(tokens))
            return False
        if not self._make_room():
            log.warning("tpkv vLLM store: full (%d of %d bytes); block %s not kept",
                        self.used_bytes, self.capacity_bytes, key.hex())
            return False
        copy = np.array(data, dtype=np.uint8, copy=True, order="C")
        self._records[key] = BlockRecord(key, parent, tuple(tokens), copy, crc_of(copy))
        self._queue_oldest()
        return True

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes ([layers, page_bytes] uint8, not to be written), from memory (a
        block queued for disk included) or else from disk, or None on a miss or a record that
        does not check out (which is dropped)."""
        rec = self._records.pop(key, None)
        if rec is None and self.writer is not None:
            with self._lock:
                rec = self.writer.take_back(key)  # its write not made: memory holds it again
                running = None if rec is not None else self.writer.pending(key)
            if running is not None:
                return self._checked(key, running)
        if rec is None:
            return self._get_from_disk(key)
        data = self._checked(key, rec)
        if data is not None:
            self._records[key] = rec  # most recently used
            self._queue_oldest()
        return data

    def hold_for_load(self, key: bytes) -> tuple[BlockRecord | None, bool]:
        """For a load that reads the key later, on another thread: (its record, unchecked,
        when memory holds it, made the most recently used; whether the disk record was
        pinned instead: not deleted for room until release_load). The record stays valid
        whatever happens to the key after (records are never written to)."""
        rec = self._records.pop(key, None)
        if rec is not None:
            self._records[key] = rec
            return rec, False
        with self._lock:
            rec = self.writer.pending(key) if self.writer is not None else None
            if rec is not None:
                return rec, False
            if self.disk is not None and key in self.disk:
                self.disk.pin(key)
                return None, True
        return None, False

    def release_load(self, key: bytes) -> None:
        """The disk record hold_for_load pinned may be deleted for room again."""
        if self.disk is not None:
            with self._lock:
                self.disk.unpin(key)

    def checked(self, key: bytes, rec: BlockRecord) -> np.ndarray | None:
        """A held record's bytes when it checks out (see the class docstring), else None and
        the key is dropped."""
        return self._checked(key, rec)

    def drop(self, key: bytes) -> bool:
        in_memory = self._records.pop(key, None) is not None
        with self._lock:
            if in_memory:
                if self.disk is not None and self.disk.is_cached(key):
                    self.disk.drop(key)
                return True
            if self.writer is not None and self.writer.cancel(key):
                return True
            return self.disk is not None and self.disk.drop(key)

    def take_lost(self) -> list[bytes]:
        """Keys given up since the last call (a queued write dropped for room or failed, an
        oldest block dropped with nothing queued): neither memory nor disk holds them."""
        lost, self._lost = self._lost, []
        if self.writer is not None:
            with self._lock:
                lost += self.writer.take_lost()
        return lost

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (True at once without a writer)."""
        return self.writer is None or self.writer.flush(timeout_s)

    def close(self) -> None:
        """Finish the queued writes, then give up the disk tier's directory."""
        if self.writer is not None and not self.writer.close():
            return  # still writing: the directory's lock goes with the process
        if self.disk is not None:
            self.disk.close()

    def record(self, key: bytes) -> BlockRecord | None:
        """The raw record, in memory or queued for disk (for tests and inspection; `get` is the
        checked read)."""
        rec = self._records.get(key)
        if rec is None and self.writer is not None:
            with self._lock:
                rec = self.writer.pending(key)
        return rec

    def _checked(self, key: bytes, rec: BlockRecord) -> np.ndarray | None:
        problem = self._check(key, rec)
        if not problem:
            return rec.data
        self.num_bad_reads += 1
        log.warning("tpkv vLLM store: block %s is not served: %s", key.hex(), problem)
        self.drop(key)  # a write of it under way is deleted once made
        return None

    def _get_from_disk(self, key: bytes) -> np.ndarray | None:
        disk = self.disk
        if disk is None:
            return None
        with self._lock:
            got = disk.get_record(key)
            if got is None:
                return None
            head, data = got
            free = self.capacity_blocks - len(self._records) - (
                len(self.writer) if self.writer is not None else 0)
            if free > 0:
                disk.mark_cached(key)  # the record stays: moving the block out again is free
        if free > 0:
            self._records[key] = BlockRecord(key, head.parent, head.tokens, data, head.data_crc)
            self.num_promoted += 1
            self._queue_oldest()
        return data

    def _make_room(self) -> bool:
        """Room for one more block; with a writer, by giving up the oldest queued write (or
        the oldest block), never by waiting; without, by writing the oldest block to disk."""
        while self.used_bytes + self.block_bytes > self.capacity_bytes:
            if self.writer is not None:
                with self._lock:
                    key = self.writer.drop_oldest()
                if key is None and self._records:
                    key = next(iter(self._records))
                    del self._records[key]
                    with self._lock:
                        if self.disk is not None and self.disk.is_cached(key):
                            self.disk.mark_cached(key, False)  # on disk still: not lost
                            continue
                        self.writer.count_drop(self.block_bytes)  # the writer is still busy
                if key is None:
                    return False
                self._lost.append(key)
                self.num_dropped += 1
            elif self.disk is not None and self._records:
                self._spill_oldest(self.disk)
            else:
                return False
        return True

    def _queue_oldest(self) -> None:
        """With a writer: queue the oldest blocks for disk while memory holds more than
        capacity - max_jobs of them and the queue has room."""
        writer = self.writer
        if writer is None:
            return
        with self._lock:
            while (len(self._records) > self.capacity_blocks - writer.max_jobs
                   and writer.has_room):
                key = next(iter(self._records))
                rec = self._records.pop(key)
                if writer.disk.is_cached(key):
                    writer.disk.mark_cached(key, False)  # its record is on disk already
                else:
                    writer.submit(rec)  # checked by the writer before writing
                self.num_spilled += 1

    def _spill_oldest(self, disk: DiskBlockStore) -> None:
        """Move the least recently used block to disk; one that fails its check, or whose
        write fails, is dropped (and named by take_lost)."""
        key = next(iter(self._records))
        rec = self._records.pop(key)
        problem = self._check(key, rec)
        if problem:
            self.num_bad_reads += 1
            log.warning("tpkv vLLM store: block %s is not moved to disk: %s", key.hex(), problem)
        elif disk.put(key, rec.parent, rec.tokens, rec.data):
            self.num_spilled += 1
            return
        self._lost.append(key)

    def _check(self, key: bytes, rec: BlockRecord) -> str:
        if rec.key != key:
            return f"record holds key {rec.key.hex()}"
        if block_key(rec.parent, rec.tokens) != key:
            return "its parent and tokens hash to another key"
        if rec.data.shape != self.block_shape or rec.data.dtype != np.uint8:
            return f"shape {rec.data.shape} {rec.data.dtype}, expected {self.block_shape} uint8"
        crc = crc_of(rec.data)
        if crc != rec.crc:
            return f"CRC32C {crc:#010x}, recorded {rec.crc:#010x}"
        return ""
