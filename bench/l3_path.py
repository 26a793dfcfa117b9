"""The L3 store's own CPU cost per byte: writes, a step's reads and reads ahead on a RAM disk.

Writes `--sessions` sessions of `--session-mib` MiB of records with SsdStore (on its writer
threads, as spills) into a RAM-backed directory (default /dev/shm, else the temp directory),
then reads them back the ways the library does: a step's read_blocks (jobs of
READ_CHUNK_BYTES, as tpkv.workers.reads submits them, on the store's reader threads) and a
read ahead (store.read_ahead, twice: the first round into new buffers, then the step's
read_blocks served from them). On a RAM disk the syscalls are memory copies, so what is left
is the store's own work; each phase reports GB/s, the share of its time inside
preadv/pwritev and the process's CPU seconds per GB. The ceilings it is held against,
measured in the same run: a single-thread memcpy and crc32c of this machine and the
directory's raw pwrite / pread speed. A record is moved once and checked once, so one
thread's path can at best run at 1 / (1/raw + 1/crc32c): each phase's `ceiling_gbps` and
`vs_ceiling` (the reads served from memory are held against memcpy).

    python bench/l3_path.py --out bench/results/l3_path.json

`--contend N` runs N pure-Python threads beside it (a serving process's busy main thread, which
holds the GIL while the store's threads wait for it after each system call). `--by-address 0`
hands the blocks without their addresses: records then move through os.pwritev/os.preadv with a
view a block, as lists of buffers do (with 1, the default, by address in one compiled call
without the GIL, whose system calls the syscall clock does not see: its `syscall_s` is then 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpkv.config import KvGeometry, SsdConfig  # noqa: E402
from tpkv.ssd.backend import BlockViews, aligned_empty, row_addresses  # noqa: E402
from tpkv.ssd.format import crc_of  # noqa: E402
from tpkv.ssd.store import SsdStore  # noqa: E402
from tpkv.workers.reads import READ_CHUNK_BYTES  # noqa: E402

# 512 KiB blocks, as the e2e's 1B model stores them per rank (16 tokens a block)
GEOMETRY = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, block_tokens=16)


class SyscallClock:
    """Sums the time inside os.preadv / os.pwritev (all threads), by wrapping them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ns = {"preadv": 0, "pwritev": 0}
        self._orig = {name: getattr(os, name) for name in self.ns}
        for name, fn in self._orig.items():
            setattr(os, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                took = time.perf_counter_ns() - began
                with self.lock:
                    self.ns[name] += took
        return call

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {k: v / 1e9 for k, v in self.ns.items()}
            self.ns = dict.fromkeys(self.ns, 0)
        return out

    def restore(self) -> None:
        for name, fn in self._orig.items():
            setattr(os, name, fn)


class Arena:
    """Page-aligned block slots, handed out as BlockViews like an L2 pool's."""

    def __init__(self, num_blocks: int, block_bytes: int, by_address: bool = True) -> None:
        self.block_bytes = block_bytes
        self.mem = aligned_empty(num_blocks * block_bytes).reshape(num_blocks, block_bytes)
        self.mem[:] = 0  # fault it in, as a pinned pool is
        # as an L2 pool's: their addresses at once (records move as iovecs by address);
        # without, a view a block (the path a list of buffers takes)
        self.addresses_of = ((lambda slots: row_addresses(self.mem, slots)) if by_address
                             else None)

    def views(self, slots: np.ndarray) -> BlockViews:
        return BlockViews(lambda s: self.mem[s], slots, self.block_bytes, True,
                          self.addresses_of)


def ceilings(nbytes: int, repeat: int) -> dict[str, float]:
    src = aligned_empty(nbytes)
    src[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = aligned_empty(nbytes)
    dst[:] = 0
    copy, crc = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        copy.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        crc_of(src)
        crc.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"memcpy_gbps": round(statistics.median(copy), 2),
            "crc32c_gbps": round(statistics.median(crc), 2)}


def raw_file(base: str, nbytes: int, repeat: int, piece: int = 4 << 20) -> dict[str, float]:
    """The directory's own speed, no store: pwrite a new file in `piece`s, pread it back
    into a faulted-in buffer in 32 MiB calls (on a RAM disk: the kernel's copies and page
    allocation, what the store's syscalls cost at best)."""
    buf = aligned_empty(nbytes)
    buf[:] = 7
    path = os.path.join(base, f"tpkv-l3path-raw-{os.getpid()}")
    wr, rd = [], []
    try:
        for _ in range(repeat):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                t = time.perf_counter()
                for at in range(0, nbytes, piece):
                    os.pwrite(fd, buf[at:at + piece], at)
                os.fsync(fd)
                wr.append(nbytes / (time.perf_counter() - t) / 1e9)
                t = time.perf_counter()
                for at in range(0, nbytes, 32 << 20):
                    os.preadv(fd, [buf[at:at + (32 << 20)]], at)
                rd.append(nbytes / (time.perf_counter() - t) / 1e9)
            finally:
                os.close(fd)
                os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"raw_write_gbps": round(statistics.median(wr), 2),
            "raw_read_gbps": round(statistics.median(rd), 2)}


