"""Python's cyclic GC kept out of schedule(): paused while it plans, due collections in prepare().

A collection runs at whatever allocation crosses the collector's threshold; inside schedule()
that was a young-generation pass of 0.3-0.6 ms (1M-block bench, 2 of 1000 steps) or a full pass
over the whole heap (tens of ms), either one the slowest step of its run. `pause`/`resume` hold
the collector off for one schedule() call (only if it was on: a caller that turned it off keeps it
off); `collect_due` runs the young collection CPython would run soon, from prepare(), which runs
between steps while the engine computes. Full collections keep CPython's own rule (it weighs
the long-lived objects, which Python code cannot see), outside schedule().
"""

from __future__ import annotations

import gc


def pause() -> bool:
    """Turn the collector off for a schedule() call; -> whether it was on (for `resume`). A
    call, not a context manager: an object made first could itself set off the collection."""
    if gc.isenabled():
        gc.disable()
        return True
    return False


def resume(was_on: bool) -> None:
    """After `pause`: back on if it was on (whoever saw it on turns it back on, so threads
    that pause it too never leave it off)."""
    if was_on:
        gc.enable()


def collect_due() -> int:
    """If the collector is on and half its young threshold is used up, collect now: the middle
    generation where CPython would take it next (its count past its threshold), else the
    youngest. -> the generation collected, -1 for none."""
    if not gc.isenabled():
        return -1
    count, limit = gc.get_count(), gc.get_threshold()
    if limit[0] <= 0 or count[0] < limit[0] // 2:
        return -1
    generation = 1 if count[1] > limit[1] else 0
    gc.collect(generation)
    return generation
