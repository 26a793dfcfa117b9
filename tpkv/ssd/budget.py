"""An L3 rank's byte budget: the bytes each session holds, and the sessions an earlier run left."""

from __future__ import annotations

import threading

from tpkv.errors import TierFullError


class Budget:
    """Bytes on disk per session (by session hash, hex: committed lengths, stale files whole)
    against `budget_bytes`. Sessions found at start that nothing has named since are
    `inherited`: session hash -> (commit mtime, fan-out dir). They go, oldest first, when a write
    needs their room (a controller that started afresh does not know them)."""

    def __init__(self, rank: int, budget_bytes: int) -> None:
        self.rank = rank
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._usage: dict[str, int] = {}
        self._total = 0
        self._inherited: dict[str, tuple[int, str]] = {}

    def adopt(self, usage: dict[str, int], inherited: dict[str, tuple[int, str]]) -> None:
        """Start from what a start-up scan kept: bytes per session, and the sessions inherited."""
        with self._lock:
            self._usage = dict(usage)
            self._total = sum(usage.values())
            self._inherited = dict(inherited)

    def used(self) -> int:
        with self._lock:
            return self._total

    def holds(self, hexname: str) -> bool:
        """Whether a session holds bytes on this rank."""
        with self._lock:
            return hexname in self._usage

    def claim(self, hexname: str) -> None:
        """A session named since the start is this run's: never deleted to make room."""
        with self._lock:
            self._inherited.pop(hexname, None)

    def next_victim(self, writing: str, need: int) -> tuple[str, str] | None:
        """The oldest inherited session other than `writing` (hash, fan-out dir) while `need`
        more bytes would not fit; None when they fit or no such session is left."""
        with self._lock:
            others = [h for h in self._inherited if h != writing]
            if self._total + need <= self.budget_bytes or not others:
                return None
            victim = min(others, key=lambda h: self._inherited[h][0])
            return victim, self._inherited[victim][1]

    def take_inherited(self, hexname: str) -> bool:
        """Stop counting a session as inherited; False if it was not (named meanwhile)."""
        with self._lock:
            return self._inherited.pop(hexname, None) is not None

    def reserve(self, hexname: str, new_bytes: int, sid: str, num_blocks: int) -> None:
        """Count a session at `new_bytes` (a write of `num_blocks` blocks to session `sid`), or
        raise TierFullError and count nothing."""
        with self._lock:
            delta = new_bytes - self._usage.get(hexname, 0)
            if self._total + delta > self.budget_bytes:
                raise TierFullError(
                    f"L3 rank {self.rank}: writing {num_blocks} blocks to session {sid} needs "
                    f"{delta} more bytes; {self._total} of {self.budget_bytes} bytes used, "
                    f"{self.budget_bytes - self._total} free")
            self._usage[hexname] = new_bytes
            self._total += delta

    def settle(self, hexname: str, actual: int) -> None:
        """Count a session at the `actual` bytes on disk (after a failed write or delete)."""
        with self._lock:
            self._total += actual - self._usage.get(hexname, 0)
            self._usage[hexname] = actual

    def forget(self, hexname: str) -> None:
        """Count a session's room free (its delete is under way)."""
        with self._lock:
            self._total -= self._usage.pop(hexname, 0)

    def release(self, hexname: str) -> int:
        """A session's files are gone: stop counting it; return the bytes it held."""
        with self._lock:
            freed = self._usage.pop(hexname, 0)
            self._total -= freed
            self._inherited.pop(hexname, None)
        return freed
