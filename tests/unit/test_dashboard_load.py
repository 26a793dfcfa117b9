"""Dashboard under polling: one snapshot per cache_s whatever the clients, none on their path."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tpkv.controller.dashboard import DashboardServer, ServerThread

pytestmark = pytest.mark.timeout(60)


class Counting:
    """A snapshot_fn that counts its calls and the threads they ran on; `gate` can hold it."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.threads: set[int] = set()
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self.lock:
            self.calls += 1
            n = self.calls
        self.threads.add(threading.get_ident())
        if not self.gate.wait(20):
            raise TimeoutError("gate never opened")
        if self.fail:
            raise RuntimeError("table is busy")
        return {"tick": n, "uptime_s": float(n), "ranks": {"0": "node:0"},
                "sessions": [{"session": f"s{i}", "tiers": {"L1": 1}} for i in range(3)]}


class OwnerLoop:
    """An event loop on a thread of its own: the controller actor's loop, as Ray runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ident = self.thread.ident

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """A controller call: runs on the loop between other callbacks, as the actor's do."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def poll(port: int, clients: int, duration_s: float) -> list[tuple[str, int, dict[str, str],
                                                                   bytes]]:
    """`clients` threads, each alternating /api/snapshot and /metrics for `duration_s`."""
    out: list[tuple[str, int, dict[str, str], bytes]] = []
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            path = ("/api/snapshot", "/metrics")[i % 2]
            status, headers, body = get(port, path)
            with lock:
                out.append((path, status, headers, body))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 30)
    return out


@pytest.fixture
def owner() -> Iterator[OwnerLoop]:
    o = OwnerLoop()
    yield o
    o.close()


def test_polling_builds_at_most_one_snapshot_per_interval() -> None:
    snap = Counting()
    cache_s, duration_s = 0.2, 1.2
    with ServerThread(DashboardServer(snap, port=0, sample_interval_s=None,
                                      cache_s=cache_s)) as t:
        start = time.monotonic()
        answers = poll(t.server.port, clients=16, duration_s=duration_s)
        elapsed = time.monotonic() - start
    assert len(answers) > 40, len(answers)  # the clients did poll, and often
    assert snap.calls <= math.ceil(elapsed / cache_s) + 1, (snap.calls, len(answers), elapsed)
    uptimes = set()
    for path, status, headers, body in answers:
        assert status == 200, (path, status, body[:200])
        if path == "/metrics":
            assert headers["content-type"].startswith("text/plain")
            line = next(x for x in body.decode().splitlines()
                        if x.startswith("tpkv_controller_uptime_seconds "))
            uptimes.add(float(line.split()[1]))
        else:
            d = json.loads(body)
            assert d["tick"] == int(d["uptime_s"]) >= 1 and len(d["sessions"]) == 3
            uptimes.add(d["uptime_s"])
    assert len(uptimes) <= snap.calls  # every body came from one of the builds


def test_a_failing_snapshot_is_retried_once_per_interval() -> None:
    snap = Counting(fail=True)
    with ServerThread(DashboardServer(snap, port=0, sample_interval_s=None,
                                      cache_s=0.25)) as t:
        start = time.monotonic()
        answers = poll(t.server.port, clients=8, duration_s=0.8)
        elapsed = time.monotonic() - start
    assert answers and all(status == 503 for _, status, _, _ in answers)
    assert all(b"table is busy" in body for _, _, _, body in answers)
    assert snap.calls <= math.ceil(elapsed / 0.25) + 1, (snap.calls, len(answers))


def test_requests_call_the_controller_only_on_its_own_loop(owner: OwnerLoop) -> None:
    """Builds run on the owner's loop (between controller calls), never on the server's."""
    snap = Counting()
    server = DashboardServer(snap, port=0, sample_interval_s=None, cache_s=0.1,
                             owner_loop=owner.loop)
    with ServerThread(server) as t:
        answers = poll(t.server.port, clients=16, duration_s=0.8)
        assert t._thread.ident != owner.ident
    assert answers and all(status == 200 for _, status, _, _ in answers)
    assert snap.calls >= 1 and snap.threads == {owner.ident}


def test_controller_calls_never_wait_for_requests(owner: OwnerLoop) -> None:
    """Deterministic: with the server's loop stuck, and then with a stuck controller call,
    each side still answers; a request never holds the controller, nor a call the pages."""
    snap = Counting()
    server = DashboardServer(snap, port=0, sample_interval_s=None, cache_s=30.0,
                             owner_loop=owner.loop)
    with ServerThread(server) as t:
        port = t.server.port
        assert get(port, "/metrics")[0] == 200 and snap.calls == 1  # the one build
        # 1. The serving loop is stuck (say, 64 clients at once): controller calls go on.
        stuck, release = threading.Event(), threading.Event()
        t.loop.call_soon_threadsafe(lambda: (stuck.set(), release.wait(20)))
        assert stuck.wait(10)
        pending = [threading.Thread(target=get, args=(port, "/api/snapshot"))
                   for _ in range(64)]
        for p in pending:
            p.start()
        try:
            assert [owner.call(lambda k=k: k * 2, timeout_s=5) for k in range(50)] == \
                list(range(0, 100, 2))
        finally:
            release.set()
        for p in pending:
            p.join(20)
        # 2. A controller call holds the owner's loop: the pages are served meanwhile.
        busy, done = threading.Event(), threading.Event()
        owner.loop.call_soon_threadsafe(lambda: (busy.set(), done.wait(20)))
        assert busy.wait(10)
        try:
            answers = poll(port, clients=8, duration_s=0.3)
        finally:
            done.set()
    assert answers and all(status == 200 for _, status, _, _ in answers)
    assert snap.calls == 1  # 64 + len(answers) requests, one build


def test_staleness_is_visible(owner: OwnerLoop) -> None:
    snap = Counting()
    server = DashboardServer(snap, port=0, sample_interval_s=None, cache_s=30.0,
                             owner_loop=owner.loop)
    with ServerThread(server) as t:
        before = time.time()
        status, _, body = get(t.server.port, "/api/snapshot")
        time.sleep(0.3)
        status2, headers, body2 = get(t.server.port, "/api/snapshot")
        _, mheaders, text = get(t.server.port, "/metrics")
    assert status == status2 == 200 and body == body2  # one frame, served twice
    d = json.loads(body2)["dashboard"]
    assert before - 1 <= d["snapshot_unix_s"] <= before + 1 and d["cache_s"] == 30.0
    assert 0.3 <= float(headers["x-tpkv-snapshot-age"]) < 30
    assert float(mheaders["x-tpkv-snapshot-age"]) >= 0.3
    line = next(x for x in text.decode().splitlines()
                if x.startswith("tpkv_dashboard_snapshot_timestamp_seconds "))
    assert float(line.split()[1]) == pytest.approx(d["snapshot_unix_s"], abs=1e-3)


def test_a_stuck_controller_is_a_503_not_a_hang(owner: OwnerLoop) -> None:
    snap = Counting()
    server = DashboardServer(snap, port=0, sample_interval_s=None, cache_s=0.0,
                             owner_loop=owner.loop)
    server.frames.timeout_s = 0.5
    busy, done = threading.Event(), threading.Event()
    owner.loop.call_soon_threadsafe(lambda: (busy.set(), done.wait(20)))
    assert busy.wait(10)
    try:
        with ServerThread(server) as t:
            status, _, body = get(t.server.port, "/api/snapshot")
            mstatus, _, _ = get(t.server.port, "/metrics")
    finally:
        done.set()
    assert status == mstatus == 503 and json.loads(body)["error"] == "TimeoutError"
