"""The controller actor serves its dashboard: URL through Ray, JSON, metrics, token, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import pytest

from tpkv.config import HbmConfig, HostConfig, KvGeometry, SsdConfig, TpkvConfig
from tpkv.controller import SlotMapReplica
from tpkv.controller.actor import NAME, NAMESPACE, ControllerClient, RayMetrics, get_or_create
from tpkv.controller.dashboard import collect
from tpkv.launch.status_cli import add_status_commands

pytestmark = pytest.mark.timeout(120)
TOKEN = "ray-test-token"
DIRS = {0: "L1", 1: "L2", 2: "L3"}


def config(tmp_path: Any, port: int = 0) -> TpkvConfig:
    g = KvGeometry(num_layers=1, num_kv_heads=4, head_dim=8, dtype="float16", block_tokens=4,
                   tp_size=2)
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=8),
                      l2=HostConfig(budget_bytes=8 * 2 * g.block_bytes, arena_bytes=1 << 20),
                      l3=SsdConfig(root=str(tmp_path / "ssd"),
                                   budget_bytes=SsdConfig.budget_for(64, g)),
                      dashboard_port=port, dashboard_token=TOKEN)


def fetch(url: str, token: str | None = TOKEN) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                 if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def kill(handle: Any) -> None:
    import ray

    ray.kill(handle, no_restart=True)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tpkv")
    add_status_commands(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return int(args.func(args))


def test_actor_serves_the_dashboard(ray_cluster: None, tmp_path: Any,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    handle = get_or_create(config(tmp_path))
    client = ControllerClient(handle)
    info = client.dashboard()
    url = info["url"]
    assert url.startswith("http://127.0.0.1:") and info["token_required"] and not info["error"]
    g = config(tmp_path).geometry
    for rank in range(2):
        client.register_rank(rank=rank, geometry=g.__dict__, host=f"node:{rank}")
    reps = [SlotMapReplica(r, 8, 8) for r in range(2)]
    moves: Counter[str] = Counter()
    for n in "abcde":
        client.open_session(session_id=n, num_tokens=16)
    for n in "abcdea":
        res = client.schedule([n], [1])
        reports = [r.apply_step(res) for r in reps]
        for i, plan in enumerate(res.plans):
            assert client.commit([rep[i] for rep in reports]).committed
            for s, d in zip(plan.src_tier.tolist(), plan.dst_tier.tolist()):
                moves[f"{DIRS[s]}->{DIRS[d]}"] += 1
    assert fetch(url + "api/snapshot", token=None)[0] == 401
    assert fetch(url + "api/snapshot", token="wrong")[0] == 401
    status, body = fetch(url + "api/snapshot")
    assert status == 200
    data = json.loads(body)
    derived = data.pop("dashboard")
    snap = client.snapshot()
    for d in (data, snap):
        d.pop("uptime_s")
    assert data == json.loads(json.dumps(snap))
    assert derived["traffic"]["totals"]["moves"] == {k: moves[k] for k in
                                                     derived["traffic"]["directions"]}
    assert sum(moves.values()) > 0
    committed = snap["epoch"]["committed"]
    assert [(r["rank"], r["host"], r["confirmed_epoch"]) for r in
            derived["consistency"]["ranks"]] == [(0, "node:0", committed), (1, "node:1", committed)]
    assert derived["heatmap"]["sessions"] == [s["session"] for s in snap["sessions"]]
    status, text = fetch(url + "metrics")
    assert status == 200
    assert f"tpkv_epoch_committed {float(committed)}" in text.decode()
    for k, n in moves.items():
        assert f'tpkv_moves_total{{direction="{k}"}} {float(n)}' in text.decode()
    assert cli(["dashboard"]) == 0
    assert capsys.readouterr().out.strip() == url
    assert cli(["status", "--sessions", "3"]) == 0
    out = capsys.readouterr().out
    assert f"epoch {committed} committed" in out and "node:1" in out and url in out
    assert cli(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epoch"]["committed"] == committed
    kill(handle)


def test_taken_port_leaves_the_controller_working(ray_cluster: None, tmp_path: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        handle = get_or_create(dataclasses.replace(config(tmp_path), dashboard_port=port))
        client = ControllerClient(handle)
        info = client.dashboard()
        assert info["url"] is None and f"127.0.0.1:{port}" in info["error"]
        client.open_session(session_id="x", num_tokens=4)
        assert client.snapshot()["num_sessions"] == 1  # the controller works on
        assert client.dashboard_payload()["num_sessions"] == 1
    kill(handle)


def test_ray_metrics_take_the_dashboards_numbers(ray_cluster: None, tmp_path: Any) -> None:
    payload = {"tiers": {"L1": {"slots": 8, "used": 3, "occupancy": 0.375, "high_watermark": 0.9,
                                "low_watermark": 0.75, "draining": False}},
               "epoch": {"committed": 4, "next": 5, "num_pending": 0}, "num_sessions": 2,
               "dashboard": {"traffic": {"totals": {"moves": {"L1->L2": 3}, "bytes": {
                   "L1->L2": 300}, "plans": 2, "misses": 0}}}}
    exporter = RayMetrics()
    exporter.export(collect(payload))
    payload["dashboard"]["traffic"]["totals"]["moves"]["L1->L2"] = 5  # type: ignore[index]
    exporter.export(collect(payload))  # counters grow by the difference
    assert exporter.last[("tpkv_moves", ("L1->L2",))] == 5
    assert set(exporter.metrics) >= {"tpkv_tier_used_blocks", "tpkv_moves", "tpkv_sessions"}


def test_polling_clients_share_one_snapshot_per_interval(ray_cluster: None, tmp_path: Any) -> None:
    """16 clients poll /metrics while the controller is called: the bodies come from at most
    one snapshot per dashboard_cache_s (distinct uptimes), and every call is answered."""
    import math
    import threading

    handle = get_or_create(config(tmp_path))
    client = ControllerClient(handle)
    url = client.dashboard()["url"]
    uptimes: list[float] = []
    statuses: list[int] = []
    duration_s = 1.5
    end = time.monotonic() + duration_s

    def poll() -> None:
        while time.monotonic() < end:
            status, body = fetch(url + "metrics")
            statuses.append(status)
            for line in body.decode().splitlines():
                if line.startswith("tpkv_controller_uptime_seconds "):
                    uptimes.append(float(line.split()[1]))

    start = time.monotonic()
    threads = [threading.Thread(target=poll) for _ in range(16)]
    for t in threads:
        t.start()
    calls = 0
    while time.monotonic() < end:
        client.open_session(session_id=f"s{calls}", num_tokens=3)
        client.close_session(session_id=f"s{calls}")
        calls += 1
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - start
    kill(handle)
    assert calls > 0 and len(statuses) > 20 and set(statuses) == {200}, (calls, len(statuses))
    assert len(uptimes) == len(statuses)
    cache_s = 0.5  # the default
    assert len(set(uptimes)) <= math.ceil(elapsed / cache_s) + 1, (len(set(uptimes)), elapsed)
    assert config(tmp_path).dashboard_cache_s == cache_s


def _listeners(port: int) -> set[int]:
    """Pids (of those readable here) holding the socket that listens on `port` (/proc)."""
    import glob
    import os

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) in inodes:
                pids.add(int(fd.split("/")[2]))
        except OSError:
            pass
    return pids


def test_dashboard_is_served_and_rendered_outside_the_controllers_process(
        ray_cluster: None, tmp_path: Any) -> None:
    """The socket that listens is held by a child of the actor's process, not by it, and
    serving frames runs no render in the actor's process (payload, which renders there for
    `tpkv status`, proves the counters count)."""
    import os

    import ray

    def _install_counters(actor: Any) -> int:
        """In the actor's process: count snapshot.render and view.payload calls; its pid."""
        import os

        from tpkv.controller import snapshot
        from tpkv.controller.dashboard import view

        counts = actor._test_counts = Counter()
        def counting(name: str, f: Any) -> Any:
            def counted(*a: Any, **k: Any) -> Any:
                counts[name] += 1
                return f(*a, **k)
            return counted

        snapshot.render = counting("render", snapshot.render)  # type: ignore[assignment]
        view.payload = counting("payload", view.payload)  # type: ignore[assignment]
        return os.getpid()

    handle = get_or_create(dataclasses.replace(config(tmp_path), dashboard_cache_s=0.05))
    client = ControllerClient(handle)
    url = client.dashboard()["url"]
    actor_pid = ray.get(handle.__ray_call__.remote(_install_counters))
    client.open_session(session_id="a", num_tokens=16)
    seen = set()
    for _ in range(6):
        for path in ("api/snapshot", "metrics"):
            status, body = fetch(url + path)
            assert status == 200, body
        seen.add(json.loads(fetch(url + "api/snapshot")[1])["dashboard"]["snapshot_unix_s"])
        time.sleep(0.1)
    assert len(seen) >= 3  # several frames were made
    counts = ray.get(handle.__ray_call__.remote(lambda a: dict(a._test_counts)))
    assert counts == {}, counts
    assert client.dashboard_payload()["num_sessions"] == 1
    counts = ray.get(handle.__ray_call__.remote(lambda a: dict(a._test_counts)))
    assert counts["render"] >= 1 and counts["payload"] >= 1
    port = int(url.rsplit(":", 1)[1].strip("/"))
    owners = _listeners(port)
    assert owners and actor_pid not in owners, (owners, actor_pid)
    for pid in owners:
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == actor_pid  # its child
    kill(handle)
    end = time.monotonic() + 20
    while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") and
                                         "Z" not in open(f"/proc/{p}/stat").read().rsplit(
                                             ")", 1)[1].split()[0] for p in owners):
        time.sleep(0.1)
    assert not _listeners(port), "the dashboard outlived its actor"
