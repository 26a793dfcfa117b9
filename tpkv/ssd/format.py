"""L3 on-disk format: segment header, block records, commit records, manifests, session ids."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import numpy as np

from tpkv.config import SSD_ALIGN_BYTES, ssd_record_bytes
from tpkv.errors import InvalidSessionIdError, SsdFormatError
from tpkv.ssd.kernels import crc_batch

# Every record starts on this boundary, so O_DIRECT can read and write whole records.
ALIGN_BYTES = SSD_ALIGN_BYTES
FORMAT_VERSION = 1
MAX_SESSION_ID_CHARS = 256

SEGMENT_MAGIC = b"TPKV-SEG"
RECORD_MAGIC = b"TPKV-REC"
COMMIT_MAGIC = b"TPKV-CMT"
MANIFEST_MAGIC = b"TPKV-MAN"

# Fixed 4096-byte headers keep their CRC32C in the last 4 bytes, over bytes [0, 4092).
_CRC_OFFSET = ALIGN_BYTES - 4
HEADER_CRC_BYTES = _CRC_OFFSET  # the bytes of a header its CRC covers
_CRC = struct.Struct("<I")

# magic, version, header_bytes, rank, tp_size, block_bytes, record_bytes, segment id,
# session hash, geometry digest, model digest
_SEGMENT = struct.Struct("<8sIIIIQQQ32s32s32s")
# magic, logical index, payload bytes, payload crc32c, rank, record number, segment id,
# session hash
_RECORD = struct.Struct("<8sqQIIQQ32s")
# magic, version, rank, tp_size, reserved, num_records, committed_bytes, segment id,
# session hash, geometry digest, model digest; then num_records int64 logical indices; then crc32c
_COMMIT = struct.Struct("<8sIIIIQQQ32s32s32s")
# magic, version, tp_size, num_records, session_id_bytes, block_bytes, session hash,
# geometry digest, model digest; then tp_size x (committed_bytes, num_records, segment id); then
# num_records int64 logical indices; then the session id (ASCII); then crc32c
_MANIFEST = struct.Struct("<8sIIIIQ32s32s32s")
_MANIFEST_RANK = struct.Struct("<QQQ")

_SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,256}")


def round_up(num_bytes: int, align_bytes: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // align_bytes) * align_bytes


def digest32(text: str) -> bytes:
    """SHA-256 of a string: how fingerprints and session ids are stored (32 bytes)."""
    return hashlib.sha256(text.encode("utf-8")).digest()


def byte_view(data: np.ndarray | bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of a contiguous array or bytes-like object, without copying."""
    if isinstance(data, np.ndarray):
        return data.data.cast("B")
    return memoryview(data).cast("B")


def crc_of(data: np.ndarray | bytes | bytearray | memoryview) -> int:
    return int(crc32c.crc32c(byte_view(data)))


def crc_many(bufs: Sequence[np.ndarray]) -> list[int]:
    """CRC32C of each buffer (contiguous arrays): one compiled call without the GIL where the
    CPU has SSE4.2 (tpkv.ssd.crc_batch; ~24 GB/s a core on the CPU VM), else one crc32c call
    each."""
    if not bufs:
        return []
    return crc_batch(bufs)


@dataclass(frozen=True)
class SegmentIdentity:
    """Everything a record must match to be served: whose segment, which geometry and model.

    `segment_id` is random per segment file (chosen when it is first written): it binds records,
    header and commit record to one incarnation of the file, so that no stale or restored copy of
    a segment can pair with a newer commit.
    """

    session_hash: bytes
    rank: int
    tp_size: int
    block_bytes: int
    geometry_digest: bytes
    model_digest: bytes
    segment_id: int = 0

    @property
    def record_bytes(self) -> int:
        """Record header plus the payload padded to ALIGN_BYTES."""
        return ssd_record_bytes(self.block_bytes)

    @property
    def pad_bytes(self) -> int:
        return round_up(self.block_bytes) - self.block_bytes

    def committed_bytes(self, num_records: int) -> int:
        return ALIGN_BYTES + num_records * self.record_bytes


def _expect(what: str, checks: tuple[tuple[str, object, object], ...]) -> None:
    """Raise on the first (name, got, want) whose values differ."""
    for name, got, want in checks:
        if got != want:
            raise _fail(what, f"{name} is {_show(got)}, expected {_show(want)}")


