"""Test doubles shared across test folders."""

from __future__ import annotations

from tpkv.controller.dashboard.demo import ManualClock


class FakeClock(ManualClock):
    """A monotonic clock that moves only when told to, starting at 1000 s."""

    def __init__(self, start: float = 1000.0) -> None:
        super().__init__(start)
