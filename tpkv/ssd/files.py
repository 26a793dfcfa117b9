"""One rank's files under an L3 root: a session's paths and identity, checked metadata reads."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

from tpkv.errors import SsdError
from tpkv.ssd.format import CommitRecord, SegmentIdentity, digest32, parse_commit
from tpkv.ssd.fsutil import fsync_dir, read_small_file
from tpkv.ssd.paths import SessionPaths

_MAX_META_BYTES = 64 << 20  # commit records and manifests above this are rejected unread


class RankFiles:
    """Names and checks the files of rank `ident0.rank` below `root` (a realpath); holds no
    state beyond them. `ident0` is the rank's segment identity without a session hash."""

    def __init__(self, root: str, ident0: SegmentIdentity) -> None:
        self.root = root
        self.rank = ident0.rank
        self.ident0 = ident0

    def paths(self, sid: str) -> SessionPaths:
        session_hash = digest32(sid)
        hexname = session_hash.hex()
        # Only [0-9a-f] and fixed suffixes below the realpath'd root: no separator, no "..".
        return SessionPaths(session_hash, hexname, os.path.join(self.root, hexname[:2]))

    def ident(self, paths: SessionPaths, rank: int | None = None) -> SegmentIdentity:
        return replace(self.ident0, session_hash=paths.session_hash,
                       rank=self.rank if rank is None else rank)

    def read_meta(self, path: str) -> bytes:
        return read_small_file(path, _MAX_META_BYTES)

    def check_dir(self, path: str, create: bool) -> bool:
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

    def own_commit(self, paths: SessionPaths) -> CommitRecord:
        """This rank's commit record of a session (SsdError or OSError if none is valid)."""
        return parse_commit(self.read_meta(paths.commit(self.rank)), self.ident(paths))

    def disk_usage(self, paths: SessionPaths) -> int:
        """Bytes this rank's segment of a session holds on disk: its committed length, else the
        whole file, else 0."""
        try:
            return self.own_commit(paths).committed_bytes
        except (SsdError, OSError):
            pass
        try:
            return os.stat(paths.segment(self.rank)).st_size
        except OSError:
            return 0
