"""Where this process's start-up time goes: seconds per named phase of tpkv.init, for the benchmark.

`tpkv.init` clears the record and each phase adds its wall time under its name (a phase that
runs twice adds up); phases on a background thread record under their own names, so the sum
may exceed the wall time of init. `bench/startup.py` reports `times()` beside its totals. Pure
bookkeeping: importing this module imports nothing heavy, and recording never raises.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_TIMES: dict[str, float] = {}
_LOCK = threading.Lock()


def add(name: str, seconds: float) -> None:
    """Add `seconds` to phase `name`."""
    with _LOCK:
        _TIMES[name] = _TIMES.get(name, 0.0) + seconds


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the body as phase `name` (also when it raises)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - started)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector in the body (imports of torch and numba, init):
    nearly every object made there lives as long as the process, so its collections (hundreds,
    a few of them full passes over the whole heap) free nothing and cost 0.1-0.5 s here. Left
    off if it was off; the collector resumes its usual schedule after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def reset() -> None:
    """Forget every phase (tpkv.init calls this as it starts)."""
    with _LOCK:
        _TIMES.clear()


def times() -> dict[str, float]:
    """Seconds per phase recorded since the last reset, in the order they were first recorded."""
    with _LOCK:
        return dict(_TIMES)


# Set while no start-up work needs the host to itself: the background pinning of L2 past its
# first arena waits for it (`wait_quiet`), so that loading numba's kernels (which maps and
# protects pages for their code) does not queue behind 8 threads faulting in the whole L2.
_QUIET = threading.Event()
_QUIET.set()


def hold_quiet() -> None:
    """Start-up work that background pinning should not crowd begins (tpkv.init's kernels)."""
    _QUIET.clear()


def end_quiet() -> None:
    _QUIET.set()


def wait_quiet(timeout_s: float = 120.0) -> None:
    """Wait (bounded) until no such start-up work runs."""
    _QUIET.wait(timeout_s)
