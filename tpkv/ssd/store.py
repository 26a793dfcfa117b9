"""L3 tier: append-only segment files per (session, rank), commit records, TP-wide manifests."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace

import numpy as np

from tpkv.config import KvGeometry, SsdConfig
from tpkv.errors import (
    ConfigError,
    SsdError,
    SsdFormatError,
    SsdIoError,
    SsdRequestError,
    TierFullError,
)
from tpkv.ssd.backend import (
    BlockViews,
    atomic_write,
    fsync_dir,
    read_small_file,
    select_backend,
    unlink_missing_ok,
)
from tpkv.ssd.format import (
    ALIGN_BYTES,
    CommitRecord,
    Manifest,
    SegmentIdentity,
    digest32,
    pack_commit,
    pack_manifest,
    parse_commit,
    parse_manifest,
    validate_session_id,
)
from tpkv.ssd.owner import RootLock
from tpkv.ssd.paths import MANIFEST_RE, fanout_dirs
from tpkv.ssd.paths import SessionPaths as _Paths
from tpkv.ssd.reclaim import reclaim
from tpkv.ssd.segment import SegmentIo, last_positions

log = logging.getLogger(__name__)

_MAX_META_BYTES = 64 << 20  # commit records and manifests above this are rejected unread
_NUM_LOCK_STRIPES = 64
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


class _ReadsFirst:
    """Reads of a rank's store go before its writes: a write, between its pieces, waits (up to
    _PAUSE_MAX_S a piece) while any read is submitted and not done. On the H200's disk, a
    resume's reads beside a spill of the same size ran at about half the disk's read speed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reads = 0
        self.num_pauses = 0  # pieces that waited for reads

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

    def pause(self) -> None:
        with self._cond:
            if self._reads:
                self.num_pauses += 1
                self._cond.wait_for(lambda: not self._reads, timeout=_PAUSE_MAX_S)


def new_segment_id() -> int:
    """A random, nonzero 64-bit id for a new segment file."""
    return int.from_bytes(os.urandom(8), "little") | 1


