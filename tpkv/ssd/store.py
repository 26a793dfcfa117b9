"""L3 tier: append-only segment files per (session, rank), commit records, TP-wide manifests."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from tpkv.config import KvGeometry, SsdConfig
from tpkv.errors import ConfigError, SsdError, SsdIoError
from tpkv.ssd import kernels, vector_io
from tpkv.ssd.backend import pick_buffers
from tpkv.ssd.budget import Budget
from tpkv.ssd.checks import check_buffers, check_indices
from tpkv.ssd.files import RankFiles
from tpkv.ssd.format import (
    ALIGN_BYTES,
    CommitRecord,
    SegmentIdentity,
    digest32,
    validate_session_id,
)
from tpkv.ssd.fsutil import fsync_dir, unlink_missing_ok
from tpkv.ssd.jobs import ReadMeter, ReadStats, StoreThreads
from tpkv.ssd.manifest import Manifests
from tpkv.ssd.owner import RootLock
from tpkv.ssd.paths import SessionPaths as _Paths
from tpkv.ssd.readahead import ReadAhead
from tpkv.ssd.reclaim import reclaim
from tpkv.ssd.session_io import SessionIo

log = logging.getLogger(__name__)

_NUM_LOCK_STRIPES = 64


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
        ident0 = SegmentIdentity(b"", rank, geometry.tp_size, self.block_bytes,
                                 digest32(geometry.fingerprint()), digest32(model_fingerprint))
        self.record_bytes = ident0.record_bytes
        # One node-wide budget split over the ranks, like L2 (never budget x tp).
        self.budget_bytes = config.bytes_per_rank(geometry.tp_size)
        if self.budget_bytes < ALIGN_BYTES + self.record_bytes:
            raise ConfigError(
                f"L3 budget of {config.budget_bytes} bytes over {geometry.tp_size} ranks "
                f"({self.budget_bytes} per rank) holds no segment of one "
                f"{self.record_bytes}-byte record plus its {ALIGN_BYTES}-byte header")
        self._files = RankFiles(self.root, ident0)
        self._manifests = Manifests(self._files, geometry.tp_size)
        # Taken before anything is read or written: one live store per (root, rank).
        self._owner = RootLock(self.root, rank, model_fingerprint)
        try:
            self._start(config, rank)
        except BaseException:
            self._owner.release()
            raise

    def _start(self, config: SsdConfig, rank: int) -> None:
        self._threads = StoreThreads(rank, config.io_threads, config.write_threads)
        self._sessions = SessionIo(config, self._files, self._manifests, self._threads.gate.pause)
        self._stripes = [threading.Lock() for _ in range(_NUM_LOCK_STRIPES)]
        self._budget = Budget(rank, self.budget_bytes)
        self._reads = ReadMeter()
        kernels.available()  # compile or load the CRC kernel now, not in the first read
        vector_io.available()  # and the by-address record I/O, not in the first spill
        # session id -> drops asked so far: a write submitted before a drop does not land
        # after it (submit_write)
        self._drops: dict[str, int] = {}
        self.ahead = ReadAhead(self.block_bytes, config.read_ahead_bytes // self.geometry.tp_size,
                               config.io_threads, rank)
        self._scan()

    # ---- public API ---------------------------------------------------------------------------

    @property
    def backend_name(self) -> str:
        return self._sessions.backend.name

    @property
    def direct_io(self) -> bool:
        """Whether segment I/O currently bypasses the page cache (O_DIRECT)."""
        return self._sessions.direct_io

    def usage_bytes(self) -> int:
        """Bytes of this rank's segments on disk (committed lengths, stale files whole)."""
        return self._budget.used()

    def write_blocks(self, session_id: str, logical_idx: np.ndarray,
                     blocks: Sequence[np.ndarray], drops: int | None = None) -> int:
        """Append one record per block to this rank's segment; durable on return.

        Returns the bytes added to the segment (0 for nothing written). Raises TierFullError
        (nothing written) when the rank's budget would be exceeded, SsdIoError when the OS
        fails (previous state intact). `drops` (submit_write): the session's drop count when
        the write was asked; after a drop asked since, nothing is written.
        """
        sid = validate_session_id(session_id)
        indices = check_indices(logical_idx, len(blocks))
        check_buffers(blocks, self.block_bytes, writable=False)
        if len(indices) == 0 or self._dropped_since(sid, drops):
            return 0
        paths = self._files.paths(sid)
        self._await_drop(paths)
        self.ahead.changed(sid)
        self._make_room(paths.hex, len(indices) * self.record_bytes + (
            0 if self._budget.holds(paths.hex) else ALIGN_BYTES))
        with self._stripe(paths):
            if self._dropped_since(sid, drops):  # (the drop holds this lock as it deletes)
                return 0
            self._budget.claim(paths.hex)
            try:
                self._files.check_dir(paths.dir, create=True)
            except OSError as exc:
                raise SsdIoError(f"L3 rank {self.rank}: cannot create {paths.dir!r}: {exc}",
                                 exc.errno) from exc
            prev = self._sessions.usable_commit(paths)
            base_bytes = ALIGN_BYTES if prev is None else prev.committed_bytes
            new_bytes = base_bytes + len(indices) * self.record_bytes
            self._budget.reserve(paths.hex, new_bytes, sid, len(indices))
            try:
                if prev is None:
                    self._sessions.write_fresh(sid, paths, indices, blocks)
                else:
                    self._sessions.append(sid, paths, prev, indices, blocks)
            except BaseException:
                self._settle(paths)
                raise
            finally:
                self.ahead.changed(sid)  # (also read ahead while it wrote)
        return new_bytes - (0 if prev is None else prev.committed_bytes)

    def read_blocks(self, session_id: str, logical_idx: np.ndarray,
                    out: Sequence[np.ndarray]) -> np.ndarray:
        """Read blocks into `out`; return the hit mask. Misses (any fault) are zeroed. Blocks
        read ahead (read_ahead) come from memory, the rest from the disk."""
        return self._read(session_id, logical_idx, out, True)

    def read_ahead(self, session_id: str, logical_idx: np.ndarray) -> bool:
        """Start reading the session's records `logical_idx` into memory of the store's own,
        for a read_blocks of them to come (ReadAhead). False when they do not fit its budget
        (SsdConfig.read_ahead_bytes) now: nothing started. True if started or already held."""
        sid = validate_session_id(session_id)
        return self.ahead.start(sid, logical_idx,
                                lambda s, idx, out: self._read(s, idx, out, False))

    def _read(self, session_id: str, logical_idx: np.ndarray, out: Sequence[np.ndarray],
              ahead: bool) -> np.ndarray:
        sid = validate_session_id(session_id)
        indices = check_indices(logical_idx, len(out))
        check_buffers(out, self.block_bytes, writable=True)
        hits = np.zeros(len(indices), dtype=bool)
        if ahead and len(indices):
            self.ahead.take(sid, indices, out, hits)
        began = time.perf_counter_ns()
        paths = self._files.paths(sid)
        rest = np.flatnonzero(~hits)
        if len(rest):
            if ahead:  # a step's read: these blocks were in no read ahead
                self._reads.step_read(len(rest))
            got = np.zeros(len(rest), dtype=bool)
            try:
                self._await_drop(paths)
                # a step's reads go before spills (ReadsFirst); reads ahead share the disk
                with self._threads.gate.reading() if ahead else contextlib.nullcontext():
                    self._sessions.read(sid, paths, indices[rest], pick_buffers(out, rest), got)
            except FileNotFoundError as exc:
                log.debug("L3 rank %d: session %s not on disk: %s", self.rank, sid, exc)
            except (SsdError, OSError) as exc:
                log.warning("L3 rank %d: session %s: %d blocks are misses: %s", self.rank, sid,
                            int((~got).sum()), exc)
            hits[rest] = got
            for i in np.flatnonzero(~hits):
                out[int(i)].fill(0)
            self._reads.add(len(rest) * self.block_bytes, began)
        self._budget.claim(paths.hex)
        return hits

    def read_stats(self) -> ReadStats:
        return self._reads.stats(self._sessions.read_syscall_ns)

    @property
    def step_disk_blocks(self) -> int:
        """Blocks read_blocks (a step's reads) found in no read ahead and read from the disk."""
        return self._reads.step_blocks

    def write_pauses(self) -> tuple[int, int]:
        """(write pieces that paused for reads, waits for writes that made them go first)."""
        gate = self._threads.gate
        return gate.num_pauses, gate.num_urgent

    def writes_first(self) -> contextlib.AbstractContextManager[None]:
        """A block inside which this store's writes do not pause for its reads (ReadsFirst)."""
        return self._threads.gate.writes_first()

    def submit_write(self, session_id: str, logical_idx: np.ndarray,
                     blocks: Sequence[np.ndarray]) -> Future[int]:
        """write_blocks on a writer thread; it writes nothing if the session is dropped
        (drop_session, drop_session_later) before it begins."""
        drops = self._drops.get(validate_session_id(session_id), 0)
        return self._threads.write(self.write_blocks, session_id, logical_idx, blocks, drops)

    def _dropped_since(self, sid: str, drops: int | None) -> bool:
        return drops is not None and self._drops.get(sid, 0) != drops

    def _count_drop(self, sid: str) -> None:
        """A drop of the session is asked: the writes asked before it write nothing."""
        self._drops[sid] = self._drops.get(sid, 0) + 1

    def submit_read(self, session_id: str, logical_idx: np.ndarray,
                    out: Sequence[np.ndarray]) -> Future[np.ndarray]:
        """read_blocks on a reader thread. Spills pause from this call on (jobs.ReadsFirst), not
        from when a reader takes the job up."""
        return self._threads.read(self.read_blocks, session_id, logical_idx, out)

    def submit_commit(self, session_id: str) -> Future[bool]:
        """commit_manifest on the store's commit thread (one, so in the order submitted)."""
        return self._threads.commit(self.commit_manifest, session_id)

    def commit_manifest(self, session_id: str) -> bool:
        """Mark a session complete if every rank's commit exists and all agree on the indices."""
        sid = validate_session_id(session_id)
        paths = self._files.paths(sid)
        self._await_drop(paths)
        try:
            return self._manifests.write(sid, paths)
        finally:
            self.ahead.changed(sid)

    def list_sessions(self) -> list[str]:
        """Ids of sessions this rank can serve: valid manifest, agreeing commit, whole segment."""
        self._threads.await_drops()
        found: list[str] = []
        for sid, hexname in self._manifests.servable():
            found.append(sid)
            self._budget.claim(hexname)  # a rebuilt controller takes these over
        return sorted(found)

    def session_indices(self, session_id: str) -> np.ndarray:
        """Sorted logical indices this rank can serve for a session (empty if none)."""
        sid = validate_session_id(session_id)
        paths = self._files.paths(sid)
        try:
            self._await_drop(paths)
            return np.unique(self._manifests.view(paths, sid)[0].logical_indices)
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
        return found is None or self._manifests.covers(*found)

    def drop_session(self, session_id: str) -> int:
        """Delete the manifest and this rank's files of a session; return the bytes freed."""
        sid = validate_session_id(session_id)
        paths = self._files.paths(sid)
        self._count_drop(sid)
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
        paths = self._files.paths(sid)
        self._count_drop(sid)
        self.ahead.changed(sid)
        self._budget.forget(paths.hex)
        self._threads.drop_later(paths.hex, self._drop, sid, paths)

    def close(self) -> None:
        """Finish every submitted job (pending deletes too), then give up the root."""
        self.ahead.close()
        self._threads.shutdown()
        self._owner.release()

    def __enter__(self) -> SsdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- deletes, room, accounting ------------------------------------------------------------

    def _drop(self, sid: str, paths: _Paths) -> int:
        # (a write of the session still writing holds the lock: it does not pause for reads)
        with self.writes_first(), self._stripe(paths):
            return self._drop_locked(sid, paths)

    def _drop_locked(self, sid: str, paths: _Paths) -> int:
        self.ahead.changed(sid)
        if self._files.check_dir(paths.dir, create=False):
            segment, commit = paths.segment(self.rank), paths.commit(self.rank)
            try:
                for path in (paths.manifest, commit, segment, segment + ".tmp",
                             commit + ".tmp"):
                    unlink_missing_ok(path)
                self._sessions.forget(paths)
                fsync_dir(paths.dir)
            except OSError as exc:
                self._settle(paths)
                raise SsdIoError(f"L3 rank {self.rank}: dropping session {sid} failed: "
                                 f"{exc}", exc.errno) from exc
        return self._budget.release(paths.hex)

    def _make_room(self, writing: str, need: int) -> None:
        """Delete sessions left by an earlier run that nothing has named since (oldest commit
        first, never `writing`, the session hash of the write) while `need` more bytes would
        not fit."""
        while (victim := self._budget.next_victim(writing, need)) is not None:
            hexname, sub = victim
            old = _Paths(bytes.fromhex(hexname), hexname, sub)
            with self._stripe(old):
                if not self._budget.take_inherited(hexname):
                    continue  # named meanwhile: this run's now
                try:
                    freed = self._drop_locked(f"(left by an earlier run, {hexname[:16]})", old)
                except (SsdError, OSError) as exc:
                    log.warning("L3 rank %d: %s", self.rank, exc)
                    return
            log.info("L3 rank %d: deleted session %s (%d bytes), left by an earlier run and not "
                     "named since, to make room", self.rank, hexname[:16], freed)

    def _await_drop(self, paths: _Paths) -> None:
        """Wait for a pending drop_session_later of this session; SsdIoError if it failed (its
        files may still be there: reads miss, writes fail, and a drop_session retries)."""
        self._threads.await_drop(paths.hex)

    def _stripe(self, paths: _Paths) -> threading.Lock:
        return self._stripes[paths.session_hash[0] % _NUM_LOCK_STRIPES]

    def _scan(self) -> None:
        """Reclaim this rank's files that can never be read; account the segments kept."""
        found = reclaim(self._files, self._manifests.view)
        self._budget.adopt(found.usage,
                           {h: (found.mtimes[h], found.dirs[h]) for h in found.usage})
        self._make_room("", 0)  # a smaller budget than the earlier run's: the oldest go

    def _own_commit_of(self, session_id: str) -> tuple[_Paths, CommitRecord] | None:
        """This rank's commit of a session once any pending delete of it is done, with its
        paths; None where there is no valid one (or the id is refused)."""
        try:
            paths = self._files.paths(validate_session_id(session_id))
            self._await_drop(paths)
            return paths, self._files.own_commit(paths)
        except (SsdError, OSError):
            return None

    def _settle(self, paths: _Paths) -> None:
        """After a failed write or delete: account what is on disk now."""
        self._budget.settle(paths.hex, self._files.disk_usage(paths))
