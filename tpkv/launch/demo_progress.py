"""`tpkv demo`'s progress: turns done of the workload's, or time of its cap, whichever is ahead.

Rank 0 writes what it has done to a small JSON file (`write`) after every turn; the driver reads
it (`read`) and shows it: a live bar on a terminal, a plain line every `every_s` seconds
otherwise (a log or CI keeps them all; a live bar leaves only its last frame there).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def write(path: str, turns: int, started_unix: float, moves: Mapping[str, int]) -> None:
    """Rank 0: replace `path` with turns done, the run's start (time.time()) and moves so far."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"turns": turns, "started_unix": started_unix, "moves": dict(moves)}, f)
    os.replace(tmp, path)


def read(path: str) -> dict[str, Any] | None:
    """The last `write`, or None before the first (or if it cannot be read)."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def tier_figures(snap: Mapping[str, Any], moved_to_l3: int | None) -> str:
    """Blocks in each tier now (and its share of the tier), blocks moved to L3 so far: L3 is
    sized for far more blocks than the demo holds there at once (sessions come back from it),
    so its share alone reads near 0 % while hundreds of blocks go through it."""
    tiers = snap.get("tiers", {})
    parts = [f"step {snap.get('tick', 0)}", f"sessions {snap.get('num_sessions', 0)}"]
    for name in ("L1", "L2", "L3"):
        t = tiers.get(name)
        if t:
            parts.append(f"{name} {t.get('used', 0)} blocks "
                         f"({100 * (t.get('occupancy') or 0):.0f}%)")
    if moved_to_l3 is not None:
        parts.append(f"{moved_to_l3} moved to L3 so far")
    return "  ".join(parts)


class DemoProgress:
    """The demo's progress from `update(progress file dict or None, figures)` calls."""

    def __init__(self, console: Console, total_turns: int, seconds: float, every_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.console, self.total, self.seconds = console, max(total_turns, 1), seconds
        self.every_s, self.clock = every_s, clock
        self.live = console.is_terminal
        self.fraction = 0.0
        self._last_line: float | None = None
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> DemoProgress:
        if self.live:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

            self._bar = Progress(TextColumn("demo"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[status]}  {task.fields[figures]}"),
                                 console=self.console, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("demo", total=1.0, status="starting ranks",
                                            figures="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def status(self, done: Mapping[str, Any] | None) -> str:
        """'12/75 turns, 8 s of up to 60 s' (and moves self.fraction on, never back)."""
        if done is None:
            return "starting ranks"
        turns = int(done.get("turns", 0))
        elapsed = max(0.0, self.clock() - float(done.get("started_unix", self.clock())))
        self.fraction = max(self.fraction, min(1.0, max(turns / self.total,
                                                        elapsed / self.seconds)))
        return (f"{turns}/{self.total} turns, {elapsed:.0f} s of up to {self.seconds:.0f} s")

    def update(self, done: Mapping[str, Any] | None, figures: str, final: bool = False) -> None:
        status = self.status(done)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.fraction, status=status,
                             figures=figures)
            return
        now = self.clock()
        if final or self._last_line is None or now - self._last_line >= self.every_s:
            self._last_line = now
            self.console.print(f"demo {100 * self.fraction:3.0f}%  {status}  {figures}",
                               soft_wrap=True)
