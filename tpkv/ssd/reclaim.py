"""L3 start-up reclaim: delete this rank's files that can never be read; account the rest."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tpkv.errors import SsdError, SsdFormatError
from tpkv.ssd.files import RankFiles
from tpkv.ssd.format import (
    ALIGN_BYTES,
    SegmentIdentity,
    check_segment_header,
    parse_commit,
    parse_manifest,
)
from tpkv.ssd.fsutil import fsync_dir, unlink_missing_ok
from tpkv.ssd.paths import MANIFEST_RE, fanout_dirs
from tpkv.ssd.paths import SessionPaths as _Paths

log = logging.getLogger(__name__)



@dataclass
class Found:
    """What a rank keeps: committed bytes of each readable segment (by session hash, hex), its
    fan-out directory and its commit's mtime; and what was reclaimed."""

    usage: dict[str, int] = field(default_factory=dict)
    dirs: dict[str, str] = field(default_factory=dict)
    mtimes: dict[str, int] = field(default_factory=dict)
    files: int = 0
    bytes: int = 0
    reasons: list[str] = field(default_factory=list)


def reclaim(files: RankFiles, view: Callable[[_Paths, str], object]) -> Found:
    """Walk the root of `files` once for its rank (the caller holds its owner lock, so no live
    store writes these files); `view` gives a servable manifest and commit, else SsdError.
    Deleted: the rank's temp files; its segments and commit records that can never be read
    (another model or geometry, a torn or garbage commit or header, a segment without a valid
    commit record or shorter than it, a commit without its segment). A torn tail past the
    committed length is cut off. Rank 0 also deletes manifests it cannot serve (every live TP
    group holds a rank 0 lock, so none is being written). Only tpkv-named files go."""

    rank, root, ident, read_meta = files.rank, files.root, files.ident, files.read_meta
    temp_re = re.compile(
        rf"[0-9a-f]{{64}}\.(r{rank}\.seg|r{rank}\.commit|manifest\.r{rank})\.tmp")
    own_re = re.compile(rf"([0-9a-f]{{64}})\.r{rank}\.(seg|commit)")
    found = Found()
    for sub in fanout_dirs(root):
        with os.scandir(sub) as entries:
            names = sorted(e.name for e in entries)
        removed = False
        hexes: set[str] = set()
        for name in names:
            if temp_re.fullmatch(name):
                removed |= _remove(found, os.path.join(sub, name), "a leftover temp file")
            elif match := own_re.fullmatch(name):
                hexes.add(match.group(1))
        for hexname in sorted(hexes):
            paths = _Paths(bytes.fromhex(hexname), hexname, sub)
            try:
                found.usage[hexname] = _keep(rank, ident(paths), read_meta, paths)
                found.dirs[hexname] = sub
                found.mtimes[hexname] = os.stat(paths.commit(rank)).st_mtime_ns
            except (SsdError, OSError) as exc:
                found.usage.pop(hexname, None)
                found.dirs.pop(hexname, None)
                why = f"unreadable: {exc}"
                removed |= _remove(found, paths.segment(rank), why)
                removed |= _remove(found, paths.commit(rank), why)
        if rank == 0:
            for name in names:
                if match := MANIFEST_RE.fullmatch(name):
                    paths = _Paths(bytes.fromhex(match.group(1)), match.group(1), sub)
                    try:
                        manifest = parse_manifest(read_meta(paths.manifest), ident(paths))
                        view(paths, manifest.session_id)  # rank 0's commit too
                    except (SsdError, OSError) as exc:
                        removed |= _remove(found, paths.manifest, f"unservable: {exc}")
        if removed:
            fsync_dir(sub)
    if found.files:
        log.warning("L3 rank %d: reclaimed %d files (%d bytes) under %s that can never be "
                    "read, e.g. %s", rank, found.files, found.bytes, root,
                    "; ".join(found.reasons[:3]))
    return found


def _keep(rank: int, ident: SegmentIdentity, read_meta: Callable[[str], bytes],
          paths: _Paths) -> int:
    """Committed bytes of this rank's segment of a session if it can be read, its torn tail cut
    off; else SsdError or OSError."""
    commit = parse_commit(read_meta(paths.commit(rank)), ident)
    fd = os.open(paths.segment(rank), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes < commit.committed_bytes:
            raise SsdFormatError(f"segment is {size_bytes} bytes, {commit.committed_bytes} "
                                 f"are committed")
        check_segment_header(os.pread(fd, ALIGN_BYTES, 0),
                             replace(ident, segment_id=commit.segment_id))
        if size_bytes > commit.committed_bytes:  # a write that never committed
            os.ftruncate(fd, commit.committed_bytes)
            os.fsync(fd)
    finally:
        os.close(fd)
    return commit.committed_bytes


def _remove(found: Found, path: str, why: str) -> bool:
    try:
        size_bytes = os.lstat(path).st_size
        unlink_missing_ok(path)
    except FileNotFoundError:
        return False
    except OSError as exc:  # e.g. a directory of a tpkv name: left, and not counted
        log.warning("L3: cannot reclaim %s: %s", path, exc)
        return False
    found.files += 1
    found.bytes += size_bytes
    if len(found.reasons) < 3:
        found.reasons.append(f"{os.path.basename(path)}: {why}")
    return True
