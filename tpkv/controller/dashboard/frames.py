"""Frames: snapshots rendered once and served to every request until the next, at most one per
`cache_s`, built on the loop that owns the controller (the actor's), never per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tpkv.controller.dashboard.metrics import MetricSpec


@dataclass(frozen=True)
class Frame:
    """What every request serves until the next build: both bodies, rendered once."""

    t_mono: float  # time.monotonic() when the snapshot was taken (its age: now - t_mono)
    t_unix: float  # time.time() at the same moment (also in the JSON: dashboard.snapshot_unix_s)
    snapshot_json: bytes = b""  # /api/snapshot
    metrics_text: bytes = b""  # /metrics
    specs: list[MetricSpec] = field(default_factory=list)  # for export_fn
    build_s: float = 0.0  # how long the build held the owner's loop
    error: tuple[str, str] | None = None  # (exception name, message): served as 503

    def age_s(self) -> float:
        return max(0.0, time.monotonic() - self.t_mono)


class FrameCache:
    """The latest Frame, and the rule that makes a new one: only when it is older than
    `cache_s`, only on `owner` (the event loop that owns the controller; None: the loop of
    whoever asks), and once for every request that waits meanwhile (one build in flight).

    A failed build is a frame too (with `error`), so a broken snapshot is retried at the same
    rate, not once per request."""

    def __init__(self, build: Callable[[], Frame], cache_s: float,
                 owner: asyncio.AbstractEventLoop | None = None,
                 timeout_s: float = 30.0) -> None:
        if not cache_s >= 0:
            raise ValueError(f"cache_s must be >= 0, got {cache_s}")
        self.build = build
        self.cache_s = float(cache_s)
        self.owner = owner
        self.timeout_s = timeout_s
        self.builds = 0  # frames built so far (tests and the benchmark count them)
        self._frame: Frame | None = None
        self._pending: asyncio.Future[Frame] | None = None  # on the serving loop

    @property
    def latest(self) -> Frame | None:
        return self._frame

    def fresh(self) -> Frame | None:
        frame = self._frame
        if frame is not None and time.monotonic() - frame.t_mono < self.cache_s:
            return frame
        return None

    def refresh(self) -> Frame:
        """On the owner's thread: the latest frame while fresh, else a new one. Every build goes
        through here, one at a time, so builds start at least `cache_s` apart."""
        frame = self.fresh()
        if frame is None:
            frame = self.build()
            self.builds += 1
            self._frame = frame
        return frame

    async def get(self) -> Frame:
        """On the serving loop: the fresh frame, or the one build every waiting request shares.
        Raises TimeoutError when the owner does not answer within `timeout_s`."""
        frame = self.fresh()
        if frame is not None:
            return frame
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._from_owner())
        return await asyncio.shield(self._pending)

    async def _from_owner(self) -> Frame:
        owner = self.owner
        if owner is None or owner is asyncio.get_running_loop():
            return self.refresh()

        async def on_owner() -> Frame:
            return self.refresh()

        done = asyncio.run_coroutine_threadsafe(on_owner(), owner)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
        except asyncio.TimeoutError:
            done.cancel()
            raise TimeoutError(f"the controller's loop built no snapshot within "
                               f"{self.timeout_s} s") from None
