"""Dashboard load: a controller call's latency idle and while clients poll the dashboard.

    python bench/dashboard_load.py [--sessions 3000] [--rate 1000] [--calls 3000] [--quick]

The controller runs as users run it: the named Ray actor (tpkv.controller.actor), with
`--sessions` open sessions (each scheduled once, so their blocks sit in the tiers). The timed
call is `open_session` through ControllerClient (one Ray round trip; the names are new, and
closed again after each phase, untimed). Phases, in one run: idle, loaded, idle again. In the
loaded phase a separate process (so its threads take no GIL time from the timing loop) runs
`--clients` threads, each with a keep-alive connection to 127.0.0.1, alternating /metrics and
/api/snapshot at a paced total of `--rate` requests/s, for as long as the phase lasts (bounded
by --max-load-s). The idle p99 (both idle phases) is the ceiling; the ratio loaded/idle is the
goal (<= 1.1). Also recorded: requests answered and their rate, status codes, how many distinct
snapshots the /metrics bodies came from (their tpkv_controller_uptime_seconds), the largest
X-Tpkv-Snapshot-Age seen, and how long taking each snapshot held the controller's loop (its
tpkv_dashboard_snapshot_hold_seconds: `snapshot_hold_ms` p50/max over the distinct snapshots).
Writes bench/results/dashboard_load.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpkv.config import HbmConfig, HostConfig, KvGeometry, SsdConfig, TpkvConfig  # noqa: E402

GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype="float8_e4m3fn",
                      block_tokens=16, tp_size=2)
BLOCKS_PER_SESSION = 8
PATHS = ("/metrics", "/api/snapshot")


def make_config(sessions: int, ssd_dir: str, cache_s: float | None) -> TpkvConfig:
    bb = GEOMETRY.block_bytes
    blocks = sessions * BLOCKS_PER_SESSION * 2 + 4096
    cfg = TpkvConfig(geometry=GEOMETRY, l1=HbmConfig(num_blocks=blocks // 4),
                     l2=HostConfig(budget_bytes=blocks // 4 * bb * GEOMETRY.tp_size),
                     l3=SsdConfig(root=ssd_dir, budget_bytes=SsdConfig.budget_for(blocks,
                                                                                  GEOMETRY)),
                     dashboard_port=0)
    return cfg if cache_s is None else dataclasses.replace(cfg, dashboard_cache_s=cache_s)


def load_process(port: int, rate: float, clients: int, max_s: float, stop: Any,
                 started: Any, out: Any) -> None:
    """`clients` threads, paced to `rate` requests/s in all, until `stop` or `max_s`."""
    lock = threading.Lock()
    stats: dict[str, Any] = {"requests": 0, "status": {}, "uptimes": set(), "max_age_s": 0.0,
                             "errors": 0, "lat_ms": [], "holds": {}}
    t0 = time.monotonic()
    end = t0 + max_s
    period = clients / rate

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        nxt = t0 + period * k / clients
        i = k
        while not stop.is_set() and time.monotonic() < end:
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            nxt += period
            path = PATHS[i % 2]
            i += 1
            start = time.perf_counter()
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                body = r.read()
                status, age = r.status, r.getheader("X-Tpkv-Snapshot-Age")
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                with lock:
                    stats["errors"] += 1
                continue
            ms = (time.perf_counter() - start) * 1e3
            uptime = hold = None
            if path == "/metrics" and status == 200:
                for line in body.decode().splitlines():
                    if line.startswith("tpkv_controller_uptime_seconds "):
                        uptime = float(line.split()[1])
                    elif line.startswith("tpkv_dashboard_snapshot_hold_seconds "):
                        hold = float(line.split()[1])
            with lock:
                stats["requests"] += 1
                stats["status"][status] = stats["status"].get(status, 0) + 1
                stats["lat_ms"].append(ms)
                if uptime is not None:
                    stats["uptimes"].add(uptime)
                    if hold is not None:
                        stats["holds"][uptime] = hold
                if age is not None:
                    stats["max_age_s"] = max(stats["max_age_s"], float(age))
        conn.close()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    started.set()
    for t in threads:
        t.join(max_s + 30)
    elapsed = time.monotonic() - t0
    lat = np.asarray(stats["lat_ms"]) if stats["lat_ms"] else np.zeros(1)
    holds = np.asarray(list(stats["holds"].values())) * 1e3
    out.put({"requests": stats["requests"], "elapsed_s": elapsed,
             "rate_per_s": stats["requests"] / elapsed, "errors": stats["errors"],
             "status": {str(k): v for k, v in stats["status"].items()},
             "distinct_snapshots": len(stats["uptimes"]), "max_age_s": stats["max_age_s"],
             "request_p50_ms": float(np.percentile(lat, 50)),
             "request_p99_ms": float(np.percentile(lat, 99)),
             "snapshot_hold_ms": {  # on the controller's loop, per distinct snapshot
                 "snapshots": len(holds),
                 "p50": float(np.percentile(holds, 50)) if len(holds) else None,
                 "max": float(holds.max()) if len(holds) else None}})


def timed_calls(client: Any, n: int, tag: str) -> np.ndarray:
    """open_session of `n` new names, one round trip each (us); then closed, untimed."""
    lat = np.zeros(n)
    names = [f"{tag}-{i}" for i in range(n)]
    for i, name in enumerate(names):
        start = time.perf_counter_ns()
        client.open_session(session_id=name, num_tokens=BLOCKS_PER_SESSION * 16 - 1)
        lat[i] = (time.perf_counter_ns() - start) / 1e3
    for name in names:
        client.close_session(session_id=name)
    return lat


def summary(lat: np.ndarray) -> dict[str, float]:
    return {"calls": len(lat), "p50_us": float(np.percentile(lat, 50)),
            "p99_us": float(np.percentile(lat, 99)),
            "p999_us": float(np.percentile(lat, 99.9)), "max_us": float(lat.max())}


def plot(out: dict[str, Any], lats: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, lat in lats.items():
        xs = np.sort(lat) / 1e3
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.axvline(out["idle"]["p99_us"] / 1e3, color="gray", ls=":", lw=1, label="idle p99")
    ax.axvline(out["idle"]["p99_us"] * 1.1 / 1e3, color="red", ls=":", lw=1,
               label="goal: 1.1x idle p99")
    ax.set_xscale("log")
    ax.set_xlabel("open_session round trip (ms)")
    ax.set_ylabel("fraction of calls")
    load = out["load"]
    ax.set_title(f"{out['sessions']} sessions; dashboard polled at {load['rate_per_s']:.0f} "
                 f"req/s: p99 ratio {out['p99_ratio']:.2f}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=1000.0, help="dashboard requests/s, in all")
    ap.add_argument("--clients", type=int, default=32, help="polling threads")
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per phase")
    ap.add_argument("--max-load-s", type=float, default=120.0, help="bound on the load phase")
    ap.add_argument("--cache-s", type=float, default=None,
                    help="TpkvConfig.dashboard_cache_s (default: the config's default)")
    ap.add_argument("--num-cpus", type=int, default=None, help="ray.init num_cpus")
    ap.add_argument("--quick", action="store_true",
                    help="smoke check: 300 calls per phase, 300 requests/s, 8 clients")
    ap.add_argument("--out", default=None, help="default: bench/results/dashboard_load.json "
                    "(dashboard_load_quick.json with --quick)")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.rate, args.clients = min(args.calls, 300), min(args.rate, 300.0), 8
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" /
                       ("dashboard_load_quick.json" if args.quick else "dashboard_load.json"))
    if not (args.sessions > 0 and args.rate > 0 and 0 < args.clients <= 256 and args.calls > 0):
        ap.error("--sessions, --rate, --calls must be > 0 and --clients in 1..256")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from tpkv.controller.actor import ControllerClient, get_or_create

    ray.init(address="local", num_cpus=args.num_cpus or min(os.cpu_count() or 2, 8),
             include_dashboard=False, namespace=f"tpkv-dashload-{os.getpid()}",
             log_to_driver=False)
    out: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(), "controller": "Ray actor (ControllerClient round trips)",
        "call": "open_session", "sessions": args.sessions, "quick": args.quick,
        "requested_rate_per_s": args.rate, "clients": args.clients}
    lats: dict[str, np.ndarray] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            cfg = make_config(args.sessions, d, args.cache_s)
            out["dashboard_cache_s"] = cfg.dashboard_cache_s
            client = ControllerClient(get_or_create(cfg), timeout_s=60.0)
            info = client.dashboard()
            if info["error"]:
                raise SystemExit(f"dashboard not serving: {info['error']}")
            port = int(info["port"])
            names = [f"s{i}" for i in range(args.sessions)]
            t0 = time.perf_counter()
            for n in names:
                client.open_session(session_id=n, num_tokens=BLOCKS_PER_SESSION * 16 - 1)
            for i in range(0, len(names), 1000):
                batch = names[i:i + 1000]
                client.schedule(batch, np.zeros(len(batch), dtype=np.int64))
            out["setup_s"] = round(time.perf_counter() - t0, 2)
            snap = client.snapshot()
            out["open_sessions"] = snap["num_sessions"]
            out["live_blocks"] = snap["table"]["live_blocks"]
            timed_calls(client, min(200, args.calls), "warm")
            lats["idle"] = timed_calls(client, args.calls, "idle")
            ctx = mp.get_context("spawn")
            stop, started, queue = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=load_process, daemon=True,
                               args=(port, args.rate, args.clients, args.max_load_s, stop,
                                     started, queue))
            proc.start()
            try:
                if not started.wait(60):
                    raise SystemExit("load process did not start")
                time.sleep(0.5)  # the load reaches its rate
                lats["loaded"] = timed_calls(client, args.calls, "loaded")
            finally:
                stop.set()
                load = queue.get(timeout=args.max_load_s + 60)
                proc.join(30)
            lats["idle again"] = timed_calls(client, args.calls, "idle2")
    finally:
        ray.shutdown()
    idle = np.concatenate([lats["idle"], lats["idle again"]])
    out["idle"] = summary(idle)
    out["idle_first"] = summary(lats["idle"])
    out["idle_again"] = summary(lats["idle again"])
    out["loaded"] = summary(lats["loaded"])
    out["load"] = load
    out["p99_ratio"] = out["loaded"]["p99_us"] / out["idle"]["p99_us"]
    out["p50_ratio"] = out["loaded"]["p50_us"] / out["idle"]["p50_us"]
    out["goal_p99_ratio"] = 1.1
    out["goal_met"] = bool(out["p99_ratio"] <= 1.1)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    plot(out, lats, path.with_suffix(".png"))
    print(json.dumps(out, indent=2))
    print(f"open_session p99: idle (ceiling) {out['idle']['p99_us'] / 1e3:.3f} ms, loaded "
          f"{out['loaded']['p99_us'] / 1e3:.3f} ms at {load['rate_per_s']:.0f} dashboard "
          f"req/s: ratio {out['p99_ratio']:.2f} (goal <= 1.1); p50 ratio "
          f"{out['p50_ratio']:.2f}; {load['distinct_snapshots']} snapshots served")
    hold = load["snapshot_hold_ms"]
    if hold["snapshots"]:
        print(f"snapshot capture on the controller's loop: p50 {hold['p50']:.3f} ms, max "
              f"{hold['max']:.3f} ms over {hold['snapshots']} snapshots")


if __name__ == "__main__":
    main()
