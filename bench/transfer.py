"""Transfer benchmark: L1 <-> L2 copy paths and L2 <-> L3, each beside a ceiling from the same run.

    python bench/transfer.py [--gib 1] [--ssd-dir /tmp/tpkv-bench] [--out FILE]

Needs CUDA for the L1 <-> L2 part; the L2 <-> L3 part runs anywhere (POSIX O_DIRECT or kvikio).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tpkv.config import GiB, HostConfig, KvGeometry, SsdConfig  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402

LLAMA8B = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
GEOMETRIES = {"llama8b-tp1": LLAMA8B, "llama8b-tp8": dataclasses.replace(LLAMA8B, tp_size=8)}
METHODS = ("dma", "kernel", "torch")


def cuda_time_ms(fn, reps: int, before=None) -> float:
    """Median ms of `fn()` over `reps`, timed with events on the current stream, after a warm-up.
    `before()`, when given, runs before each timed call, untimed."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings(num_bytes: int, reps: int, rounds: int = 3, warm_s: float = 0.5
             ) -> dict[str, float]:
    """One contiguous pinned copy each way, and both at once on two streams (GB/s)."""
    dev_a = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    host_a = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        cur = torch.cuda.current_stream()
        for s in (s1, s2):
            s.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    # Warm the link up first: on the H200 a ceiling taken right after a minute without copies
    # once read 24.7 / 36.2 GB/s (the resumes of that run then moved at ~40).
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        dev_a.copy_(host_a, non_blocking=True)
        host_b.copy_(dev_b, non_blocking=True)
        torch.cuda.synchronize()
    fns = {"h2d": (num_bytes, lambda: dev_a.copy_(host_a, non_blocking=True)),
           "d2h": (num_bytes, lambda: host_b.copy_(dev_b, non_blocking=True)),
           "both": (2 * num_bytes, both)}
    # The best of `rounds` medians: a ceiling is what the link can do, not its worst moment.
    return {k: max(n / cuda_time_ms(fn, reps) / 1e6 for _ in range(rounds))
            for k, (n, fn) in fns.items()}


