"""One rank's host copies of vLLM KV blocks, keyed by chain key, over an optional disk tier;
every read checks the record."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.prefix_index import KEY_BYTES, block_key
from tpkv.ssd.format import crc_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockRecord:
    """A stored block: its key, the parent key and tokens it was made from, its bytes
    ([layers, page_bytes] uint8) and their CRC32C."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    data: np.ndarray
    crc: int


class HostBlockStore:
    """Blocks in host memory, at most `capacity_bytes` of them, put and dropped as the scheduler's
    index says. `get` returns a block's bytes only when the record checks out: its key is the one
    asked, the key recomputed from its parent and tokens is that key, its shape is the rank's
    block shape and its CRC32C matches; anything else is a miss (the caller recomputes).

    With a `disk` tier, a put into a full store first moves the least recently used host block
    (one that checks out) to disk, and a get that misses in memory reads the disk; a block read
    from disk stays there (it is not brought back into memory)."""

    def __init__(self, capacity_bytes: int, block_shape: tuple[int, int],
                 disk: DiskBlockStore | None = None) -> None:
        check_int("capacity_bytes", capacity_bytes)
        check_int("num_layers", block_shape[0])
        check_int("page_bytes", block_shape[1])
        self.capacity_bytes = capacity_bytes
        self.block_shape = block_shape
        self.block_bytes = block_shape[0] * block_shape[1]
        if capacity_bytes < self.block_bytes:
            raise ConfigError(f"host_bytes {capacity_bytes} holds no block of {self.block_bytes} "
                              f"bytes ({block_shape[0]} layers of {block_shape[1]})")
        if disk is not None and disk.layout.block_shape != block_shape:
            raise ConfigError(f"disk tier blocks are {disk.layout.block_shape}, host blocks "
                              f"{block_shape}")
        self.disk = disk
        self._records: dict[bytes, BlockRecord] = {}  # oldest use first
        self.num_bad_reads = 0
        self.num_spilled = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def used_bytes(self) -> int:
        return len(self._records) * self.block_bytes

    def keys(self) -> list[bytes]:
        """Keys held in memory, least recently used first."""
        return list(self._records)

    def in_memory(self, key: bytes) -> bool:
        return key in self._records

    def holds(self, key: bytes) -> bool:
        """Whether memory or disk holds the key."""
        return key in self._records or (self.disk is not None and key in self.disk)

    def put(self, key: bytes, parent: bytes, tokens: tuple[int, ...], data: np.ndarray) -> bool:
        """Keep a copy of `data`; False (nothing kept) when it has the wrong shape or dtype, the
        key is not the one of parent and tokens, or the store is full (and has no disk tier). A
        key held already, in memory or on disk, is kept as it is (True)."""
        if key in self._records:
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
        while self.disk is not None and self._records and (
                self.used_bytes + self.block_bytes > self.capacity_bytes):
            self._spill_oldest(self.disk)
        if self.used_bytes + self.block_bytes > self.capacity_bytes:
            log.warning("tpkv vLLM store: full (%d of %d bytes); block %s not kept",
                        self.used_bytes, self.capacity_bytes, key.hex())
            return False
        copy = np.array(data, dtype=np.uint8, copy=True, order="C")
        self._records[key] = BlockRecord(key, parent, tuple(tokens), copy, crc_of(copy))
        return True

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes ([layers, page_bytes] uint8, not to be written), from memory or
        else from disk, or None on a miss or a record that does not check out (which is
        dropped)."""
        rec = self._records.pop(key, None)
        if rec is None:
            return self.disk.get(key) if self.disk is not None else None
        problem = self._check(key, rec)
        if problem:
            self.num_bad_reads += 1
            log.warning("tpkv vLLM store: block %s is not served: %s", key.hex(), problem)
            return None
        self._records[key] = rec  # most recently used
        return rec.data

    def drop(self, key: bytes) -> bool:
        if self._records.pop(key, None) is not None:
            return True
        return self.disk is not None and self.disk.drop(key)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _spill_oldest(self, disk: DiskBlockStore) -> None:
        """Move the least recently used block to disk; one that fails its check, or whose
        write fails, is dropped (a later load of it is a miss)."""
        key = next(iter(self._records))
        rec = self._records.pop(key)
        problem = self._check(key, rec)
        if problem:
            self.num_bad_reads += 1
            log.warning("tpkv vLLM store: block %s is not moved to disk: %s", key.hex(), problem)
        elif disk.put(key, rec.parent, rec.tokens, rec.data):
            self.num_spilled += 1

    def record(self, key: bytes) -> BlockRecord | None:
        """The raw record (for tests and inspection; `get` is the checked read)."""
        return self._records.get(key)

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
