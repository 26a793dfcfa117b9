"""Read-only HTTP server of the dashboard (aiohttp): the page, /api/snapshot, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any, Protocol

from aiohttp import web

from tpkv.controller.dashboard import metrics, view
from tpkv.controller.dashboard.frames import Frame, FrameCache, Render
from tpkv.controller.dashboard.guard import Guard, security_headers
from tpkv.controller.dashboard.idle import LastActive
from tpkv.controller.dashboard.recorder import Recorder

log = logging.getLogger(__name__)

SnapshotFn = Callable[[], Mapping[str, Any]]
ExportFn = Callable[[list[metrics.MetricSpec]], None]


class Captured(Protocol):
    """A copy of the controller's state (tpkv.controller.capture.Capture), rendered anywhere."""

    def snapshot(self) -> dict[str, Any]: ...

    def blocks(self, session_id: str) -> Mapping[str, Any]: ...


CaptureFn = Callable[[], Captured]
# Page assets (no data in them): served without the token. Everything else needs it.
ASSETS = {"/": ("index.html", "text/html"), "/static/app.js": ("app.js", "text/javascript"),
          "/static/charts.js": ("charts.js", "text/javascript"),
          "/static/style.css": ("style.css", "text/css")}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
AGE_HEADER = "X-Tpkv-Snapshot-Age"  # seconds since the served snapshot was taken


def load_assets() -> dict[str, tuple[bytes, str]]:
    root = resources.files("tpkv.controller.dashboard") / "static"
    return {path: ((root / name).read_bytes(), ctype) for path, (name, ctype) in ASSETS.items()}


