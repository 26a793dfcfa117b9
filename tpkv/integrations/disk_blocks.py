"""One rank's disk tier of content-addressed KV blocks: record files, LRU, under a byte cap.

Records (disk_format.py) live in `<root>/rank<R>/`; the rank owns that directory through
tpkv's L3 owner lock (`<root>/owner.r<R>.lock`, tpkv/ssd/owner.py), so two live processes never
write one rank's records. A new process with the same root, model and block size finds the
records an earlier one left and serves them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpkv.checks import check_int
from tpkv.errors import ConfigError, SsdError, SsdFormatError
from tpkv.integrations.disk_format import (
    HEAD,
    NAME_RE,
    SUFFIX,
    TMP_SUFFIX,
    DiskLayout,
    Head,
    check_record,
    head_length,
    pack,
    parse_head,
    rank_dir,
)
from tpkv.integrations.prefix_index import KEY_BYTES, block_key
from tpkv.ssd.fsutil import atomic_write, unlink_missing_ok
from tpkv.ssd.owner import RootLock

log = logging.getLogger(__name__)

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def prepare_dir(root: str, rank: int) -> str:
    """Create `<root>/rank<R>` and prove a file can be made in it; ConfigError naming the path
    and the OS error otherwise. Returns the rank's directory."""
    if not isinstance(root, (str, os.PathLike)) or not str(root).strip():
        raise ConfigError(f"disk_dir must be a directory path, got {root!r}")
    path = rank_dir(os.path.realpath(root), rank)
    probe = os.path.join(path, f".probe-{os.getpid()}{TMP_SUFFIX}")
    try:
        os.makedirs(path, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW, 0o644))
        unlink_missing_ok(probe)  # a rank's start-up scan may have removed it already
    except OSError as exc:
        raise ConfigError(f"disk_dir {str(root)!r}: cannot create and write {path!r}: "
                          f"{exc.strerror or exc} (errno {exc.errno})") from exc
    return path


def check_disk_bytes(capacity_bytes: int, record_bytes: int, block_bytes: int) -> int:
    """Blocks a disk cap holds; ConfigError when it holds none."""
    check_int("disk_bytes", capacity_bytes)
    if capacity_bytes < record_bytes:
        raise ConfigError(f"disk_bytes {capacity_bytes} holds no block record of {record_bytes} "
                          f"bytes ({block_bytes} bytes of KV and a {record_bytes - block_bytes}"
                          f"-byte head)")
    return capacity_bytes // record_bytes


