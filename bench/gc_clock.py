"""Python's cyclic garbage collections in this process, timed (gc.callbacks).

A collection runs on whatever thread's allocation crosses the collector's threshold, holding
the interpreter for its length: a full pass over a large heap takes tens of milliseconds. The
e2e records say, for each step, how long collections held the process during it (`gc_ms`),
and each configuration how many ran of each generation and the longest (`gc`), so that a slow
step can be told from a collection.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Every collection's generation and seconds since `install`, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []  # (generation, seconds)
        self.total_s = 0.0
        self._started: float | None = None
        self._installed = False

    def install(self) -> GcClock:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            seconds = time.perf_counter() - self._started
            self._started = None
            self.events.append((int(info.get("generation", 0)), seconds))
            self.total_s += seconds

    def mark(self) -> int:
        """A point to count from (`since`)."""
        return len(self.events)

    def since(self, mark: int) -> dict[str, Any]:
        """The collections after `mark`: how many of each generation, their milliseconds in
        all, and the longest."""
        events = self.events[mark:]
        counts = [0, 0, 0]
        for gen, _ in events:
            counts[min(gen, 2)] += 1
        return {"collections_by_generation": counts,
                "ms": round(1e3 * sum(s for _, s in events), 3),
                "max_ms": round(1e3 * max((s for _, s in events), default=0.0), 3)}


GC_CLOCK = GcClock()