def _fail(what: str, detail: str) -> SsdFormatError:
    return SsdFormatError(f"{what}: {detail}")


def _check_block_crc(buf: memoryview, what: str, actual: int | None = None) -> None:
    """`actual`: the CRC32C of buf[:4092] if the caller computed it already."""
    if len(buf) != ALIGN_BYTES:
        raise _fail(what, f"is {len(buf)} bytes, expected {ALIGN_BYTES}")
    (stored,) = _CRC.unpack_from(buf, _CRC_OFFSET)
    if actual is None:
        actual = crc_of(buf[:_CRC_OFFSET])
    if stored != actual:
        raise _fail(what, f"crc32c {actual:#010x} != stored {stored:#010x}")


def _seal_block(buf: memoryview) -> None:
    _CRC.pack_into(buf, _CRC_OFFSET, crc_of(buf[:_CRC_OFFSET]))


def pack_segment_header(ident: SegmentIdentity, out: np.ndarray) -> None:
    """Fill `out` (ALIGN_BYTES uint8) with the segment file header."""
    buf = byte_view(out)
    out[:] = 0
    _SEGMENT.pack_into(
        buf, 0, SEGMENT_MAGIC, FORMAT_VERSION, ALIGN_BYTES, ident.rank, ident.tp_size,
        ident.block_bytes, ident.record_bytes, ident.segment_id, ident.session_hash,
        ident.geometry_digest, ident.model_digest,
    )
    _seal_block(buf)


def check_segment_header(data: np.ndarray | bytes, ident: SegmentIdentity) -> None:
    """Raise SsdFormatError unless `data` is a valid header for exactly `ident`."""
    buf = byte_view(data)
    _check_block_crc(buf, "segment header")
    fields = _SEGMENT.unpack_from(buf, 0)
    expected = (
        SEGMENT_MAGIC, FORMAT_VERSION, ALIGN_BYTES, ident.rank, ident.tp_size,
        ident.block_bytes, ident.record_bytes, ident.segment_id, ident.session_hash,
        ident.geometry_digest, ident.model_digest,
    )
    names = ("magic", "format version", "header bytes", "rank", "tp size", "block bytes",
             "record bytes", "segment id", "session hash", "geometry fingerprint",
             "model fingerprint")
    for name, got, want in zip(names, fields, expected):
        if got != want:
            raise _fail("segment header", f"{name} is {_show(got)}, expected {_show(want)}")


def pack_record_header(
    ident: SegmentIdentity, out: np.ndarray, logical_index: int, payload_crc: int,
    record_no: int,
) -> None:
    """Fill `out` (ALIGN_BYTES uint8) with the header of record number `record_no`."""
    buf = byte_view(out)
    out[:] = 0
    _RECORD.pack_into(buf, 0, RECORD_MAGIC, logical_index, ident.block_bytes, payload_crc,
                      ident.rank, record_no, ident.segment_id, ident.session_hash)
    _seal_block(buf)


def check_record_header(
    data: np.ndarray, ident: SegmentIdentity, logical_index: int, record_no: int,
    header_crc: int | None = None,
) -> int:
    """Validate a record header at position `record_no`; return the payload's CRC32C.
    `header_crc`: the CRC32C of its first HEADER_CRC_BYTES if computed already (crc_many)."""
    buf = byte_view(data)
    what = f"record {record_no} header"
    _check_block_crc(buf, what, header_crc)
    (magic, index, payload_bytes, payload_crc, rank, number, segment_id,
     session_hash) = _RECORD.unpack_from(buf, 0)
    checks = (("magic", magic, RECORD_MAGIC), ("logical index", index, logical_index),
              ("payload bytes", payload_bytes, ident.block_bytes), ("rank", rank, ident.rank),
              ("record number", number, record_no), ("segment id", segment_id, ident.segment_id),
              ("session hash", session_hash, ident.session_hash))
    _expect(what, checks)
    return int(payload_crc)


# A record header's fields where _RECORD packs them, over ALIGN_BYTES per header, and its seal
_RECORD_ROW = np.dtype({
    "names": ["magic", "index", "payload_bytes", "payload_crc", "rank", "number", "segment_id",
              "session_hash", "seal"],
    "formats": [("u1", 8), "<i8", "<u8", "<u4", "<u4", "<u8", "<u8", ("u1", 32), "<u4"],
    "offsets": [0, 8, 16, 24, 28, 32, 40, 48, _CRC_OFFSET], "itemsize": ALIGN_BYTES})


