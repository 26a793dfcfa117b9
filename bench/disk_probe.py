"""The L3 disk's O_DIRECT reads by queue depth and request size, and the store's beside them.

The e2e holds resumes from L3 against one 64 MiB O_DIRECT stream reading back a file it has just
written. This probe asks what else the disk can do: each pattern writes a fresh file, reads it
with `qd` threads taking `req` MiB requests in file order from one queue (as the store's readers
take a session's read jobs), then reads it again at once. The store's rows do the same through
SsdStore (a session written and committed, then read in jobs of `req` MiB over `qd` reader
threads), so the raw and the store's reads of data of the same age sit side by side. Patterns run
round robin, `--rounds` times, in a shuffled order per round (the disk drifts between minutes);
medians per pattern.

    python bench/disk_probe.py --dir /tmp/tpkv-probe --out bench/results/disk_probe.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.l3_mix import GEOMETRY, check, resume  # noqa: E402
from tpkv.config import SsdConfig  # noqa: E402

MiB = 1 << 20


def parse_patterns(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        qd, req = part.split("x")
        out.append((int(qd), int(req)))
    return out


def write_file(path: Path, total: int, buf: mmap.mmap) -> float:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, len(buf)):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def read_file(path: Path, qd: int, req: int, pool: ThreadPoolExecutor,
              bufs: list[mmap.mmap]) -> float:
    """GB/s of reading the whole file in `req`-byte requests, `qd` at a time, in file order."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        total = os.fstat(fd).st_size
        offsets = list(range(0, total, req))
        lanes = [offsets[k::qd] for k in range(qd)]  # lane k: the k-th of every qd requests

        def lane(k: int) -> int:
            view = memoryview(bufs[k])[:req]
            return sum(os.preadv(fd, [view], off) for off in lanes[k])

        t0 = time.perf_counter()
        got = sum(pool.map(lane, range(qd)))
        took = time.perf_counter() - t0
        if got != total:
            raise RuntimeError(f"read {got} of {total} bytes of {path}")
        return total / took / 1e9
    finally:
        os.close(fd)


def store_round(root: Path, qd: int, req: int, blocks: list[np.ndarray],
                out: list[np.ndarray]) -> tuple[float, float, float]:
    """Write a session through SsdStore, then read it twice in `req`-byte jobs over `qd`
    readers: (write, first read, second read) GB/s. Checks the bytes read back."""
    from tpkv.ssd.store import SsdStore

    shutil.rmtree(root, ignore_errors=True)
    nbytes = len(blocks) * GEOMETRY.block_bytes
    cfg = SsdConfig(root=str(root), budget_bytes=4 * nbytes, io_threads=qd)
    logical = np.arange(len(blocks), dtype=np.int64)
    with SsdStore(cfg, GEOMETRY, "bench-disk-probe", rank=0) as store:
        t0 = time.perf_counter()
        store.write_blocks("probe", logical, blocks)
        assert store.commit_manifest("probe")
        wrote = nbytes / (time.perf_counter() - t0) / 1e9
        reads = []
        for _ in range(2):
            for b in out:
                b[:8] = 0
            reads.append(nbytes / resume(store, "probe", out, req) / 1e9)
            check(out, blocks)
    shutil.rmtree(root, ignore_errors=True)
    return wrote, reads[0], reads[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/tpkv-disk-probe")
    ap.add_argument("--file-mib", type=int, default=1024, help="bytes each pattern reads")
    ap.add_argument("--raw", default="1x64,1x128,1x32,2x32,2x64,4x32,8x32,8x8,16x16",
                    help="raw patterns, QDxMiB, comma-separated")
    ap.add_argument("--store", default="8x32,4x64,2x64,1x64",
                    help="store patterns (reader threads x read job MiB); '' for none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    total = args.file_mib * MiB
    raw = parse_patterns(args.raw)
    stores = parse_patterns(args.store) if args.store else []
    top_qd = max([qd for qd, _ in raw] + [1])
    top_req = max([req for _, req in raw] + [64]) * MiB
    wbuf = mmap.mmap(-1, 64 * MiB)
    wbuf.write(os.urandom(MiB) * 64)
    rbufs = [mmap.mmap(-1, top_req) for _ in range(top_qd)]
    nblocks = total // GEOMETRY.block_bytes
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, GEOMETRY.block_bytes, dtype=np.uint8) for _ in range(nblocks)]
    out = [np.empty(GEOMETRY.block_bytes, dtype=np.uint8) for _ in range(nblocks)]

    keys = [("raw", qd, req) for qd, req in raw] + [("store", qd, req) for qd, req in stores]
    got: dict[tuple[str, int, int], dict[str, list[float]]] = {
        k: {"write": [], "first": [], "again": []} for k in keys}
    order = list(keys)
    t_start = time.perf_counter()
    with ThreadPoolExecutor(top_qd) as pool:
        for rnd in range(args.rounds):
            random.Random(rnd).shuffle(order)
            for key in order:
                kind, qd, req = key
                if kind == "raw":
                    path = root / "probe.bin"
                    w = write_file(path, total, wbuf)
                    first = read_file(path, qd, req * MiB, pool, rbufs)
                    again = read_file(path, qd, req * MiB, pool, rbufs)
                    path.unlink()
                else:
                    w, first, again = store_round(root / "store", qd, req * MiB, blocks, out)
                for name, v in (("write", w), ("first", first), ("again", again)):
                    got[key][name].append(v)
                print(f"round {rnd} {kind:>5} {qd:>2} x {req:>2} MiB: write {w:.2f}, read "
                      f"first {first:.2f}, again {again:.2f} GB/s  "
                      f"({time.perf_counter() - t_start:.0f} s)", flush=True)

    base = statistics.median(got[("raw", 1, 64)]["first"]) if ("raw", 1, 64) in got else None
    rows = []
    for key in keys:
        kind, qd, req = key
        row = {"kind": kind, "qd": qd, "request_mib": req,
               **{f"{n}_gbps_p50": round(statistics.median(v), 3) for n, v in got[key].items()},
               **{f"{n}_gbps": [round(x, 3) for x in v] for n, v in got[key].items()}}
        if base:
            row["first_vs_raw_1x64_first"] = round(row["first_gbps_p50"] / base, 3)
            row["again_vs_raw_1x64_first"] = round(row["again_gbps_p50"] / base, 3)
        rows.append(row)
    print(f"\n{'kind':>5} {'qd':>3} {'MiB':>4} {'write':>6} {'first':>6} {'again':>6}  "
          f"(GB/s, p50 of {args.rounds}; the e2e's ceiling is raw 1 x 64 first)")
    for r in rows:
        print(f"{r['kind']:>5} {r['qd']:>3} {r['request_mib']:>4} {r['write_gbps_p50']:>6.2f} "
              f"{r['first_gbps_p50']:>6.2f} {r['again_gbps_p50']:>6.2f}")
    if args.out:
        res = {"command": "python " + " ".join(sys.argv), "date": dt.datetime.now(
            dt.timezone.utc).isoformat(timespec="seconds"), "file_bytes": total,
            "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
