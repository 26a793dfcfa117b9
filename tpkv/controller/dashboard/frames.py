"""Frames: snapshots rendered once and served to every request until the next, at most one per
`cache_s`. Only the capture (a copy of what the page shows) runs on the loop that owns the
controller (the actor's); rendering it (the view, JSON, /metrics text) runs on the server's."""

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
    hold_s: float = 0.0  # how long the capture held the owner's loop
    render_s: float = 0.0  # how long rendering it took, off the owner's loop
    error: tuple[str, str] | None = None  # (exception name, message): served as 503

    def age_s(self) -> float:
        return max(0.0, time.monotonic() - self.t_mono)


Render = Callable[[], Frame]  # turns one capture into its frame, on any thread


class FrameCache:
    """The latest Frame, and the rule that makes a new one: only when it is older than
    `cache_s`, and once for every request that waits meanwhile (one build in flight, started
    by the serving loop only, so builds start at least `cache_s` apart). A build is
    `capture()` on `owner` (the event loop that owns the controller; None: the serving loop),
    which copies what the frame shows and returns the `Render` that the serving loop then runs.

    A failed build is a frame too (with `error`), so a broken snapshot is retried at the same
    rate, not once per request."""

    def __init__(self, capture: Callable[[], Render], cache_s: float,
                 owner: asyncio.AbstractEventLoop | None = None,
                 timeout_s: float = 30.0) -> None:
        if not cache_s >= 0:
            raise ValueError(f"cache_s must be >= 0, got {cache_s}")
        self.capture = capture
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

    async def get(self) -> Frame:
        """On the serving loop: the fresh frame, or the one build every waiting request shares.
        Raises TimeoutError when the owner does not answer within `timeout_s`."""
        frame = self.fresh()
        if frame is not None:
            return frame
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._build())
        return await asyncio.shield(self._pending)

    async def _build(self) -> Frame:
        render = await self._capture_on_owner()
        frame = render()  # here, off the owner's loop
        self.builds += 1
        self._frame = frame
        return frame

    async def _capture_on_owner(self) -> Render:
        owner = self.owner
        if owner is None or owner is asyncio.get_running_loop():
            return self.capture()

        async def on_owner() -> Render:
            return self.capture()

        done = asyncio.run_coroutine_threadsafe(on_owner(), owner)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
        except asyncio.TimeoutError:
            done.cancel()
            raise TimeoutError(f"the controller's loop built no snapshot within "
                               f"{self.timeout_s} s") from None
