"""TP-wide manifests of an L3 rank: writing one when every rank agrees, reading and listing."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np

from tpkv.errors import SsdError, SsdFormatError, SsdIoError
from tpkv.ssd.files import RankFiles
from tpkv.ssd.format import CommitRecord, Manifest, pack_manifest, parse_commit, parse_manifest
from tpkv.ssd.fsutil import atomic_write
from tpkv.ssd.paths import MANIFEST_RE, SessionPaths, fanout_dirs

log = logging.getLogger(__name__)


class Manifests:
    """The manifests seen by one rank (`files`) of a TP group of `tp_size` ranks."""

    def __init__(self, files: RankFiles, tp_size: int) -> None:
        self._files = files
        self._tp_size = tp_size

    def write(self, sid: str, paths: SessionPaths) -> bool:
        """Mark a session complete if every rank's commit exists and all agree on the indices."""
        files, own_rank = self._files, self._files.rank
        if not files.check_dir(paths.dir, create=False):
            return False
        commits: list[CommitRecord] = []
        for rank in range(self._tp_size):
            try:
                commit = parse_commit(files.read_meta(paths.commit(rank)),
                                      files.ident(paths, rank))
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
        data = pack_manifest(files.ident(paths), sid, commits)
        try:
            atomic_write(paths.manifest, data, f"{paths.manifest}.r{own_rank}.tmp")
        except OSError as exc:
            raise SsdIoError(f"L3 rank {own_rank}: writing the manifest of session {sid} "
                             f"({len(data)} bytes) failed: {exc}", exc.errno) from exc
        return True

    def servable(self) -> Iterator[tuple[str, str]]:
        """(session id, session hash in hex) of each session this rank can serve: a valid
        manifest, an agreeing commit, a whole segment; found one by one, fan-out dir by dir."""
        files, rank = self._files, self._files.rank
        for sub in fanout_dirs(files.root):
            with os.scandir(sub) as entries:
                names = [e.name for e in entries]
            for name in names:
                match = MANIFEST_RE.fullmatch(name)
                if not match:
                    continue
                paths = SessionPaths(bytes.fromhex(match.group(1)), match.group(1), sub)
                try:
                    manifest = parse_manifest(files.read_meta(paths.manifest), files.ident(paths))
                    self.view(paths, manifest.session_id)
                    size_bytes = os.stat(paths.segment(rank)).st_size
                    if size_bytes < manifest.committed_bytes[rank]:
                        raise SsdFormatError(f"segment is {size_bytes} bytes, the manifest "
                                             f"covers {manifest.committed_bytes[rank]}")
                except (SsdError, OSError) as exc:
                    log.debug("L3 rank %d: skipping %s: %s", rank, name, exc)
                    continue
                yield manifest.session_id, paths.hex

    def view(self, paths: SessionPaths, sid: str) -> tuple[Manifest, CommitRecord]:
        """The manifest and this rank's commit, if valid and the commit extends it; else raise."""
        files, rank = self._files, self._files.rank
        ident = files.ident(paths)
        manifest = parse_manifest(files.read_meta(paths.manifest), ident)
        if manifest.session_id != sid:
            raise SsdFormatError(f"manifest names session {manifest.session_id!r}, not {sid!r}")
        num_records = manifest.num_records[rank]
        commit = parse_commit(files.read_meta(paths.commit(rank)), ident)
        if commit.segment_id != manifest.segment_ids[rank]:
            raise SsdFormatError(f"rank {rank} commit is for segment {commit.segment_id:#x}, "
                                 f"the manifest for {manifest.segment_ids[rank]:#x}")
        if commit.num_records < num_records or not np.array_equal(
                commit.logical_indices[:num_records], manifest.logical_indices):
            raise SsdFormatError(f"rank {rank} commit of {commit.num_records} records does "
                                 f"not extend the manifest's {num_records}")
        return manifest, commit

    def covers(self, paths: SessionPaths, commit: CommitRecord) -> bool:
        """Whether the session's manifest covers every record of `commit`, this rank's own."""
        files, rank = self._files, self._files.rank
        try:
            manifest = parse_manifest(files.read_meta(paths.manifest), files.ident(paths))
        except (SsdError, OSError):
            return False
        return (manifest.segment_ids[rank] == commit.segment_id
                and manifest.num_records[rank] >= commit.num_records)