def placed_slots(n: int, seed: int, placement: str) -> tuple[np.ndarray, np.ndarray]:
    """(L1 slots, L2 slots) of n blocks. "random": both sides permuted; "l2-runs": L2 in
    ascending slots; "runsK": both sides in runs of K consecutive slots, runs in random order
    (what an allocator that hands out extents gives a session)."""
    rng = np.random.default_rng(seed)
    if placement.startswith("runs"):
        k = int(placement[4:])
        def runs() -> np.ndarray:
            return (rng.permutation(n // k)[:, None] * k + np.arange(k)).reshape(-1)
        return runs(), runs()
    return rng.permutation(n), (rng.permutation(n) if placement == "random" else np.arange(n))


def run_copy(engine: CopyEngine, direction: str, reps: int, seed: int,
             placement: str = "random") -> tuple[float, str]:
    """GB/s moving every block of the pool; returns (gbps, method used). Placement "random":
    both sides in random order; others as in placed_slots."""
    n = engine.hbm.num_slots
    hbm_slots, host_slots = placed_slots(n, seed, placement)
    half = n // 2
    used: list[str] = []
    cur = torch.cuda.current_stream()

    def once() -> None:
        if direction == "both":
            handles = [engine.d2h(hbm_slots[:half], host_slots[:half]),
                       engine.h2d(host_slots[half:], hbm_slots[half:])]
        elif direction == "d2h":
            handles = [engine.d2h(hbm_slots, host_slots)]
        else:
            handles = [engine.h2d(host_slots, hbm_slots)]
        for h in handles:
            assert h.event is not None
            cur.wait_event(h.event)
        used[:] = sorted({h.method for h in handles})

    ms = cuda_time_ms(once, reps)
    return n * engine.block_bytes / ms / 1e6, "+".join(used)


def bench_copies(total_bytes: int, reps: int) -> list[dict]:
    ceil = ceilings(total_bytes, reps)
    print(f"ceilings (GB/s): H2D {ceil['h2d']:.1f}  D2H {ceil['d2h']:.1f}  both {ceil['both']:.1f}")
    # (placement, label, CopyEngine keyword arguments): every method on random placement; auto
    # with the L2 side in ascending slots, and with both sides in runs of 16 blocks (what the
    # controller's slot stacks hand a session that moves as a whole).
    variants: list[tuple[str, str, dict]] = [
        ("random", m, {"method": m}) for m in (*METHODS, "auto")]
    variants += [("l2-runs", "auto", {}), ("runs16", "auto", {})]
    rows = []
    for name, g in GEOMETRIES.items():
        n = total_bytes // g.block_bytes
        l2 = HostConfig(budget_bytes=n * g.block_bytes, arena_bytes=GiB)
        host = HostPool(g, n, l2)
        host.wait_pinned()  # pinned in the background: time it whole
        hbm = HbmPool(g, n, "cuda")
        for placement, label, kw in variants:
            engine = CopyEngine(hbm, host, **kw)
            for direction in ("h2d", "d2h", "both"):
                if label == "torch" and direction == "both":
                    continue  # the torch fallback stages on the host; not a both-ways path
                gbps, used = run_copy(engine, direction, reps, seed=1, placement=placement)
                row = {"geometry": name, "placement": placement, "direction": direction,
                       "method": label, "method_used": used, "gbps": round(gbps, 2),
                       "ceiling_gbps": round(ceil[direction], 2),
                       "ratio": round(gbps / ceil[direction], 3),
                       "block_bytes": g.block_bytes, "num_blocks": n}
                rows.append(row)
                print(f"{name:12s} {direction:4s} {label:16s} {placement:7s} ({used:10s}) "
                      f"{gbps:6.1f} GB/s ratio {row['ratio']:.3f}")
        host.close()
        del hbm, host
        torch.cuda.empty_cache()
    return rows


def raw_odirect_read(path: Path, request_bytes: int = 64 << 20) -> float:
    """The disk's O_DIRECT read speed (GB/s) over a whole file, in `request_bytes` requests."""
    buf = mmap.mmap(-1, request_bytes)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        total, t0 = os.fstat(fd).st_size, time.perf_counter()
        for off in range(0, total, request_bytes):
            os.preadv(fd, [buf], off)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def raw_odirect(path: Path, total_bytes: int, request_bytes: int = 64 << 20,
                keep: bool = False, direct: bool = True) -> dict[str, float]:
    """The disk's own O_DIRECT write then read speed (GB/s), 64 MiB requests, fsync at the end;
    the file is deleted unless `keep`. `direct` False: through the page cache (a RAM file
    system's own speed)."""
    buf = mmap.mmap(-1, request_bytes)
    buf.write(os.urandom(1 << 20) * (request_bytes >> 20))
    flags = os.O_CREAT | os.O_RDWR | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total_bytes, request_bytes):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write = total_bytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for off in range(0, total_bytes, request_bytes):
            os.preadv(fd, [buf], off)
        read = total_bytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        if not keep:
            path.unlink()
    return {"write": write, "read": read}


def bench_ssd(root: Path, total_bytes: int, backend: str, rounds: int = 3) -> dict:
    """SsdStore against raw O_DIRECT on the same disk, alternating the two for `rounds` rounds
    (a virtio disk drifts by 20% between minutes): medians, and every round's numbers."""
    from tpkv.ssd.store import SsdStore

    g = GEOMETRIES["llama8b-tp1"]
    n = total_bytes // g.block_bytes
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    host = HostPool(g, n, HostConfig(budget_bytes=total_bytes, pin="never"))
    for s in range(n):
        host.block_bytes_view(s)[:] = np.random.default_rng(s).integers(0, 256, g.block_bytes,
                                                                          dtype=np.uint8)
    cfg = SsdConfig(root=str(root / "store"), budget_bytes=4 * total_bytes, backend=backend)
    store = SsdStore(cfg, g, "bench-model", rank=0)
    blocks = [host.block_bytes_view(s) for s in range(n)]
    want = [b.copy() for b in blocks[:8]]
    logical = np.arange(n, dtype=np.int64)
    per: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_read", "write", "read",
                                                   "read_4way")}
    for r in range(rounds):
        raw = raw_odirect(root / "raw.bin", total_bytes)
        per["raw_write"].append(raw["write"])
        per["raw_read"].append(raw["read"])
        session = f"bench-{r}"
        t0 = time.perf_counter()
        store.write_blocks(session, logical, blocks)
        per["write"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
        assert store.commit_manifest(session)
        for b in blocks:
            b[:] = 0
        t0 = time.perf_counter()
        hits = store.read_blocks(session, logical, blocks)
        per["read"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
        assert hits.all() and all(np.array_equal(w, b) for w, b in zip(want, blocks))
        parts = np.array_split(np.arange(n), 4)  # the same read as 4 concurrent requests
        t0 = time.perf_counter()
        futures = [store.submit_read(session, logical[p], [blocks[i] for i in p]) for p in parts]
        assert all(f.result().all() for f in futures)
        per["read_4way"].append(total_bytes / (time.perf_counter() - t0) / 1e9)
        store.drop_session(session)
        print("round", r, {k: round(v[-1], 2) for k, v in per.items()})
    med = {k: statistics.median(v) for k, v in per.items()}
    print(f"raw O_DIRECT: write {med['raw_write']:.2f} GB/s  read {med['raw_read']:.2f} GB/s")
    print(f"SsdStore ({store.backend_name}): write {med['write']:.2f} GB/s  read "
          f"{med['read']:.2f} GB/s  (4 concurrent reads {med['read_4way']:.2f})")
    host.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"ssd_write_gbps": round(med["write"], 3), "ssd_read_gbps": round(med["read"], 3),
            "raw_write_gbps": round(med["raw_write"], 3),
            "raw_read_gbps": round(med["raw_read"], 3),
            "write_ratio": round(med["write"] / med["raw_write"], 3),
            "read_ratio": round(med["read"] / med["raw_read"], 3),
            "read_4way_gbps": round(med["read_4way"], 3),
            "rounds": {k: [round(x, 3) for x in v] for k, v in per.items()},
            "backend": store.backend_name, "bytes": total_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0, help="bytes moved per measurement (GiB)")
    ap.add_argument("--ssd-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ssd-dir", default="/tmp/tpkv-bench-ssd")
    ap.add_argument("--ssd-backend", default="auto", choices=["auto", "posix", "kvikio"])
    ap.add_argument("--ssd-rounds", type=int, default=3)
    ap.add_argument("--skip-ssd", action="store_true")
    ap.add_argument("--out", default="bench/results/transfer.json")
    args = ap.parse_args()
    total = int(args.gib * GiB)
    result: dict = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        result["copies"] = bench_copies(total, args.reps)
    if not args.skip_ssd:
        result["ssd"] = bench_ssd(Path(args.ssd_dir), int(args.ssd_gib * GiB), args.ssd_backend,
                                  args.ssd_rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
