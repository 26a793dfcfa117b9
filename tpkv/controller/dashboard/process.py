"""The actor's dashboard in a process of its own, so serving and rendering never take the GIL
from the controller: `ServerProcess` (the actor's side) and `main` (the child's), joined by a
private socket pair that carries only what the two send each other (never a network byte).

The child (`python -m tpkv.controller.dashboard.process FD`) runs a DashboardServer. When its
frame is older than `cache_s` (and only then, once for every request waiting) it asks the actor
for a capture; a thread of the actor blocks on the pipe (without the GIL while idle), runs
`DashboardServer.capture_copy` on the actor's loop (`call_soon_threadsafe`) and sends the copy
back; the child renders it and serves it. Every `export_interval_s` the child sends the
latest frame's metrics, which the same thread hands to the actor's `export_fn`. The child exits
when the pipe ends (the actor stopped or died).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tpkv.controller.dashboard.frames import FrameCache, Render
from tpkv.controller.dashboard.metrics import MetricSpec
from tpkv.controller.dashboard.server import DashboardServer

log = logging.getLogger(__name__)


class ServerProcess:
    """Serves `server` (its settings; its `capture_fn` and `recorder` stay here) from a child
    process; captures run on `loop`, the loop that owns the controller."""

    def __init__(self, server: DashboardServer, loop: asyncio.AbstractEventLoop,
                 timeout_s: float = 30.0) -> None:
        self.server, self.loop, self.timeout_s = server, loop, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.captures = 0  # captures sent to the child (tests count them)
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self, timeout_s: float = 20.0) -> str:
        """Blocking (run it off the loop): start the child, wait until it listens; its URL.
        OSError with the child's message when it cannot listen."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the directory holding tpkv/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tpkv.controller.dashboard.process",
                 str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env,
                stdin=subprocess.DEVNULL)
        self._sock = ours  # shut down by stop(): ends both the child and the pipe thread
        self.conn = conn = Connection(os.dup(ours.fileno()))
        atexit.register(self.stop)
        s = self.server
        conn.send({"host": s.host, "port": s.port, "token": s.token, "info": s.info,
                   "cache_s": s.cache_s, "extra_hosts": list(s.extra_hosts),
                   "export_interval_s": s.export_interval_s if s.export_fn else None,
                   "timeout_s": self.timeout_s})
        try:
            if not conn.poll(timeout_s):
                raise OSError(f"the dashboard process did not start within {timeout_s} s")
            msg = conn.recv()
        except EOFError:
            code = self.proc.wait(timeout_s)
            self.stop()
            raise OSError(f"the dashboard process exited with code {code}") from None
        except BaseException:
            self.stop()
            raise
        if msg[0] != "listening":
            self.stop()
            _, errno, text = msg
            raise OSError(errno, text) if errno is not None else OSError(text)
        s.port = int(msg[1])
        self._thread = threading.Thread(target=self._answer, name="tpkv-dashboard-pipe",
                                        daemon=True)
        self._thread.start()
        return s.url

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the child (closing the pipe ends it; terminate if it lingers)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        for end in (self.conn, self._sock):
            if end is not None:
                with contextlib.suppress(OSError):
                    end.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout_s)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _answer(self) -> None:
        """The pipe thread: answers the child's capture requests, passes on its exports."""
        conn = self.conn
        assert conn is not None
        while True:
            try:
                msg = conn.recv()
                if msg[0] == "capture":
                    conn.send(("capture", msg[1], *self._capture()))
                elif msg[0] == "export" and self.server.export_fn is not None:
                    self._export(msg[1])
            except (EOFError, OSError):  # the child or the pipe is gone
                return

    def _capture(self) -> tuple[Any, ...]:
        """On the actor's loop: the copy the child renders, or (None, error name, message)."""
        done: concurrent.futures.Future[tuple[Any, ...]] = concurrent.futures.Future()

        def on_loop() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(self.server.capture_copy())
                except BaseException as exc:  # handed to the pipe thread
                    done.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(on_loop)
            copy = done.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            done.cancel()
            return (None, "TimeoutError", f"the controller's loop built no snapshot within "
                                          f"{self.timeout_s} s")
        except Exception as exc:
            log.exception("tpkv dashboard: snapshot failed")
            return (None, type(exc).__name__, str(exc))
        self.captures += 1
        return copy

    def _export(self, specs: list[MetricSpec]) -> None:
        assert self.server.export_fn is not None
        try:
            self.server.export_fn(specs)
        except Exception:  # never let a bad export end the thread
            log.exception("tpkv dashboard: export failed")


class PipeFrames(FrameCache):
    """The child's FrameCache: a build asks the actor for a capture over the pipe."""

    def __init__(self, server: DashboardServer, conn: Connection, cache_s: float,
                 timeout_s: float) -> None:
        super().__init__(server.capture_frame, cache_s, None, timeout_s)
        self.server, self.conn = server, conn
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[tuple[Any, ...]]] = {}

    def deliver(self, msg: tuple[Any, ...]) -> None:
        """On the serving loop: a reply from the actor (a late one, timed out, is dropped)."""
        fut = self._waiting.pop(msg[1], None)
        if fut is not None and not fut.done():
            fut.set_result(msg[2:])

    async def _capture_on_owner(self) -> Render:
        self._seq += 1
        seq = self._seq
        fut = self._waiting[seq] = asyncio.get_running_loop().create_future()
        self.conn.send(("capture", seq))
        try:
            reply = await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the controller built no snapshot within {self.timeout_s} s"
                               ) from None
        finally:
            self._waiting.pop(seq, None)
        if reply[0] is None:
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        cap, frozen, t_mono, t_unix, hold_s = reply
        return lambda: self.server.render_copy(cap, frozen, t_mono, t_unix, hold_s)


async def _child(conn: Connection, st: dict[str, Any]) -> None:
    def export(specs: list[MetricSpec]) -> None:
        conn.send(("export", specs))

    server = DashboardServer(lambda: {}, host=st["host"], port=st["port"], token=st["token"],
                             info=st["info"], sample_interval_s=None,
                             export_fn=export if st["export_interval_s"] else None,
                             export_interval_s=st["export_interval_s"] or 5.0,
                             cache_s=st["cache_s"], extra_hosts=st["extra_hosts"])
    frames = server.frames = PipeFrames(server, conn, st["cache_s"], st["timeout_s"])
    try:
        await server.start()
    except OSError as exc:
        conn.send(("error", exc.errno, exc.strerror or str(exc)))
        return
    except Exception as exc:
        conn.send(("error", None, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("listening", server.port))
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(ended.set)
                return
            loop.call_soon_threadsafe(frames.deliver, msg)

    threading.Thread(target=read, name="tpkv-dashboard-pipe", daemon=True).start()
    await ended.wait()
    await server.stop()


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    try:
        settings = conn.recv()
    except EOFError:
        return 0
    asyncio.run(_child(conn, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
