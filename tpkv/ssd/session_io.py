"""A rank's segment and commit files of a session: a fresh segment, an append, a checked read."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from tpkv.config import SsdConfig
from tpkv.errors import SsdError, SsdIoError
from tpkv.ssd.backend import pick_buffers, select_backend
from tpkv.ssd.files import RankFiles
from tpkv.ssd.format import ALIGN_BYTES, CommitRecord, SegmentIdentity, pack_commit, parse_commit
from tpkv.ssd.fsutil import atomic_write, fsync_dir, unlink_missing_ok
from tpkv.ssd.manifest import Manifests
from tpkv.ssd.paths import SessionPaths
from tpkv.ssd.segment import SegmentIo, last_positions

log = logging.getLogger(__name__)


def new_segment_id() -> int:
    """A random, nonzero 64-bit id for a new segment file."""
    return int.from_bytes(os.urandom(8), "little") | 1


class SessionIo:
    """Reads and writes the files of rank `files.rank` through the I/O backend `config`
    selects; a write waits on `pause` between its pieces (the store's reads go first)."""

    def __init__(self, config: SsdConfig, files: RankFiles, manifests: Manifests,
                 pause: Callable[[], None]) -> None:
        self.backend = select_backend(config)
        self._files = files
        self._manifests = manifests
        self._pause = pause
        self._io = SegmentIo(files.ident0.block_bytes, config.write_piece_bytes)

    @property
    def direct_io(self) -> bool:
        """Whether segment I/O currently bypasses the page cache (O_DIRECT)."""
        return bool(getattr(self.backend, "direct", False))

    @property
    def read_syscall_ns(self) -> int:
        return self._io.read_syscall_ns

    def forget(self, paths: SessionPaths) -> None:
        """Drop what is remembered of this rank's segment of a session (its files are gone)."""
        self._io.forget(paths.session_hash, self._files.rank)

    def usable_commit(self, paths: SessionPaths) -> CommitRecord | None:
        """This rank's commit if it and its segment can be appended to, else None (rewrite)."""
        files, rank = self._files, self._files.rank
        ident = files.ident(paths)
        try:
            commit = parse_commit(files.read_meta(paths.commit(rank)), ident)
            ident = replace(ident, segment_id=commit.segment_id)
            with self.backend.open(paths.segment(rank), write=False, create=False) as f:
                self._io.check_header(f, ident, commit.committed_bytes)
            return commit
        except FileNotFoundError:
            return None
        except (SsdError, OSError) as exc:
            log.info("L3 rank %d: segment %s will be rewritten: %s", rank, paths.hex[:16], exc)
            return None

    def write_fresh(self, sid: str, paths: SessionPaths, indices: np.ndarray,
                    blocks: Sequence[np.ndarray]) -> None:
        rank = self._files.rank
        ident = replace(self._files.ident(paths), segment_id=new_segment_id())
        segment, commit = paths.segment(rank), paths.commit(rank)
        tmp = segment + ".tmp"
        try:
            with self.backend.open(tmp, write=True, create=True) as f:
                self._io.write_header(f, ident)
                self._io.write_records(f, ident, indices, blocks, 0, ALIGN_BYTES, self._pause)
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
                f"L3 rank {rank}: writing a new segment of {len(indices)} blocks "
                f"({ALIGN_BYTES + len(indices) * ident.record_bytes} bytes) for session {sid} "
                f"failed: {exc}", exc.errno) from exc
        self._write_commit(sid, paths, ident, indices)

    def append(self, sid: str, paths: SessionPaths, prev: CommitRecord, indices: np.ndarray,
               blocks: Sequence[np.ndarray]) -> None:
        rank = self._files.rank
        ident = replace(self._files.ident(paths), segment_id=prev.segment_id)
        offset = prev.committed_bytes
        try:
            with self.backend.open(paths.segment(rank), write=True, create=False) as f:
                try:
                    self._io.write_records(f, ident, indices, blocks, prev.num_records, offset,
                                           self._pause)
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
                f"L3 rank {rank}: appending {len(indices)} blocks "
                f"({len(indices) * ident.record_bytes} bytes) at byte {offset} of session {sid} "
                f"failed: {exc}", exc.errno) from exc
        self._write_commit(sid, paths, ident, np.concatenate([prev.logical_indices, indices]))

    def _write_commit(self, sid: str, paths: SessionPaths, ident: SegmentIdentity,
                      indices: np.ndarray) -> None:
        commit = paths.commit(self._files.rank)
        try:
            atomic_write(commit, pack_commit(ident, indices), commit + ".tmp")
        except OSError as exc:
            raise SsdIoError(f"L3 rank {self._files.rank}: writing the commit of session {sid} "
                             f"({len(indices)} records) failed: {exc}", exc.errno) from exc

    def read(self, sid: str, paths: SessionPaths, indices: np.ndarray,
             out: Sequence[np.ndarray], hits: np.ndarray) -> None:
        """Read the records the manifest covers into `out`, setting `hits` (raises on a fault
        of the session's files; the caller zeroes the misses)."""
        rank = self._files.rank
        if not self._files.check_dir(paths.dir, create=False):
            return
        manifest, commit = self._manifests.view(paths, sid)
        ident = replace(self._files.ident(paths), segment_id=commit.segment_id)
        # A block this rank appended again after the manifest (an L3 copy written since, spilled
        # before the other ranks wrote theirs): the manifest holds an older version of it. A
        # miss, never those bytes.
        keep = np.flatnonzero(last_positions(commit.logical_indices, indices)
                              < manifest.num_records[rank])
        if len(keep) < len(indices):
            log.info("L3 rank %d: session %s: %d blocks have records newer than the manifest; "
                     "read as misses", rank, sid, len(indices) - len(keep))
        got = np.zeros(len(keep), dtype=bool)
        with self.backend.open(paths.segment(rank), write=False, create=False) as f:
            self._io.read_records(f, ident, manifest.logical_indices, indices[keep],
                                  pick_buffers(out, keep), got)
        hits[keep] = got
