"""ServerThread: a DashboardServer on its own thread and event loop (tests, scripts)."""

from __future__ import annotations

import asyncio
import threading

from tpkv.controller.dashboard.server import DashboardServer


class ServerThread:
    """Runs `server` on a private loop in a daemon thread. The controller it reads must not be
    changed while it runs unless `server` builds its snapshots on the loop that changes it
    (`owner_loop`: the actor passes its own)."""

    def __init__(self, server: DashboardServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tpkv-dashboard", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.url = self.loop.run_until_complete(self.server.start())
        except BaseException as exc:  # handed to start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()

    def start(self, timeout_s: float = 10.0) -> str:
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"dashboard did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
