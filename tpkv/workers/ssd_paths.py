"""Where the files of one L3 session live: named from the hash of its id, never the raw id."""

from __future__ import annotations

import os
from dataclasses import dataclass


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
