"""One rank's host copies of vLLM KV blocks, keyed by chain key, in a HostPool allocated once,
over an optional disk tier; every read checks the record."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.prefix_index import KEY_BYTES, block_key
from tpkv.integrations.vllm.crc_jobs import CrcJobs
from tpkv.integrations.vllm.disk_writer import DiskWriter
from tpkv.integrations.vllm.host_slots import HostSlots
from tpkv.integrations.vllm.record import BlockRecord, data_problem, record_problems

log = logging.getLogger(__name__)

HELD = -1  # reserve: the key is held already
REFUSED = -2  # reserve: the key is not the one of its parent and tokens


class HostBlockStore:
    """Blocks in host memory, at most `capacity_bytes` of them, put and dropped as the scheduler's
    index says. A read (`take`) returns a block only when the record checks out: its key is the
    one asked, the key recomputed from its parent and tokens is that key, its shape is the
    rank's block shape and its CRC32C matches; anything else is a miss (the caller recomputes).

    The memory is a HostSlots pool of `capacity_bytes // block_bytes` slots, allocated at start
    (pinned where CUDA is present): nothing here allocates a block's memory again, and the
    budget holds however the blocks come and go. A record in memory holds its slot; so does a
    write queued for disk, and every record `take` or `hold_for_load` handed out, until its
    holder calls `release`: a slot is filled once, when taken free, so a holder's bytes never
    change under it, and a slot held only by a load still counts against the budget.

    With a `disk` tier, the least recently used blocks move to disk. With `queue_blocks` > 0 a
    DiskWriter thread writes them: once more than `capacity - queue_blocks` blocks are in
    memory, the oldest are queued (at most queue_blocks), still holding their slots and served
    from memory until written; a put that finds no free slot gives up the oldest queued write
    (or, with none queued, the oldest block) instead of waiting, and `take_lost` names the keys
    so given up, for the index to forget (the writer counts and logs them; `queue_bytes`, the
    disk_queue_bytes in effect, names the setting in its warning). With queue_blocks 0 the move
    is a write on the caller's path. A read that misses in memory reads the disk and brings
    the block back into memory as the most recently used when a slot is free (otherwise the
    caller gets a copy of its own). Its record stays on disk, marked as cached: moving the
    block out again writes nothing, and the disk gives up such records first when it needs
    room (the block then lives in memory only)."""

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
        self.slots = HostSlots(block_shape, self.capacity_blocks)
        self._crcs = CrcJobs(self.slots)
        self.disk = disk
        self.writer = (DiskWriter(disk, queue_blocks, queue_bytes, release=self.release)
                       if disk is not None and queue_blocks else None)
        self._lock: contextlib.AbstractContextManager[Any] = (
            self.writer.lock if self.writer is not None else contextlib.nullcontext())
        self._records: dict[bytes, BlockRecord] = {}  # oldest use first
        self._reserved: dict[bytes, tuple[int, bytes, tuple[int, ...]]] = {}  # key: slot, ...
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
        """Bytes of the slots held: blocks in memory, queued for disk, or held by a load."""
        return self.slots.num_used * self.block_bytes

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

    def put(self, key: bytes, parent: bytes, tokens: Sequence[int], data: np.ndarray) -> bool:
        """Keep a copy of `data` (the block as [layers, page_bytes] uint8): reserve, fill and
        admit in one call (the copier reserves a step's blocks and copies them at once);
        False (nothing kept) when it has the wrong shape or dtype, or `reserve` refuses it. A
        key held already, in memory or on disk, is kept as it is (True)."""
        problem = data_problem(data, self.block_shape)
        if problem:
            log.warning("tpkv vLLM store: block %s %s; not kept", key.hex(), problem)
            return False
        slot = self.reserve(key, parent, tokens)
        if slot is None:
            self.full(key)
        if slot is None or slot < 0:
            return slot == HELD
        self.slots.view(slot)[...] = data
        self.admit([key])
        return True

    def reserve(self, key: bytes, parent: bytes, tokens: Sequence[int]) -> int | None:
        """First half of a save in two (the caller fills the slot, `slots.view(slot)`, then
        calls `admit([key, ...])`, or `cancel(key)`): a free slot for the block, `HELD` when
        memory or disk holds the key already (or a reservation does; kept as it is),
        `REFUSED` (nothing kept, with a warning) when the key is not the one of parent and
        tokens, None when no slot can be freed (every slot held, or no disk tier: `full` says
        so)."""
        if key in self._records or key in self._reserved:
            return HELD
        with self._lock:
            if self.writer is not None and self.writer.pending(key) is not None:
                return HELD
            if self.disk is not None and self.disk.touch(key):
                return HELD  # not written again
        if len(key) != KEY_BYTES or block_key(parent, tokens) != key:
            log.warning("tpkv vLLM store: key %s is not the key of its parent and %d tokens; "
                        "not kept", key.hex(), len(tokens))
            return REFUSED
        slot = self.slots.take() if self._make_room() else None
        if slot is not None:
            self._reserved[key] = (slot, parent, tuple(tokens))
        return slot

    def full(self, key: bytes) -> None:
        """Say that `key` was not kept for want of a slot."""
        log.warning("tpkv vLLM store: full (%d of %d bytes held, %d by blocks being saved); "
                    "block %s not kept", self.used_bytes, self.capacity_bytes,
                    len(self._reserved) * self.block_bytes, key.hex())

    def admit(self, keys: Sequence[bytes]) -> None:
        """Second half of a save: the reserved slots now hold these blocks; each is kept as
        the most recently used, its CRC32C pending (taken by the CrcJobs thread)."""
        got = [self._reserved.pop(key) for key in keys]
        crcs = self._crcs.start([slot for slot, _, _ in got])
        for key, (slot, parent, tokens), crc in zip(keys, got, crcs):
            self._records[key] = BlockRecord(key, parent, tokens, self.slots.view(slot), crc,
                                             slot)
        self._queue_oldest()

    def cancel(self, key: bytes) -> None:
        """A reservation not filled: its slot is free again."""
        slot, _, _ = self._reserved.pop(key)
        self.slots.release(slot)

    def take(self, keys: Sequence[bytes]) -> list[BlockRecord | None]:
        """Each block's record, checked, for the caller to read until it calls `release(rec)`:
        from memory (a block queued for disk included) or else from disk; None on a miss or a
        record that does not check out (which is dropped). The CRC32Cs of the records in
        memory are taken at once (record_problems)."""
        recs = [self._hold(key) for key in keys]
        todo = [i for i, (rec, check) in enumerate(recs) if rec is not None and check]
        problems = record_problems([(keys[i], recs[i][0]) for i in todo  # type: ignore[misc]
                                    ], self.block_shape)
        out = [rec for rec, _ in recs]
        for i, problem in zip(todo, problems):
            if problem:
                self.reject(keys[i], problem)
                self.release(recs[i][0])  # type: ignore[arg-type]
                out[i] = None
        if todo:
            self._queue_oldest()
        return out

    def _hold(self, key: bytes) -> tuple[BlockRecord | None, bool]:
        """(the key's record, held for the caller; whether its bytes still need their check):
        one in memory, or queued for disk, is made the most recently used and needs it; one
        read from disk was checked as it was read."""
        rec = self._records.pop(key, None)
        if rec is None and self.writer is not None:
            with self._lock:
                rec = self.writer.take_back(key)  # its write not made: memory holds it again
                running = None if rec is not None else self.writer.pending(key)
                if running is not None:
                    self._ref(running)  # before the writer can let its slot go
            if running is not None:
                return running, True
        if rec is None:
            return self._take_from_disk(key), False
        self._records[key] = rec  # most recently used
        self._ref(rec)
        return rec, True

    def get(self, key: bytes) -> np.ndarray | None:
        """A copy of the block's bytes (see `take`), for inspection and tests."""
        rec = self.take([key])[0]
        if rec is None:
            return None
        data = rec.data.copy()
        self.release(rec)
        return data

    def release(self, rec: BlockRecord) -> None:
        """A holder of `rec` (from take, hold_for_load, or a queued write) is done with it."""
        if rec.slot >= 0:
            self.slots.release(rec.slot)

    def hold_for_load(self, key: bytes) -> tuple[BlockRecord | None, bool]:
        """For a load that reads the key later, on another thread: (its record, unchecked and
        held until `release`, when memory holds it, made the most recently used; whether the
        disk record was pinned instead: not deleted for room until release_load)."""
        rec = self._records.pop(key, None)
        if rec is not None:
            self._records[key] = rec
            self._ref(rec)
            return rec, False
        with self._lock:
            rec = self.writer.pending(key) if self.writer is not None else None
            if rec is not None:
                self._ref(rec)
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

    def drop(self, key: bytes) -> bool:
        rec = self._records.pop(key, None)
        with self._lock:
            if rec is not None:
                self.release(rec)
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
        """Finish the CRC jobs and the queued writes, then give up the disk tier's directory
        and the memory."""
        self._crcs.close()
        if self.writer is not None and not self.writer.close():
            return  # still writing from a slot: the memory and the lock go with the process
        if self.disk is not None:
            self.disk.close()
        self.slots.close()

    def record(self, key: bytes) -> BlockRecord | None:
        """The raw record, in memory or queued for disk, its CRC32C taken (for tests and
        inspection; `take` is the checked read)."""
        self._crcs.wait()
        rec = self._records.get(key)
        if rec is None and self.writer is not None:
            with self._lock:
                rec = self.writer.pending(key)
        return rec

    def _ref(self, rec: BlockRecord) -> None:
        if rec.slot >= 0:
            self.slots.ref(rec.slot)

    def reject(self, key: bytes, problem: str) -> None:
        """A held record of `key` did not check out (`problem`, from record_problems): it is
        counted, logged and dropped (the holder still releases it)."""
        self.num_bad_reads += 1
        log.warning("tpkv vLLM store: block %s is not served: %s", key.hex(), problem)
        self.drop(key)  # a write of it under way is deleted once made

    def _take_from_disk(self, key: bytes) -> BlockRecord | None:
        disk = self.disk
        if disk is None:
            return None
        slot = None
        with self._lock:
            got = disk.get_record(key)
            if got is None:
                return None
            head, data = got
            slot = self.slots.take()
            if slot is not None:
                disk.mark_cached(key)  # the record stays: moving the block out again is free
        if slot is None:  # no room in memory: the caller's own copy
            return BlockRecord(key, head.parent, head.tokens, data, head.data_crc)
        view = self.slots.view(slot)
        view[...] = data
        rec = BlockRecord(key, head.parent, head.tokens, view, head.data_crc, slot)
        self._records[key] = rec
        self._ref(rec)  # the caller's hold beside the index's
        self.num_promoted += 1
        self._queue_oldest()
        return rec

    def _make_room(self) -> bool:
        """A free slot; with a writer, by giving up the oldest queued write (or the oldest
        block), never by waiting for the disk (only for the CRC jobs under way); without, by
        writing the oldest block to disk. False when none can be freed (every slot held by a
        load or a write under way)."""
        if not self.slots.num_free:
            self._crcs.wait()  # a CRC job's hold would hide the slot a drop frees
        while not self.slots.num_free:
            if self.writer is not None:
                with self._lock:
                    key = self.writer.drop_oldest()
                if key is None and self._records:
                    key = next(iter(self._records))
                    rec = self._records.pop(key)
                    self.release(rec)
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
        capacity - max_jobs of them and the queue has room (their slots go with them)."""
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
                    self.release(rec)
                else:
                    writer.submit(rec)  # checked by the writer before writing
                self.num_spilled += 1

    def _spill_oldest(self, disk: DiskBlockStore) -> None:
        """Move the least recently used block to disk; one that fails its check, or whose
        write fails, is dropped (and named by take_lost)."""
        key = next(iter(self._records))
        rec = self._records.pop(key)
        try:
            problem = record_problems([(key, rec)], self.block_shape)[0]
            if problem:
                self.num_bad_reads += 1
                log.warning("tpkv vLLM store: block %s is not moved to disk: %s", key.hex(),
                            problem)
            elif disk.put(key, rec.parent, rec.tokens, rec.data):
                self.num_spilled += 1
                return
            self._lost.append(key)
        finally:
            self.release(rec)