class DashboardServer:
    """Serves what `snapshot_fn` returns (the controller's `snapshot`), never writing to it.

    Serves on the loop that runs `await start()` / `await stop()` (the actor runs it on a
    ServerThread of its own). Requests never call the controller: they get the bodies of the
    latest Frame, rendered once, and a new one is built only when it is older than `cache_s`,
    once for all requests that wait. Only its capture runs on `owner_loop` (the loop that owns
    the controller and its `recorder`: the actor's; None: the serving loop): with `capture_fn`
    (the controller's `capture`) that is a copy of what the page shows (a Capture, a frozen
    Recorder), and the view, heat map, JSON and /metrics text are made from it on the serving
    loop; without it, `snapshot_fn` and `blocks_fn` (the controller's `session_blocks`, the
    heat map's rows) are called on the owner and only the bodies are made on the serving loop.
    `recorder` adds traffic and TP-consistency series and is sampled every
    `sample_interval_s` on the owner (None: only at builds); `export_fn` receives the metrics
    of a frame every `export_interval_s`, on the serving loop (the actor passes them on to
    ray.util.metrics).
    """

    def __init__(self, snapshot_fn: SnapshotFn, *, recorder: Recorder | None = None,
                 blocks_fn: view.BlocksFn | None = None, host: str = "127.0.0.1",
                 port: int = 8470, token: str | None = None,
                 info: Mapping[str, Any] | None = None, sample_interval_s: float | None = 1.0,
                 export_fn: ExportFn | None = None, export_interval_s: float = 5.0,
                 cache_s: float = 0.5, extra_hosts: Iterable[str] = (),
                 owner_loop: asyncio.AbstractEventLoop | None = None,
                 capture_fn: CaptureFn | None = None) -> None:
        self.snapshot_fn = snapshot_fn
        self.recorder = recorder
        self.blocks_fn = blocks_fn
        self.host, self.port, self.token = host, port, token or None
        self.info = dict(info or {})
        self.sample_interval_s = sample_interval_s
        self.export_fn, self.export_interval_s = export_fn, export_interval_s
        self.capture_fn = capture_fn
        self.frames = FrameCache(self.capture_frame, cache_s, owner_loop)
        self.extra_hosts = tuple(extra_hosts)
        self.guard: Guard | None = None
        self.assets = load_assets()
        self.last_active = LastActive()  # the last frame's sessions while none are open
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Future[None]] = []

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and serve; returns the URL. OSError when the address is taken (its message says
        which and names the settings that choose another)."""
        runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(exc.errno, f"{exc.strerror or exc}; choose another port with "
                                     f"TPKV_DASHBOARD_PORT or TpkvConfig.dashboard_port (0: any "
                                     f"free port)") from exc
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        self.guard = Guard.for_bind(self.host, self.port, self.token, self.extra_hosts)
        loop = asyncio.get_running_loop()
        if self.recorder is not None and self.sample_interval_s:  # on the owner: it feeds it
            owner = self.frames.owner
            if owner is None or owner is loop:
                self._tasks.append(loop.create_task(self.sampling(self.sample_interval_s)))
            else:
                self._tasks.append(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                    self.sampling(self.sample_interval_s), owner)))
        if self.export_fn is not None:  # here: it takes the frames requests get
            self._tasks.append(loop.create_task(self._exporting(self.export_fn)))
        log.info("tpkv dashboard at %s", self.url)
        return self.url

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await asyncio.wait_for(task, 5.0)
        self._tasks = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return Guard.url_for(self.host, self.port)

    @property
    def cache_s(self) -> float:
        return self.frames.cache_s

    async def sampling(self, interval_s: float) -> None:
        assert self.recorder is not None
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.recorder.sample()
            except Exception:  # never let a bad sample end the loop
                log.exception("tpkv dashboard: sampling failed")

    async def _exporting(self, export_fn: ExportFn) -> None:
        while True:
            await asyncio.sleep(self.export_interval_s)
            try:
                frame = await self.frames.get()  # the frame requests get (one build)
                if frame.error is None:
                    export_fn(frame.specs)
            except Exception:  # never let a bad export end the loop
                log.exception("tpkv dashboard: export failed")

    # ---- data --------------------------------------------------------------------------------
    def capture(self, heatmap: bool = True) -> Callable[[], dict[str, Any]]:
        """On the owner's loop: what the payload needs, taken now; the returned callable makes
        the payload from it, on any thread. With `capture_fn` only copies are taken here (the
        controller's Capture, a frozen Recorder); without it the payload is built here."""
        rec = self.recorder
        if rec is not None:
            rec.sample()
        if self.capture_fn is None:
            out = view.payload(self.snapshot_fn(), rec, self.blocks_fn, self.info,
                               with_heatmap=heatmap)
            return lambda: out
        cap = self.capture_fn()
        frozen = rec.frozen() if rec is not None else None
        return lambda: view.payload(cap.snapshot(), frozen, cap.blocks, self.info,
                                    with_heatmap=heatmap)

    def payload(self, heatmap: bool = True) -> dict[str, Any]:
        """Snapshot plus derived series, built now: call it on the owner's loop only."""
        return self.capture(heatmap)()

    def capture_frame(self) -> Render:
        """On the owner's loop (FrameCache calls it): the capture, timed; returns the Render
        that makes both bodies of it, off the owner's loop."""
        t_mono, t_unix, start = time.monotonic(), time.time(), time.perf_counter()
        try:
            make = self.capture()
        except Exception as exc:
            log.exception("tpkv dashboard: snapshot failed")
            failed = Frame(t_mono, t_unix, hold_s=time.perf_counter() - start,
                           error=(type(exc).__name__, str(exc)))
            return lambda: failed
        hold_s = time.perf_counter() - start
        return lambda: self.render_frame(make, t_mono, t_unix, hold_s)

    def capture_copy(self) -> tuple[Captured, Recorder | None, float, float, float]:
        """On the owner's loop: what a dashboard in another process renders a frame from (the
        controller's Capture, the frozen Recorder, time.monotonic, time.time, the hold in s)."""
        if self.capture_fn is None:
            raise ValueError("capture_copy needs the server's capture_fn")
        t_mono, t_unix, start = time.monotonic(), time.time(), time.perf_counter()
        rec = self.recorder
        if rec is not None:
            rec.sample()
        cap = self.capture_fn()
        frozen = rec.frozen() if rec is not None else None
        return cap, frozen, t_mono, t_unix, time.perf_counter() - start

    def render_copy(self, cap: Captured, frozen: Recorder | None, t_mono: float, t_unix: float,
                    hold_s: float) -> Frame:
        """Both bodies of what `capture_copy` took (in this process or another)."""
        return self.render_frame(lambda: view.payload(cap.snapshot(), frozen, cap.blocks,
                                                      self.info), t_mono, t_unix, hold_s)

    def render_frame(self, make: Callable[[], dict[str, Any]], t_mono: float, t_unix: float,
                     hold_s: float) -> Frame:
        """Off the owner's loop: the payload `make` builds, as JSON and /metrics text."""
        begin = time.perf_counter()
        try:
            out = make()
            out["dashboard"].update(snapshot_unix_s=round(t_unix, 3), cache_s=self.cache_s,
                                    snapshot_hold_s=round(hold_s, 6))
            self.last_active.finish(out, t_unix)
            body = view.dumps(out).encode()
            specs = metrics.collect(out)
            text = metrics.prometheus_text(specs)
        except Exception as exc:
            log.exception("tpkv dashboard: snapshot failed")
            return Frame(t_mono, t_unix, hold_s=hold_s, render_s=time.perf_counter() - begin,
                         error=(type(exc).__name__, str(exc)))
        return Frame(t_mono, t_unix, body, text, specs, hold_s, time.perf_counter() - begin)

    async def frame(self) -> Frame:
        """The frame a request serves (with `error` when there is none to serve)."""
        try:
            return await self.frames.get()
        except Exception as exc:  # the owner's loop is gone or stuck
            log.warning("tpkv dashboard: no snapshot: %s", exc)
            return Frame(0.0, 0.0, error=(type(exc).__name__, str(exc)))

    # ---- HTTP --------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=1024)
        for path in ASSETS:
            app.router.add_get(path, self._asset)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        guard = self.guard or Guard.for_bind(self.host, self.port, self.token, self.extra_hosts)
        denied = guard.check(request.method, request.headers, request.path in ASSETS)
        if denied is not None:
            response: web.StreamResponse = denied
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                response = web.Response(status=exc.status, text=exc.text or exc.reason,
                                        headers={"Allow": exc.headers.get("Allow", "")}
                                        if exc.status == 405 else None)
        security_headers(response)
        return response

    async def _asset(self, request: web.Request) -> web.Response:
        body, ctype = self.assets[request.path]
        return web.Response(body=body, content_type=ctype, charset="utf-8")

    async def _snapshot(self, request: web.Request) -> web.Response:
        frame = await self.frame()
        if frame.error is not None:
            name, message = frame.error
            return web.json_response({"error": name, "message": message}, status=503)
        return web.Response(body=frame.snapshot_json, content_type="application/json",
                            headers={AGE_HEADER: f"{frame.age_s():.3f}"})

    async def _metrics(self, request: web.Request) -> web.Response:
        frame = await self.frame()
        if frame.error is not None:
            name, message = frame.error
            return web.Response(status=503, text=f"{name}: {message}\n")
        return web.Response(body=frame.metrics_text, headers={
            "Content-Type": PROMETHEUS_TYPE, AGE_HEADER: f"{frame.age_s():.3f}"})