def _read(path: str, limit: int) -> bytearray:
    """A whole file of at most `limit` bytes (SsdFormatError if larger, OSError if absent)."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise SsdFormatError(f"record is {size} bytes, above the {limit}-byte limit")
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        while done < size:
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                break
            done += n
        return buf[:done] if done < size else buf
    finally:
        os.close(fd)


def _read_head(path: str) -> bytes:
    """The head of a record file (its fixed part, then as many token bytes as it names)."""
    with open(path, "rb", opener=lambda p, f: os.open(p, f | _O_NOFOLLOW)) as f:
        fixed = f.read(HEAD.size)
        if len(fixed) < HEAD.size:
            raise SsdFormatError(f"record is {len(fixed)} bytes, shorter than its head")
        parse_len = head_length(fixed)
        return fixed + f.read(max(parse_len - HEAD.size, 0))


@dataclass
class _Found:
    mtime_ns: int
    key: bytes
    path: str
    size: int


def scan(directory: str, layout: DiskLayout, shape: bool = True, remove: bool = False
         ) -> tuple[list[_Found], list[_Found]]:
    """Records in a rank directory: (layout's own, others), each oldest first by mtime. Own:
    a whole head of the layout under its key's name, of the record size (`shape`: of the
    layout's block shape too). Others: heads of another model, block size, shape or format
    version. With `remove`, `.tmp` files (torn writes) and damaged records are deleted."""
    ours: list[_Found] = []
    others: list[_Found] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return ours, others
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            continue
        if entry.name.endswith(TMP_SUFFIX):
            if remove:
                unlink_missing_ok(entry.path)
            continue
        m = NAME_RE.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            head = parse_head(_read_head(entry.path))
        except (OSError, SsdError) as exc:
            log.warning("tpkv disk tier: %s is damaged (%s)%s", entry.path, exc,
                        "; removed" if remove else "")
            if remove:
                unlink_missing_ok(entry.path)
            continue
        found = _Found(st.st_mtime_ns, bytes.fromhex(m.group(1)), entry.path, st.st_size)
        own = (not head.mismatch(layout, shape) and head.key == found.key
               and (not shape or st.st_size == layout.record_bytes))
        (ours if own else others).append(found)
    ours.sort(key=lambda f: f.mtime_ns)
    others.sort(key=lambda f: f.mtime_ns)
    return ours, others


def stored_keys(root: str, seed: bytes, block_tokens: int, num_ranks: int) -> list[bytes]:
    """Keys every rank's directory under `root` holds a record of (this model and block size),
    oldest first by rank 0's mtimes; read-only (the scheduler's view at start)."""
    keys: list[bytes] | None = None
    held: set[bytes] = set()
    for rank in range(num_ranks):
        layout = DiskLayout(seed, rank, block_tokens, (1, 1))
        ours, _ = scan(rank_dir(os.path.realpath(root), rank), layout, shape=False)
        if keys is None:
            keys = [f.key for f in ours]
            held = set(keys)
        else:
            held &= {f.key for f in ours}
    return [k for k in keys or [] if k in held]


class DiskBlockStore:
    """One rank's block records under `root`, at most `capacity_bytes` of record files (a write
    makes room first: records of other models or formats, then those host memory holds too
    (mark_cached), then the least recently used). `get` serves a block only when its whole
    record checks out (disk_format.check_record); a damaged record is deleted and is a miss.
    A pinned key (a background load is to read it) is never deleted for room; `drop` still
    deletes it. The lock is held until close()."""

    def __init__(self, root: str, capacity_bytes: int, layout: DiskLayout,
                 model_fingerprint: str = "") -> None:
        self.layout = layout
        self.record_bytes = layout.record_bytes
        self.capacity_blocks = check_disk_bytes(capacity_bytes, self.record_bytes,
                                                layout.data_bytes)
        self.capacity_bytes = capacity_bytes
        self.dir = prepare_dir(root, layout.rank)
        self._owner = RootLock(os.path.realpath(root), layout.rank, model_fingerprint)
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # our records, oldest use first
        # held keys whose block host memory holds too (mark_cached): the first to go for room
        self._cached: OrderedDict[bytes, None] = OrderedDict()
        self._others: OrderedDict[str, int] = OrderedDict()  # path -> size, oldest first
        self._pins: Counter[bytes] = Counter()
        self.used_bytes = 0
        self.num_bad_reads = 0
        self.num_evicted = 0
        try:
            ours, others = scan(self.dir, layout, remove=True)
            for f in ours:
                self._lru[f.key] = None
            for f in others:
                self._others[f.path] = f.size
            self.used_bytes = len(self._lru) * self.record_bytes + sum(self._others.values())
            self._make_room(0)
        except BaseException:
            self._owner.release()
            raise
        log.info("tpkv disk tier rank %d: %d blocks (%d bytes of %d) found in %s",
                 layout.rank, len(self._lru), self.used_bytes, capacity_bytes, self.dir)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        return list(self._lru)

    def path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def put(self, key: bytes, parent: bytes, tokens: Sequence[int], data: np.ndarray) -> bool:
        """Write a block's record, durably, after making room; False (nothing kept) when the
        block is not the layout's, the key is not its parent's and tokens', or the write
        fails. A key held already is kept as it is (True)."""
        if self.touch(key):
            return True
        if not self.reserve(key, parent, tokens, data):
            return False
        ok = self.write(key, parent, tokens, data)
        self.finish(key, ok)
        return ok

    def touch(self, key: bytes) -> bool:
        """Whether the key is held; a held one becomes the most recently used, and the disk
        holds the only copy of it again (no longer marked cached)."""
        if key not in self._lru:
            return False
        self._lru.move_to_end(key)
        self._cached.pop(key, None)
        return True

    def reserve(self, key: bytes, parent: bytes, tokens: Sequence[int],
                data: np.ndarray) -> bool:
        """First step of a put in three (reserve, write, finish; a background writer runs the
        write without holding its lock): check the block and make room, counting its record's
        bytes. False (nothing counted) when the block is not the layout's, its key is not its
        parent's and tokens', or no room can be made."""
        if data.shape != self.layout.block_shape or data.dtype != np.uint8:
            log.warning("tpkv disk tier: block %s has shape %s %s, expected %s uint8; not kept",
                        key.hex(), data.shape, data.dtype, self.layout.block_shape)
            return False
        if (len(key) != KEY_BYTES or len(tokens) != self.layout.block_tokens
                or block_key(parent, tokens) != key):
            log.warning("tpkv disk tier: key %s is not the key of its parent and %d tokens; "
                        "not kept", key.hex(), len(tokens))
            return False
        if not self._make_room(self.record_bytes):
            return False
        self.used_bytes += self.record_bytes
        return True

    def write(self, key: bytes, parent: bytes, tokens: Sequence[int], data: np.ndarray) -> bool:
        """Write a reserved block's record file (touches no state of the store)."""
        path = self.path(key)
        try:
            atomic_write(path, pack(self.layout, key, parent, tokens, data), path + TMP_SUFFIX)
        except OSError as exc:
            log.warning("tpkv disk tier: writing block %s to %s failed: %s; not kept",
                        key.hex(), path, exc)
            return False
        return True

    def finish(self, key: bytes, written: bool) -> None:
        """Last step of a put: hold the key when its record was written, else stop counting
        the bytes reserve() counted."""
        if written:
            self._lru[key] = None
        else:
            self.used_bytes -= self.record_bytes

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's bytes ([layers, page_bytes] uint8, a fresh array), or None on a miss or
        a record that does not check out (which is deleted)."""
        got = self.get_record(key)
        return None if got is None else got[1]

    def get_record(self, key: bytes) -> tuple[Head, np.ndarray] | None:
        """As get, with the record's checked head (parent, tokens, the data's CRC32C)."""
        if key not in self._lru:
            return None
        path = self.path(key)
        try:
            buf = _read(path, self.record_bytes)
            head = check_record(self.layout, key, buf)
        except (OSError, SsdError) as exc:
            self.num_bad_reads += 1
            log.warning("tpkv disk tier: block %s is not served: %s", key.hex(), exc)
            self.drop(key)
            return None
        self._lru.move_to_end(key)
        try:
            os.utime(path)  # the use order a later process starts from
        except OSError:
            pass
        data = np.frombuffer(buf, dtype=np.uint8, offset=self.layout.head_bytes)
        return head, data.reshape(self.layout.block_shape)

    def peek(self, key: bytes) -> tuple[bytes, tuple[int, ...]] | None:
        """A held record's parent and tokens from its head, unchecked beyond the head (for
        tests and inspection; `get` is the checked read)."""
        if key not in self._lru:
            return None
        try:
            head = parse_head(_read_head(self.path(key)))
        except (OSError, SsdError):
            return None
        return head.parent, head.tokens

    def mark_cached(self, key: bytes, cached: bool = True) -> None:
        """Whether host memory holds a copy of a held key too: such records go first when room
        is needed (the block stays in memory; the host store writes it again if it moves it
        out after that)."""
        if cached and key in self._lru:
            self._cached[key] = None
        else:
            self._cached.pop(key, None)

    def pin(self, key: bytes) -> None:
        """Keep `key` from being deleted for room until as many unpin calls."""
        self._pins[key] += 1

    def unpin(self, key: bytes) -> None:
        if self._pins.get(key, 0) <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] -= 1

    def is_cached(self, key: bytes) -> bool:
        return key in self._cached

    def drop(self, key: bytes) -> bool:
        self._cached.pop(key, None)
        if key not in self._lru:
            return False
        del self._lru[key]
        self._remove(self.path(key), self.record_bytes)
        return True

    def close(self) -> None:
        self._owner.release()

    def _remove(self, path: str, size: int) -> bool:
        """Delete a file and stop counting its bytes; a file that cannot be deleted stays
        counted (as another record, tried again when room is needed)."""
        try:
            unlink_missing_ok(path)
        except OSError as exc:
            log.warning("tpkv disk tier: cannot remove %s: %s", path, exc)
            self._others[path] = size
            return False
        self.used_bytes -= size
        return True

    def _make_room(self, need: int) -> bool:
        """Delete other records, then least recently used ones, until `need` more bytes fit;
        False when they cannot be made to fit."""
        while self.used_bytes + need > self.capacity_bytes:
            if self._others:
                path, size = self._others.popitem(last=False)
                if not self._remove(path, size):
                    return False
            elif self._lru:
                key = self._victim()
                if key is None:
                    return False
                self._lru.pop(key, None)
                self._cached.pop(key, None)
                self.num_evicted += 1
                if not self._remove(self.path(key), self.record_bytes):
                    return False
            else:
                return False
        return True

    def _victim(self) -> bytes | None:
        """The record to delete for room: the least recently used one host memory holds too,
        else the least recently used one; never a pinned one (None when all are)."""
        for keys in (self._cached, self._lru):
            for key in keys:
                if key not in self._pins:
                    return key
        return None