def check_record_headers(headers: np.ndarray, ident: SegmentIdentity, logical: np.ndarray,
                         first_record_no: int, header_crcs: np.ndarray,
                         payload_crcs: np.ndarray) -> np.ndarray:
    """check_record_header for consecutive records at once: `headers` [n, ALIGN_BYTES] uint8
    (contiguous) of records first_record_no.., which must hold `logical`; `header_crcs` and
    `payload_crcs` the CRC32C of each header's first HEADER_CRC_BYTES and of each payload.
    Returns the mask of records that check out (header and payload); the caller takes
    check_record_header's message for the others."""
    n = len(headers)
    rows = np.ascontiguousarray(headers).reshape(-1).view(_RECORD_ROW)[:n]
    magic = np.frombuffer(RECORD_MAGIC, np.uint8)
    session = np.frombuffer(ident.session_hash, np.uint8)
    return ((rows["seal"] == np.asarray(header_crcs, np.uint32))
            & (rows["magic"] == magic).all(axis=1)
            & (rows["index"] == np.asarray(logical, np.int64))
            & (rows["payload_bytes"] == ident.block_bytes)
            & (rows["rank"] == ident.rank)
            & (rows["number"] == np.arange(first_record_no, first_record_no + n, dtype=np.uint64))
            & (rows["segment_id"] == ident.segment_id)
            & (rows["session_hash"] == session).all(axis=1)
            & (rows["payload_crc"] == np.asarray(payload_crcs, np.uint32)))


@dataclass(frozen=True)
class CommitRecord:
    """One rank's committed state of one session: records [0, num_records) are durable."""

    num_records: int
    committed_bytes: int
    logical_indices: np.ndarray
    segment_id: int


def pack_commit(ident: SegmentIdentity, logical_indices: np.ndarray) -> bytes:
    indices = np.ascontiguousarray(logical_indices, dtype="<i8")
    num_records = len(indices)
    head = _COMMIT.pack(COMMIT_MAGIC, FORMAT_VERSION, ident.rank, ident.tp_size, 0, num_records,
                        ident.committed_bytes(num_records), ident.segment_id, ident.session_hash,
                        ident.geometry_digest, ident.model_digest)
    body = head + indices.tobytes()
    return body + _CRC.pack(crc_of(body))


def parse_commit(data: bytes, ident: SegmentIdentity) -> CommitRecord:
    """Parse and validate a commit record written for exactly `ident`."""
    what = f"rank {ident.rank} commit record"
    if len(data) < _COMMIT.size + _CRC.size:
        raise _fail(what, f"is {len(data)} bytes, shorter than {_COMMIT.size + _CRC.size}")
    _check_tail_crc(data, what)
    (magic, version, rank, tp_size, _reserved, num_records, committed_bytes, segment_id,
     session_hash, geometry_digest, model_digest) = _COMMIT.unpack_from(data, 0)
    expected_len = _COMMIT.size + 8 * num_records + _CRC.size
    checks = (("magic", magic, COMMIT_MAGIC), ("format version", version, FORMAT_VERSION),
              ("rank", rank, ident.rank), ("tp size", tp_size, ident.tp_size),
              ("length", len(data), expected_len),
              ("committed bytes", committed_bytes, ident.committed_bytes(num_records)),
              ("session hash", session_hash, ident.session_hash),
              ("geometry fingerprint", geometry_digest, ident.geometry_digest),
              ("model fingerprint", model_digest, ident.model_digest))
    _expect(what, checks)
    indices = np.frombuffer(data, dtype="<i8", count=num_records, offset=_COMMIT.size)
    return CommitRecord(int(num_records), int(committed_bytes), indices.astype(np.int64),
                        int(segment_id))


@dataclass(frozen=True)
class Manifest:
    """A session complete on every rank: each rank's durable prefix and the shared indices."""

    session_id: str
    committed_bytes: tuple[int, ...]
    num_records: tuple[int, ...]
    segment_ids: tuple[int, ...]
    logical_indices: np.ndarray


