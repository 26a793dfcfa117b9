"""Where the files of one L3 session live: named from the hash of its id, never the raw id."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_FANOUT_RE = re.compile(r"[0-9a-f]{2}")


def fanout_dirs(root: str) -> list[str]:
    """The fan-out directories under an L3 root (two hex digits of a session hash), sorted."""
    with os.scandir(root) as entries:
        return sorted(e.path for e in entries
                      if _FANOUT_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False))


MANIFEST_RE = re.compile(r"([0-9a-f]{64})\.manifest")  # a session's manifest file name


@dataclass(frozen=True)
class SessionPaths:
    """Every file of one session, all named from the hash of its id (never the raw id)."""

    session_hash: bytes
    hex: str
    dir: str

    def segment(self, rank: int) -> str:
        return os.path.join(self.dir, f"{self.hex}.r{rank}.seg")

    def commit(self, rank: int) -> str:
        return os.path.join(self.dir, f"{self.hex}.r{rank}.commit")

    @property
    def manifest(self) -> str:
        return os.path.join(self.dir, f"{self.hex}.manifest")
