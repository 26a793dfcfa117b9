"""On-disk record of one content-addressed KV block: checked head, tokens, then the block bytes.

A record is the file `<root>/rank<R>/<key hex>.blk`: the head (magic, format version, rank,
layers, tokens per block, page bytes, the model's chain seed, the block's key and parent key,
CRC32C of the block bytes), the block's tokens (int64), CRC32C of all that, then the block
([layers, page_bytes] uint8). Everything little-endian. It is written whole to `<name>.tmp`,
fsynced and renamed, so a crash leaves the old record, the new one or a `.tmp` (removed at the
next start); any other damage fails a check and the block is a miss.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpkv.checks import check_int
from tpkv.errors import ConfigError, SsdFormatError
from tpkv.integrations.prefix_index import KEY_BYTES, block_key
from tpkv.ssd.format import crc_of

MAGIC = b"TPKV-VBK"
FORMAT_VERSION = 1
SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"
NAME_RE = re.compile(r"([0-9a-f]{32})\.blk")
# magic, version, rank, num_layers, block_tokens, page_bytes, seed, key, parent, data crc32c
HEAD = struct.Struct("<8sIIIIQ16s16s16sI")
_CRC = struct.Struct("<I")
_MAX_TOKENS = 1 << 20  # a head naming more tokens than this is damaged


@dataclass(frozen=True)
class DiskLayout:
    """What one rank's records hold: the model's chain seed (model fingerprint and block size),
    the rank, tokens per block and the block's shape ([layers, page_bytes] uint8)."""

    seed: bytes
    rank: int
    block_tokens: int
    block_shape: tuple[int, int]

    def __post_init__(self) -> None:
        if not isinstance(self.seed, bytes) or len(self.seed) != KEY_BYTES:
            raise ConfigError(f"seed must be {KEY_BYTES} bytes, got {self.seed!r}")
        check_int("rank", self.rank, lo=0)
        check_int("block_tokens", self.block_tokens)
        check_int("num_layers", self.block_shape[0])
        check_int("page_bytes", self.block_shape[1])

    @property
    def head_bytes(self) -> int:
        return HEAD.size + 8 * self.block_tokens + _CRC.size

    @property
    def data_bytes(self) -> int:
        return self.block_shape[0] * self.block_shape[1]

    @property
    def record_bytes(self) -> int:
        """Bytes of one record file on disk (what the disk cap counts)."""
        return self.head_bytes + self.data_bytes


def record_bytes(block_tokens: int, block_bytes: int) -> int:
    """Bytes of one record of a block of `block_bytes` and `block_tokens` tokens."""
    return HEAD.size + 8 * block_tokens + _CRC.size + block_bytes


def rank_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"rank{rank}")


def pack(layout: DiskLayout, key: bytes, parent: bytes, tokens: Sequence[int],
         data: np.ndarray) -> bytes:
    """The record's bytes."""
    toks = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    head = HEAD.pack(MAGIC, FORMAT_VERSION, layout.rank, layout.block_shape[0],
                     layout.block_tokens, layout.block_shape[1], layout.seed, key, parent,
                     crc_of(np.ascontiguousarray(data)))
    head += toks
    return head + _CRC.pack(crc_of(head)) + np.ascontiguousarray(data).tobytes()


@dataclass(frozen=True)
class Head:
    """A record's head, its own CRC checked (the block bytes not yet)."""

    version: int
    rank: int
    num_layers: int
    block_tokens: int
    page_bytes: int
    seed: bytes
    key: bytes
    parent: bytes
    data_crc: int
    tokens: tuple[int, ...]

    def mismatch(self, layout: DiskLayout, shape: bool = True) -> str:
        """Why a record with this head is not one of `layout`'s ('' when it is): another format
        version, rank, model or block size, or (with `shape`) another block shape."""
        if self.version != FORMAT_VERSION:
            return f"format version {self.version}, expected {FORMAT_VERSION}"
        if self.rank != layout.rank:
            return f"rank {self.rank}, expected {layout.rank}"
        if self.seed != layout.seed or self.block_tokens != layout.block_tokens:
            return (f"another model or block size (seed {self.seed.hex()}, "
                    f"{self.block_tokens} tokens a block)")
        if shape and (self.num_layers, self.page_bytes) != layout.block_shape:
            return (f"block of {self.num_layers} x {self.page_bytes} bytes, expected "
                    f"{layout.block_shape[0]} x {layout.block_shape[1]}")
        return ""


def parse_head(buf: bytes | bytearray | memoryview) -> Head:
    """The head at the start of `buf` (SsdFormatError if it is short or damaged)."""
    if len(buf) < HEAD.size:
        raise SsdFormatError(f"record is {len(buf)} bytes, shorter than its {HEAD.size}-byte head")
    (magic, version, rank, layers, ntok, page, seed, key, parent,
     data_crc) = HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise SsdFormatError(f"magic {bytes(magic)!r}, expected {MAGIC!r}")
    if ntok > _MAX_TOKENS:
        raise SsdFormatError(f"head names {ntok} tokens a block, above {_MAX_TOKENS}")
    end = HEAD.size + 8 * ntok
    if len(buf) < end + _CRC.size:
        raise SsdFormatError(f"record is {len(buf)} bytes, shorter than its "
                             f"{end + _CRC.size}-byte head")
    (crc,) = _CRC.unpack_from(buf, end)
    if crc_of(memoryview(buf)[:end]) != crc:
        raise SsdFormatError(f"head CRC32C {crc_of(memoryview(buf)[:end]):#010x}, recorded "
                             f"{crc:#010x}")
    tokens = tuple(int(t) for t in np.frombuffer(buf, dtype="<i8", count=ntok, offset=HEAD.size))
    return Head(version, rank, layers, ntok, page, bytes(seed), bytes(key), bytes(parent),
                data_crc, tokens)


def head_length(buf: bytes | bytearray | memoryview) -> int:
    """Bytes of the head that starts `buf` (its fixed part must be there)."""
    return HEAD.size + 8 * int(HEAD.unpack_from(buf, 0)[4]) + _CRC.size


def check_record(layout: DiskLayout, key: bytes, buf: bytes | bytearray | memoryview) -> Head:
    """The head of a whole record that is `key`'s block for `layout`; SsdFormatError naming
    what does not check out (size, head, identity, key, tokens, block CRC32C)."""
    if len(buf) != layout.record_bytes:
        raise SsdFormatError(f"record is {len(buf)} bytes, expected {layout.record_bytes}")
    head = parse_head(buf)
    why = head.mismatch(layout)
    if why:
        raise SsdFormatError(why)
    if head.key != key:
        raise SsdFormatError(f"record holds key {head.key.hex()}")
    if block_key(head.parent, head.tokens) != key:
        raise SsdFormatError("its parent and tokens hash to another key")
    crc = crc_of(memoryview(buf)[layout.head_bytes:])
    if crc != head.data_crc:
        raise SsdFormatError(f"block CRC32C {crc:#010x}, recorded {head.data_crc:#010x}")
    return head