def pack_manifest(
    ident: SegmentIdentity, session_id: str, commits: list[CommitRecord],
) -> bytes:
    """`ident.rank` is ignored; `commits[r]` is rank r's commit record."""
    id_bytes = session_id.encode("ascii")
    indices = np.ascontiguousarray(commits[0].logical_indices, dtype="<i8")
    head = _MANIFEST.pack(MANIFEST_MAGIC, FORMAT_VERSION, ident.tp_size, len(indices),
                          len(id_bytes), ident.block_bytes, ident.session_hash,
                          ident.geometry_digest, ident.model_digest)
    ranks = b"".join(_MANIFEST_RANK.pack(c.committed_bytes, c.num_records, c.segment_id)
                     for c in commits)
    body = head + ranks + indices.tobytes() + id_bytes
    return body + _CRC.pack(crc_of(body))


def parse_manifest(data: bytes, ident: SegmentIdentity) -> Manifest:
    """Parse and validate a manifest; `ident.session_hash` may be the hash in the file's name."""
    what = "manifest"
    if len(data) < _MANIFEST.size + _CRC.size:
        raise _fail(what, f"is {len(data)} bytes, shorter than {_MANIFEST.size + _CRC.size}")
    _check_tail_crc(data, what)
    (magic, version, tp_size, num_records, id_bytes, block_bytes, session_hash, geometry_digest,
     model_digest) = _MANIFEST.unpack_from(data, 0)
    expected_len = (_MANIFEST.size + tp_size * _MANIFEST_RANK.size + 8 * num_records + id_bytes
                    + _CRC.size)
    checks = (("magic", magic, MANIFEST_MAGIC), ("format version", version, FORMAT_VERSION),
              ("tp size", tp_size, ident.tp_size), ("length", len(data), expected_len),
              ("block bytes", block_bytes, ident.block_bytes),
              ("session hash", session_hash, ident.session_hash),
              ("geometry fingerprint", geometry_digest, ident.geometry_digest),
              ("model fingerprint", model_digest, ident.model_digest))
    _expect(what, checks)
    offset = _MANIFEST.size
    committed: list[int] = []
    counts: list[int] = []
    segment_ids: list[int] = []
    for rank in range(tp_size):
        rank_bytes, rank_records, segment_id = _MANIFEST_RANK.unpack_from(data, offset)
        offset += _MANIFEST_RANK.size
        if rank_records != num_records or rank_bytes != ident.committed_bytes(num_records):
            raise _fail(what, f"rank {rank} holds {rank_records} records / {rank_bytes} bytes, "
                        f"expected {num_records} / {ident.committed_bytes(num_records)}")
        committed.append(int(rank_bytes))
        counts.append(int(rank_records))
        segment_ids.append(int(segment_id))
    indices = np.frombuffer(data, dtype="<i8", count=num_records, offset=offset)
    offset += 8 * num_records
    try:
        session_id = bytes(data[offset:offset + id_bytes]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise _fail(what, f"session id is not ASCII: {exc}") from exc
    if not _SESSION_ID_RE.fullmatch(session_id) or digest32(session_id) != session_hash:
        raise _fail(what, f"session id of {id_bytes} bytes does not match its hash")
    return Manifest(session_id, tuple(committed), tuple(counts), tuple(segment_ids),
                    indices.astype(np.int64))


def _check_tail_crc(data: bytes, what: str) -> None:
    (stored,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    actual = crc_of(memoryview(data)[:-_CRC.size])
    if stored != actual:
        raise _fail(what, f"crc32c {actual:#010x} != stored {stored:#010x}")


def _show(value: object) -> str:
    if isinstance(value, bytes):
        return value[:8].hex() + ("..." if len(value) > 8 else "")
    return str(value)


def validate_session_id(session_id: object) -> str:
    """Return `session_id` if it matches ^[A-Za-z0-9._:-]{1,256}$, else InvalidSessionIdError."""
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a str, got {type(session_id).__name__}")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_CHARS:
        raise InvalidSessionIdError(
            f"session id has {len(session_id)} characters, allowed 1..{MAX_SESSION_ID_CHARS}")
    if not _SESSION_ID_RE.fullmatch(session_id):
        pos, char = next((i, c) for i, c in enumerate(session_id)
                         if not _SESSION_ID_RE.fullmatch(c))
        raise InvalidSessionIdError(
            f"session id has character {char!r} (U+{ord(char):04X}) at position {pos} of "
            f"{len(session_id)}; allowed are A-Z a-z 0-9 . _ : -")
    return session_id