def contenders(n: int, stop: threading.Event) -> list[threading.Thread]:
    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i
    threads = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def phase(clock: SyscallClock, nbytes: int, began: tuple[float, float],
          kind: str) -> dict[str, Any]:
    """GB/s of wall time, the syscalls' seconds (summed over threads) and the process's CPU
    seconds per GB (every thread's: the store's, its CRC pool's, any contender's)."""
    seconds = time.perf_counter() - began[0]
    cpu = time.process_time() - began[1]
    sys_s = clock.take()[kind]
    return {"gb": round(nbytes / 1e9, 3), "s": round(seconds, 4),
            "gbps": round(nbytes / seconds / 1e9, 3),
            "syscall_s": round(sys_s, 4), "cpu_s_per_gb": round(cpu / (nbytes / 1e9), 4)}


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_once(root: str, args: argparse.Namespace, clock: SyscallClock) -> dict[str, Any]:
    bb = GEOMETRY.block_bytes
    per_session = args.session_mib * (1 << 20) // bb
    n = args.sessions
    shutil.rmtree(root, ignore_errors=True)
    cfg = SsdConfig(root=root, budget_bytes=(n + 1) * (per_session + 2) * (bb + 8192),
                    o_direct=bool(args.o_direct), io_threads=args.io_threads,
                    write_threads=args.io_threads, read_ahead_bytes=n * per_session * bb)
    store = SsdStore(cfg, GEOMETRY, "bench-l3-path", 0)
    src = Arena(per_session, bb, bool(args.by_address))
    rng = np.random.default_rng(1)
    src.mem[:] = rng.integers(0, 256, src.mem.shape, dtype=np.uint8)
    dst = Arena(per_session * n, bb, bool(args.by_address))
    idx = np.arange(per_session, dtype=np.int64)
    sids = [f"s{i}" for i in range(n)]
    out: dict[str, Any] = {"direct_io": None}
    clock.take()

    # writes: one write_blocks per session on the writer threads, as spills are submitted
    t = now()
    futs = [store.submit_write(s, idx, src.views(idx)) for s in sids]
    for f in futs:
        f.result()
    out["write"] = phase(clock, n * per_session * bb, t, "pwritev")
    for s in sids:
        assert store.commit_manifest(s)
    out["direct_io"] = store.direct_io

    # a step's reads: jobs of READ_CHUNK_BYTES on the reader threads
    step = max(1, READ_CHUNK_BYTES // bb)
    clock.take()
    t = now()
    futs = []
    for k, s in enumerate(sids):
        for at in range(0, per_session, step):
            part = idx[at:at + step]
            futs.append(store.submit_read(s, part, dst.views(part + k * per_session)))
    misses = sum(int((~f.result()).sum()) for f in futs)
    out["read_step"] = phase(clock, n * per_session * bb, t, "preadv")
    bad = sum(int(not np.array_equal(dst.mem[k * per_session:(k + 1) * per_session], src.mem))
              for k in range(n))
    dst.mem[:] = 0

    # reads ahead: every session's, then the step's read_blocks served from them; a serving
    # store reads ahead again and again, so the first round (its buffers new) is apart
    for rnd in range(2):
        if rnd:
            for s in sids:
                store.ahead.drop(s)
        stats0 = store.read_stats()
        t = now()
        for s in sids:
            assert store.read_ahead(s, idx)
        for s in sids:
            while not store.ahead.done(s):
                store.ahead.wait_any([s], 5.0)
        ahead = phase(clock, n * per_session * bb, t, "preadv")
        stats1 = store.read_stats()
        ahead["job_s"] = round(stats1.job_s - stats0.job_s, 4)
        ahead["jobs"] = stats1.jobs - stats0.jobs
        ahead["per_job_gbps"] = round((stats1.bytes - stats0.bytes) / ahead["job_s"] / 1e9, 3)
        ahead["syscall_share_of_jobs"] = round(
            (stats1.syscall_s - stats0.syscall_s) / ahead["job_s"], 3)
        out["read_ahead" if rnd else "read_ahead_first"] = ahead
    served0 = store.ahead.num_served
    t = now()
    for k, s in enumerate(sids):
        for at in range(0, per_session, step):
            part = idx[at:at + step]
            misses += int((~store.read_blocks(s, part, dst.views(part + k * per_session))).sum())
    out["served"] = phase(clock, n * per_session * bb, t, "preadv")
    out["served"]["blocks_from_memory"] = store.ahead.num_served - served0
    bad += sum(int(not np.array_equal(dst.mem[k * per_session:(k + 1) * per_session], src.mem))
               for k in range(n))
    for s in sids:
        store.ahead.drop(s)
    out["misses"], out["mismatched_sessions"] = misses, bad
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="default: /dev/shm, else the temp directory")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--session-mib", type=int, default=128)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--o-direct", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--contend", type=int, default=0, help="busy pure-Python threads beside it")
    ap.add_argument("--by-address", type=int, default=1,
                    help="0: blocks as views one by one, not by address")
    ap.add_argument("--profile", type=int, default=0, help="cProfile one run; print the top N")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = os.path.join(base, f"tpkv-l3path-{os.getpid()}")
    result: dict[str, Any] = {
        "bench": "l3_path", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "dir": base, "cpus": os.cpu_count(), "block_bytes": GEOMETRY.block_bytes,
        "args": vars(args),
        "ceilings": {**ceilings(256 << 20, 7), **raw_file(base, 256 << 20, 5)}}
    clock = SyscallClock()
    stop = threading.Event()
    contenders(args.contend, stop)
    try:
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            run_once(root, args, clock)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        runs = [run_once(root, args, clock) for _ in range(args.repeat)]
    finally:
        stop.set()
        clock.restore()
    summary: dict[str, Any] = {}
    memcpy = result["ceilings"]["memcpy_gbps"]
    crc = result["ceilings"]["crc32c_gbps"]
    # one thread's best: the raw file I/O, then a CRC pass over the same bytes (served: a copy)
    ceiling = {name: 1 / (1 / result["ceilings"][key] + 1 / crc) for name, key in (
        ("write", "raw_write_gbps"), ("read_step", "raw_read_gbps"),
        ("read_ahead_first", "raw_read_gbps"), ("read_ahead", "raw_read_gbps"))}
    ceiling["served"] = memcpy
    raw = {"write": result["ceilings"]["raw_write_gbps"],
           **dict.fromkeys(("read_step", "read_ahead_first", "read_ahead", "served"),
                           result["ceilings"]["raw_read_gbps"])}
    for name in ("write", "read_step", "read_ahead_first", "read_ahead", "served"):
        gbps = statistics.median(r[name]["gbps"] for r in runs)
        share = statistics.median(r[name]["syscall_s"] / r[name]["s"] for r in runs)
        cpu = statistics.median(r[name]["cpu_s_per_gb"] for r in runs)
        summary[name] = {"gbps_median": round(gbps, 3),
                         "gbps_runs": [r[name]["gbps"] for r in runs],
                         "cpu_s_per_gb_median": round(cpu, 4),
                         "syscall_share_of_wall": round(share, 3),
                         "vs_memcpy": round(gbps / memcpy, 3),
                         "vs_raw_file": round(gbps / raw[name], 3),
                         "ceiling_gbps": round(ceiling[name], 3),
                         "vs_ceiling": round(gbps / ceiling[name], 3)}
    for name in ("read_ahead_first", "read_ahead"):
        summary[name]["per_job_gbps_median"] = round(
            statistics.median(r[name]["per_job_gbps"] for r in runs), 3)
        summary[name]["job_syscall_share"] = round(
            statistics.median(r[name]["syscall_share_of_jobs"] for r in runs), 3)
    result["summary"] = summary
    result["direct_io"] = runs[0]["direct_io"]
    result["misses"] = sum(r["misses"] for r in runs)
    result["mismatched_sessions"] = sum(r["mismatched_sessions"] for r in runs)
    result["runs"] = runs
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if result["misses"] or result["mismatched_sessions"]:
        sys.exit("l3_path: misses or mismatched bytes")


if __name__ == "__main__":
    main()