class SsdStore:
    """One rank's view of the L3 directory; see docs/ssd-format.md for the files and protocol.

    Writes are durable on return. Reads never raise for bad or missing data: each block is a hit
    (bit-exact) or a miss (its buffer is zeroed and the caller recomputes the prefix).
    """

    def __init__(self, config: SsdConfig, geometry: KvGeometry, model_fingerprint: str,
                 rank: int) -> None:
        if config.root is None:
            raise ConfigError("SsdStore needs SsdConfig.root (the L3 directory), got None")
        if isinstance(rank, bool) or not isinstance(rank, int) or not (
                0 <= rank < geometry.tp_size):
            raise ConfigError(f"rank {rank!r} is outside 0..{geometry.tp_size - 1}")
        if not isinstance(model_fingerprint, str):
            raise ConfigError(f"model_fingerprint must be a str, got "
                              f"{type(model_fingerprint).__name__}")
        self.config = config
        self.geometry = geometry
        self.rank = rank
        self.root = os.path.realpath(config.root)
        self.block_bytes = geometry.block_bytes
        self._ident0 = SegmentIdentity(b"", rank, geometry.tp_size, self.block_bytes,
                                       digest32(geometry.fingerprint()),
                                       digest32(model_fingerprint))
        self.record_bytes = self._ident0.record_bytes
        # One node-wide budget split over the ranks, like L2 (never budget x tp).
        self.budget_bytes = config.bytes_per_rank(geometry.tp_size)
        if self.budget_bytes < ALIGN_BYTES + self.record_bytes:
            raise ConfigError(
                f"L3 budget of {config.budget_bytes} bytes over {geometry.tp_size} ranks "
                f"({self.budget_bytes} per rank) holds no segment of one "
                f"{self.record_bytes}-byte record plus its {ALIGN_BYTES}-byte header")
        # Taken before anything is read or written: one live store per (root, rank).
        self._owner = RootLock(self.root, rank, model_fingerprint)
        try:
            self._start(config, rank)
        except BaseException:
            self._owner.release()
            raise

    def _start(self, config: SsdConfig, rank: int) -> None:
        self._backend = select_backend(config)
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"tpkv-l3-r{rank}")
        self._writers = ThreadPoolExecutor(config.write_threads,
                                           thread_name_prefix=f"tpkv-l3-w{rank}")
        # drop_session_later: one thread deletes sessions' files in the order asked; any later
        # call about such a session waits for its delete first (_await_drop).
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix=f"tpkv-l3-drop-r{rank}")
        # submit_commit: manifest commits (two fsyncs each) off the caller's thread, in order
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"tpkv-l3-commit-r{rank}")
        self._dropping: dict[str, Future[int]] = {}  # session hash (hex) -> its pending delete
        self._lock = threading.Lock()  # guards the usage accounting
        self._stripes = [threading.Lock() for _ in range(_NUM_LOCK_STRIPES)]
        self._io = SegmentIo(self.block_bytes, config.write_piece_bytes)
        self._gate = _ReadsFirst()
        self._usage: dict[str, int] = {}
        self._usage_total = 0
        # Sessions found at start that nothing has named since (write, read, list_sessions):
        # session hash (hex) -> (commit mtime, fan-out dir). Deleted, oldest first, when a write
        # needs their room: a controller that started afresh does not know them.
        self._inherited: dict[str, tuple[int, str]] = {}
        self._read_jobs = self._read_bytes = self._read_ns = 0
        self._scan()

    # ---- public API ---------------------------------------------------------------------------

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def direct_io(self) -> bool:
        """Whether segment I/O currently bypasses the page cache (O_DIRECT)."""
        return bool(getattr(self._backend, "direct", False))

    def usage_bytes(self) -> int:
        """Bytes of this rank's segments on disk (committed lengths, stale files whole)."""
        with self._lock:
            return self._usage_total

    def write_blocks(self, session_id: str, logical_idx: np.ndarray,
                     blocks: Sequence[np.ndarray]) -> int:
        """Append one record per block to this rank's segment; durable on return.

        Returns the bytes added to the segment. Raises TierFullError (nothing written) when the
        rank's budget would be exceeded, SsdIoError when the OS fails (previous state intact).
        """
        sid = validate_session_id(session_id)
        indices = self._check_indices(logical_idx, len(blocks))
        self._check_buffers(blocks, writable=False)
        if len(indices) == 0:
            return 0
        paths = self._paths(sid)
        self._await_drop(paths)
        self._make_room(paths.hex, len(indices) * self.record_bytes + (
            0 if paths.hex in self._usage else ALIGN_BYTES))
        with self._stripe(paths):
            self._claim(paths.hex)
            try:
                self._check_dir(paths.dir, create=True)
            except OSError as exc:
                raise SsdIoError(f"L3 rank {self.rank}: cannot create {paths.dir!r}: {exc}",
                                 exc.errno) from exc
            prev = self._usable_commit(paths)
            base_bytes = ALIGN_BYTES if prev is None else prev.committed_bytes
            new_bytes = base_bytes + len(indices) * self.record_bytes
            self._reserve(sid, paths, new_bytes, len(indices))
            try:
                if prev is None:
                    self._write_fresh(sid, paths, indices, blocks)
                else:
                    self._append(sid, paths, prev, indices, blocks)
            except BaseException:
                self._settle(paths)
                raise
        return new_bytes - (0 if prev is None else prev.committed_bytes)

    def read_blocks(self, session_id: str, logical_idx: np.ndarray,
                    out: Sequence[np.ndarray]) -> np.ndarray:
        """Read blocks into `out`; return the hit mask. Misses (any fault) are zeroed."""
        sid = validate_session_id(session_id)
        indices = self._check_indices(logical_idx, len(out))
        self._check_buffers(out, writable=True)
        hits = np.zeros(len(indices), dtype=bool)
        began = time.perf_counter_ns()
        if len(indices):
            try:
                self._await_drop(self._paths(sid))
                with self._reading():
                    self._read_session(sid, indices, out, hits)
            except FileNotFoundError as exc:
                log.debug("L3 rank %d: session %s not on disk: %s", self.rank, sid, exc)
            except (SsdError, OSError) as exc:
                log.warning("L3 rank %d: session %s: %d blocks are misses: %s", self.rank, sid,
                            int((~hits).sum()), exc)
            for i in np.flatnonzero(~hits):
                out[int(i)].fill(0)
        with self._lock:
            if self._inherited:
                self._inherited.pop(self._paths(sid).hex, None)
            self._read_jobs += 1
            self._read_bytes += len(indices) * self.block_bytes
            self._read_ns += time.perf_counter_ns() - began
        return hits

    def read_stats(self) -> ReadStats:
        with self._lock:
            return ReadStats(self._read_jobs, self._read_bytes, self._read_ns / 1e9,
                             self._io.read_syscall_ns / 1e9)

    def submit_write(self, session_id: str, logical_idx: np.ndarray,
                     blocks: Sequence[np.ndarray]) -> Future[int]:
        return self._writers.submit(self.write_blocks, session_id, logical_idx, blocks)

    def submit_read(self, session_id: str, logical_idx: np.ndarray,
                    out: Sequence[np.ndarray]) -> Future[np.ndarray]:
        """read_blocks on a reader thread. Spills pause from this call on (_ReadsFirst), not
        from when a reader takes the job up."""
        self._gate.begin()
        try:
            fut = self._pool.submit(self.read_blocks, session_id, logical_idx, out)
        except BaseException:
            self._gate.end()
            raise
        fut.add_done_callback(self._gate.end)
        return fut

    def submit_commit(self, session_id: str) -> Future[bool]:
        """commit_manifest on the store's commit thread (one, so in the order submitted)."""
        return self._committer.submit(self.commit_manifest, session_id)

    def commit_manifest(self, session_id: str) -> bool:
        """Mark a session complete if every rank's commit exists and all agree on the indices."""
        sid = validate_session_id(session_id)
        paths = self._paths(sid)
        self._await_drop(paths)
        if not self._check_dir(paths.dir, create=False):
            return False
        commits: list[CommitRecord] = []
        for rank in range(self.geometry.tp_size):
            try:
                commit = parse_commit(self._read_meta(paths.commit(rank)),
                                      self._ident(paths, rank))
                if os.stat(paths.segment(rank)).st_size < commit.committed_bytes:
                    raise SsdFormatError(f"rank {rank} segment is shorter than "
                                         f"{commit.committed_bytes} committed bytes")
            except (SsdError, OSError) as exc:
                log.info("L3: session %s is not complete: rank %d: %s", sid, rank, exc)
                return False
            commits.append(commit)
        first = commits[0].logical_indices
        for rank, commit in enumerate(commits):
            if len(first) == 0 or not np.array_equal(commit.logical_indices, first):
                log.info("L3: session %s is not complete: rank %d holds %d records, rank 0 %d",
                         sid, rank, commit.num_records, len(first))
                return False
        data = pack_manifest(self._ident(paths), sid, commits)
        try:
            atomic_write(paths.manifest, data, f"{paths.manifest}.r{self.rank}.tmp")
        except OSError as exc:
            raise SsdIoError(f"L3 rank {self.rank}: writing the manifest of session {sid} "
                             f"({len(data)} bytes) failed: {exc}", exc.errno) from exc
        return True

    def list_sessions(self) -> list[str]:
        """Ids of sessions this rank can serve: valid manifest, agreeing commit, whole segment."""
        self._await_drops()
        found: list[str] = []
        for sub in fanout_dirs(self.root):
            with os.scandir(sub) as entries:
                names = [e.name for e in entries]
            for name in names:
                match = MANIFEST_RE.fullmatch(name)
                if not match:
                    continue
                paths = _Paths(bytes.fromhex(match.group(1)), match.group(1), sub)
                try:
                    manifest = parse_manifest(self._read_meta(paths.manifest), self._ident(paths))
                    self._view(paths, manifest.session_id)
                    size_bytes = os.stat(paths.segment(self.rank)).st_size
                    if size_bytes < manifest.committed_bytes[self.rank]:
                        raise SsdFormatError(f"segment is {size_bytes} bytes, the manifest "
                                             f"covers {manifest.committed_bytes[self.rank]}")
                except (SsdError, OSError) as exc:
                    log.debug("L3 rank %d: skipping %s: %s", self.rank, name, exc)
                    continue
                found.append(manifest.session_id)
                self._claim(paths.hex)  # a rebuilt controller takes these over
        return sorted(found)

    def session_indices(self, session_id: str) -> np.ndarray:
        """Sorted logical indices this rank can serve for a session (empty if none)."""
        sid = validate_session_id(session_id)
        paths = self._paths(sid)
        try:
            self._await_drop(paths)
            return np.unique(self._view(paths, sid)[0].logical_indices)
        except (SsdError, OSError):
            return np.zeros(0, dtype=np.int64)

    def committed_indices(self, session_id: str) -> np.ndarray:
        """Sorted logical indices in this rank's own commit of a session (empty if none): what
        it wrote, whether or not the manifest (every rank's writes) covers them yet."""
        found = self._own_commit_of(session_id)
        return (np.unique(found[1].logical_indices) if found is not None
                else np.zeros(0, dtype=np.int64))

    def session_records(self, session_id: str) -> int:
        """Records in this rank's committed segment of a session, dead ones (blocks written
        again) too: the room it holds in records (0 if none)."""
        found = self._own_commit_of(session_id)
        return found[1].num_records if found is not None else 0

    def manifest_covers_commit(self, session_id: str) -> bool:
        """Whether the session's manifest covers every record of this rank's own commit (True
        when this rank committed none). A read goes by the manifest's records only: where a
        block was appended again (an L3 copy written since), an older manifest would give
        the older record."""
        found = self._own_commit_of(session_id)
        if found is None:
            return True
        paths, commit = found
        try:
            manifest = parse_manifest(self._read_meta(paths.manifest), self._ident(paths))
        except (SsdError, OSError):
            return False
        return (manifest.segment_ids[self.rank] == commit.segment_id
                and manifest.num_records[self.rank] >= commit.num_records)

    def drop_session(self, session_id: str) -> int:
        """Delete the manifest and this rank's files of a session; return the bytes freed."""
        sid = validate_session_id(session_id)
        paths = self._paths(sid)
        try:
            self._await_drop(paths)
        except SsdIoError as exc:  # the files are still there: this delete tries again
            log.warning("%s", exc)
        return self._drop(sid, paths)

    def drop_session_later(self, session_id: str) -> None:
        """drop_session on a background thread, so that the caller (a step) does not wait for
        the file system (on the H200's disk, deleting a loaded-back session's segment held a
        step for ~100 ms). Its room counts as free at once; every later call about the session
        waits for the delete first, list_sessions and close for all of them."""
        sid = validate_session_id(session_id)
        paths = self._paths(sid)
        with self._lock:
            self._usage_total -= self._usage.pop(paths.hex, 0)
            self._dropping[paths.hex] = self._janitor.submit(self._drop, sid, paths)

    def _drop(self, sid: str, paths: _Paths) -> int:
        with self._stripe(paths):
            return self._drop_locked(sid, paths)

    def _drop_locked(self, sid: str, paths: _Paths) -> int:
        if self._check_dir(paths.dir, create=False):
            segment, commit = paths.segment(self.rank), paths.commit(self.rank)
            try:
                for path in (paths.manifest, commit, segment, segment + ".tmp",
                             commit + ".tmp"):
                    unlink_missing_ok(path)
                self._io.forget(paths.session_hash, self.rank)
                fsync_dir(paths.dir)
            except OSError as exc:
                self._settle(paths)
                raise SsdIoError(f"L3 rank {self.rank}: dropping session {sid} failed: "
                                 f"{exc}", exc.errno) from exc
        with self._lock:
            freed = self._usage.pop(paths.hex, 0)
            self._usage_total -= freed
            self._inherited.pop(paths.hex, None)
        return freed

    def close(self) -> None:
        """Finish every submitted job (pending deletes too), then give up the root."""
        self._committer.shutdown(wait=True)
        self._janitor.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._owner.release()

    def _claim(self, hexname: str) -> None:
        """A session named since the start is this run's: never deleted to make room."""
        with self._lock:
            self._inherited.pop(hexname, None)

    def _make_room(self, writing: str, need: int) -> None:
        """Delete sessions left by an earlier run that nothing has named since (oldest commit
        first, never `writing`, the session hash of the write) while `need` more bytes would
        not fit."""
        while True:
            with self._lock:
                others = [h for h in self._inherited if h != writing]
                if self._usage_total + need <= self.budget_bytes or not others:
                    return
                victim = min(others, key=lambda h: self._inherited[h][0])
                sub = self._inherited[victim][1]
            old = _Paths(bytes.fromhex(victim), victim, sub)
            with self._stripe(old):
                with self._lock:
                    if self._inherited.pop(victim, None) is None:
                        continue  # named meanwhile: this run's now
                try:
                    freed = self._drop_locked(f"(left by an earlier run, {victim[:16]})", old)
                except (SsdError, OSError) as exc:
                    log.warning("L3 rank %d: %s", self.rank, exc)
                    return
            log.info("L3 rank %d: deleted session %s (%d bytes), left by an earlier run and not "
                     "named since, to make room", self.rank, victim[:16], freed)

    def _await_drop(self, paths: _Paths) -> None:
        """Wait for a pending drop_session_later of this session; SsdIoError if it failed (its
        files may still be there: reads miss, writes fail, and a drop_session retries)."""
        self._await_drop_of(paths.hex)

    def _await_drop_of(self, key: str) -> None:
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

    def _await_drops(self) -> None:
        """Wait for every pending drop_session_later (a failed one is logged)."""
        with self._lock:
            keys = list(self._dropping)
        for key in keys:
            try:
                self._await_drop_of(key)
            except SsdIoError as exc:
                log.warning("%s", exc)

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reading(self) -> AbstractContextManager[None]:
        return self._gate.reading()

    def _pause(self) -> Callable[[], None]:
        return self._gate.pause

    # ---- paths, metadata, accounting ----------------------------------------------------------

    def _paths(self, sid: str) -> _Paths:
        session_hash = digest32(sid)
        hexname = session_hash.hex()
        # Only [0-9a-f] and fixed suffixes below the realpath'd root: no separator, no "..".
        return _Paths(session_hash, hexname, os.path.join(self.root, hexname[:2]))

    def _ident(self, paths: _Paths, rank: int | None = None) -> SegmentIdentity:
        return replace(self._ident0, session_hash=paths.session_hash,
                       rank=self.rank if rank is None else rank)

    def _stripe(self, paths: _Paths) -> threading.Lock:
        return self._stripes[paths.session_hash[0] % _NUM_LOCK_STRIPES]

    def _check_dir(self, path: str, create: bool) -> bool:
        """True if the fan-out directory exists as a real directory (never a symlink)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                pass
            fsync_dir(self.root)
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise SsdError(f"L3 path {path!r} is not a plain directory (mode {st.st_mode:o}); "
                           f"refusing to follow it out of {self.root!r}")
        return True

    def _scan(self) -> None:
        """Reclaim this rank's files that can never be read; account the segments kept."""
        found = reclaim(self.rank, self.root, self._ident, self._read_meta, self._view)
        self._usage = found.usage
        self._usage_total = sum(found.usage.values())
        self._inherited = {h: (found.mtimes[h], found.dirs[h]) for h in found.usage}
        self._make_room("", 0)  # a smaller budget than the earlier run's: the oldest go

    def _own_commit_of(self, session_id: str) -> tuple[_Paths, CommitRecord] | None:
        """This rank's commit of a session once any pending delete of it is done, with its
        paths; None where there is no valid one (or the id is refused)."""
        try:
            paths = self._paths(validate_session_id(session_id))
            self._await_drop(paths)
            return paths, self._own_commit(paths)
        except (SsdError, OSError):
            return None

    def _own_commit(self, paths: _Paths) -> CommitRecord:
        """This rank's commit record of a session (SsdError or OSError if none is valid)."""
        return parse_commit(self._read_meta(paths.commit(self.rank)), self._ident(paths))

    def _disk_usage(self, paths: _Paths) -> int:
        try:
            return self._own_commit(paths).committed_bytes
        except (SsdError, OSError):
            pass
        try:
            return os.stat(paths.segment(self.rank)).st_size
        except OSError:
            return 0

    def _reserve(self, sid: str, paths: _Paths, new_bytes: int, num_blocks: int) -> None:
        with self._lock:
            delta = new_bytes - self._usage.get(paths.hex, 0)
            if self._usage_total + delta > self.budget_bytes:
                raise TierFullError(
                    f"L3 rank {self.rank}: writing {num_blocks} blocks to session {sid} needs "
                    f"{delta} more bytes; {self._usage_total} of {self.budget_bytes} bytes used, "
                    f"{self.budget_bytes - self._usage_total} free")
            self._usage[paths.hex] = new_bytes
            self._usage_total += delta

    def _settle(self, paths: _Paths) -> None:
        """After a failed write: account what is on disk now."""
        actual = self._disk_usage(paths)
        with self._lock:
            self._usage_total += actual - self._usage.get(paths.hex, 0)
            self._usage[paths.hex] = actual

    def _read_meta(self, path: str) -> bytes:
        return read_small_file(path, _MAX_META_BYTES)

    def _usable_commit(self, paths: _Paths) -> CommitRecord | None:
        """This rank's commit if it and its segment can be appended to, else None (rewrite)."""
        ident = self._ident(paths)
        try:
            commit = parse_commit(self._read_meta(paths.commit(self.rank)), ident)
            ident = replace(ident, segment_id=commit.segment_id)
            with self._backend.open(paths.segment(self.rank), write=False, create=False) as f:
                self._io.check_header(f, ident, commit.committed_bytes)
            return commit
        except FileNotFoundError:
            return None
        except (SsdError, OSError) as exc:
            log.info("L3 rank %d: segment %s will be rewritten: %s", self.rank, paths.hex[:16],
                     exc)
            return None

    def _view(self, paths: _Paths, sid: str) -> tuple[Manifest, CommitRecord]:
        """The manifest and this rank's commit, if valid and the commit extends it; else raise."""
        ident = self._ident(paths)
        manifest = parse_manifest(self._read_meta(paths.manifest), ident)
        if manifest.session_id != sid:
            raise SsdFormatError(f"manifest names session {manifest.session_id!r}, not {sid!r}")
        num_records = manifest.num_records[self.rank]
        commit = parse_commit(self._read_meta(paths.commit(self.rank)), ident)
        if commit.segment_id != manifest.segment_ids[self.rank]:
            raise SsdFormatError(f"rank {self.rank} commit is for segment {commit.segment_id:#x}, "
                                 f"the manifest for {manifest.segment_ids[self.rank]:#x}")
        if commit.num_records < num_records or not np.array_equal(
                commit.logical_indices[:num_records], manifest.logical_indices):
            raise SsdFormatError(f"rank {self.rank} commit of {commit.num_records} records does "
                                 f"not extend the manifest's {num_records}")
        return manifest, commit

    # ---- segment I/O --------------------------------------------------------------------------

    def _write_fresh(self, sid: str, paths: _Paths, indices: np.ndarray,
                     blocks: Sequence[np.ndarray]) -> None:
        ident = replace(self._ident(paths), segment_id=new_segment_id())
        segment, commit = paths.segment(self.rank), paths.commit(self.rank)
        tmp = segment + ".tmp"
        try:
            with self._backend.open(tmp, write=True, create=True) as f:
                self._io.write_header(f, ident)
                self._io.write_records(f, ident, indices, blocks, 0, ALIGN_BYTES, self._pause())
                f.sync()
                self._io.remember(f, ident)
            unlink_missing_ok(commit)  # a stale commit must never describe the new segment
            os.replace(tmp, segment)
            fsync_dir(paths.dir)
        except OSError as exc:
            try:
                unlink_missing_ok(tmp)
            except OSError:
                pass
            raise SsdIoError(
                f"L3 rank {self.rank}: writing a new segment of {len(indices)} blocks "
                f"({ALIGN_BYTES + len(indices) * self.record_bytes} bytes) for session {sid} "
                f"failed: {exc}", exc.errno) from exc
        self._write_commit(sid, paths, ident, indices)

    def _append(self, sid: str, paths: _Paths, prev: CommitRecord, indices: np.ndarray,
                blocks: Sequence[np.ndarray]) -> None:
        ident = replace(self._ident(paths), segment_id=prev.segment_id)
        offset = prev.committed_bytes
        try:
            with self._backend.open(paths.segment(self.rank), write=True, create=False) as f:
                try:
                    self._io.write_records(f, ident, indices, blocks, prev.num_records, offset,
                                           self._pause())
                    f.sync()
                    self._io.remember(f, ident)
                except OSError:
                    try:
                        f.truncate(offset)
                    except OSError:
                        pass  # the tail past the committed length is ignored anyway
                    raise
        except OSError as exc:
            raise SsdIoError(
                f"L3 rank {self.rank}: appending {len(indices)} blocks "
                f"({len(indices) * self.record_bytes} bytes) at byte {offset} of session {sid} "
                f"failed: {exc}", exc.errno) from exc
        self._write_commit(sid, paths, ident, np.concatenate([prev.logical_indices, indices]))

    def _write_commit(self, sid: str, paths: _Paths, ident: SegmentIdentity,
                      indices: np.ndarray) -> None:
        commit = paths.commit(self.rank)
        try:
            atomic_write(commit, pack_commit(ident, indices), commit + ".tmp")
        except OSError as exc:
            raise SsdIoError(f"L3 rank {self.rank}: writing the commit of session {sid} "
                             f"({len(indices)} records) failed: {exc}", exc.errno) from exc

    def _read_session(self, sid: str, indices: np.ndarray, out: Sequence[np.ndarray],
                      hits: np.ndarray) -> None:
        paths = self._paths(sid)
        if not self._check_dir(paths.dir, create=False):
            return
        manifest, commit = self._view(paths, sid)
        ident = replace(self._ident(paths), segment_id=commit.segment_id)
        # A block this rank appended again after the manifest (an L3 copy written since, spilled
        # before the other ranks wrote theirs): the manifest holds an older version of it. A
        # miss, never those bytes.
        keep = np.flatnonzero(last_positions(commit.logical_indices, indices)
                              < manifest.num_records[self.rank])
        if len(keep) < len(indices):
            log.info("L3 rank %d: session %s: %d blocks have records newer than the manifest; "
                     "read as misses", self.rank, sid, len(indices) - len(keep))
        got = np.zeros(len(keep), dtype=bool)
        with self._backend.open(paths.segment(self.rank), write=False, create=False) as f:
            self._io.read_records(f, ident, manifest.logical_indices, indices[keep],
                                  [out[int(i)] for i in keep], got)
        hits[keep] = got

    # ---- argument checks ----------------------------------------------------------------------

    def _check_indices(self, logical_idx: np.ndarray, num_buffers: int) -> np.ndarray:
        arr = np.asarray(logical_idx)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise SsdRequestError(f"logical_idx must be a 1-D integer array, got dtype "
                                  f"{arr.dtype} shape {arr.shape}")
        if len(arr) != num_buffers:
            raise SsdRequestError(f"{len(arr)} logical indices for {num_buffers} buffers")
        if arr.size and (arr.min() < 0 or int(arr.max()) > np.iinfo(np.int64).max):
            raise SsdRequestError(f"logical indices must be in 0..2**63-1, got {arr.min()}.."
                                  f"{arr.max()}")
        return arr.astype(np.int64)

    def _check_buffers(self, bufs: Sequence[np.ndarray], writable: bool) -> None:
        if isinstance(bufs, BlockViews):  # an L2 pool's blocks: writable, of its block size
            if bufs.block_bytes != self.block_bytes:
                raise SsdRequestError(f"buffers of {bufs.block_bytes} bytes; L3 needs blocks "
                                      f"of {self.block_bytes} bytes")
            return
        for i, buf in enumerate(bufs):
            if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1 or (
                    buf.nbytes != self.block_bytes) or not buf.flags.c_contiguous:
                desc = (f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray)
                        else type(buf).__name__)
                raise SsdRequestError(f"buffer {i} is {desc}; L3 needs 1-D contiguous uint8 "
                                      f"arrays of {self.block_bytes} bytes")
            if writable and not buf.flags.writeable:
                raise SsdRequestError(f"buffer {i} is read-only; reads need writable buffers")
