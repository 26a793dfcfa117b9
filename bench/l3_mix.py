"""L3 resume reads beside a stream of spills, as in (c3) of the end-to-end benchmark.

A resume reads a session's blocks from L3 in READ_CHUNK_BYTES jobs (as the executor submits
them) while spills (whole sessions, as the executor submits them) keep the disk busy writing.
Each resume's read time is held against the raw O_DIRECT read speed of the same disk, measured
in the same run (before and after), and against the store's own reads with no spill beside.

    python bench/l3_mix.py --dir /tmp/tpkv-l3mix --out bench/results/l3_mix.json

Variants (--variants, comma-separated): name=io_threads:write_piece_mib[:write_threads[:
read_chunk_mib]]; the write_threads part needs a store that has SsdConfig.write_threads.
`--backlog` is how many spill sessions the spiller keeps submitted at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.transfer import raw_odirect  # noqa: E402
from tpkv.config import KvGeometry, SsdConfig  # noqa: E402
from tpkv.ssd.backend import aligned_empty  # noqa: E402
from tpkv.ssd.store import SsdStore  # noqa: E402
from tpkv.workers.reads import READ_CHUNK_BYTES  # noqa: E402

# 512 KiB blocks, as the e2e's 1B model stores them per rank
GEOMETRY = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, block_tokens=16)


def pattern(block_no: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(block_no).integers(0, 256, nbytes, dtype=np.uint8)


@dataclasses.dataclass
class Variant:
    name: str
    io_threads: int
    write_piece_mib: int
    write_threads: int | None = None
    read_chunk_mib: int = READ_CHUNK_BYTES >> 20  # a read job's share of a session

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, spec = text.split("=")
        parts = [int(x) for x in spec.split(":")]
        return cls(name, *parts)

    def config(self, root: str, budget: int) -> SsdConfig:
        kw = {}
        if self.write_threads is not None:
            kw["write_threads"] = self.write_threads
        return SsdConfig(root=root, budget_bytes=budget, io_threads=self.io_threads,
                         write_piece_bytes=self.write_piece_mib << 20, **kw)


class Spiller(threading.Thread):
    """Keeps `backlog` spill sessions submitted; drops each one it finished after a while."""

    def __init__(self, store: SsdStore, blocks: list[np.ndarray], backlog: int) -> None:
        super().__init__(daemon=True)
        self.store, self.blocks, self.backlog = store, blocks, backlog
        self.stop = threading.Event()
        self.bytes_written = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        logical = np.arange(len(self.blocks), dtype=np.int64)
        pending: list[tuple[str, Future[int]]] = []
        done: list[str] = []
        n = 0
        try:
            while not self.stop.is_set():
                while len(pending) < self.backlog:
                    name = f"spill-{n}"
                    n += 1
                    pending.append((name, self.store.submit_write(name, logical, self.blocks)))
                name, fut = pending.pop(0)
                fut.result()
                self.bytes_written += len(self.blocks) * GEOMETRY.block_bytes
                self.store.commit_manifest(name)
                done.append(name)
                if len(done) > 2:
                    self.store.drop_session_later(done.pop(0))
            for name, fut in pending:
                fut.result()
                done.append(name)
        except BaseException as exc:  # reported by the caller
            self.error = exc
        for name in done:
            self.store.drop_session_later(name)


def resume(store: SsdStore, name: str, out: list[np.ndarray],
           chunk_bytes: int = READ_CHUNK_BYTES) -> float:
    """Read a session in the executor's chunks over the store's threads; seconds taken."""
    step = max(1, chunk_bytes // GEOMETRY.block_bytes)
    logical = np.arange(len(out), dtype=np.int64)
    t0 = time.perf_counter()
    futs = [store.submit_read(name, logical[at:at + step], out[at:at + step])
            for at in range(0, len(out), step)]
    hits = np.concatenate([f.result() for f in futs])
    took = time.perf_counter() - t0
    if not hits.all():
        raise AssertionError(f"{name}: {int((~hits).sum())} of {len(hits)} blocks missed")
    return took


def check(out: list[np.ndarray], expect: list[np.ndarray]) -> None:
    for k in (0, len(out) // 2, len(out) - 1):
        if not np.array_equal(out[k], expect[k]):
            raise AssertionError(f"block {k} read back differs from the bytes written")


def run_variant(v: Variant, root: Path, blocks: list[np.ndarray], out: list[np.ndarray],
                args: argparse.Namespace) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    nbytes = len(blocks) * GEOMETRY.block_bytes
    store = SsdStore(v.config(str(root), budget=64 * nbytes), GEOMETRY, "bench-l3mix", rank=0)
    logical = np.arange(len(blocks), dtype=np.int64)
    names = [f"resume-{k}" for k in range(args.sources)]
    for name in names:
        store.write_blocks(name, logical, blocks)
        assert store.commit_manifest(name)
    chunk = v.read_chunk_mib << 20
    alone = [nbytes / resume(store, names[k % len(names)], out, chunk) / 1e9
             for k in range(args.sources)]
    check(out, blocks)
    spiller = Spiller(store, blocks, args.backlog)
    spiller.start()
    time.sleep(args.gap_s)
    mixed, t0 = [], time.perf_counter()
    for k in range(args.resumes):
        took = resume(store, names[k % len(names)], out, chunk)
        mixed.append(nbytes / took / 1e9)
        check(out, blocks)
        time.sleep(args.gap_s)
    wall = time.perf_counter() - t0
    spiller.stop.set()
    spiller.join()
    stats = store.read_stats() if hasattr(store, "read_stats") else None
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    if spiller.error is not None:
        raise spiller.error
    row = {"variant": dataclasses.asdict(v), "read_alone_gbps": round(statistics.median(alone), 3),
           "read_mixed_gbps_p50": round(statistics.median(mixed), 3),
           "read_mixed_gbps_min": round(min(mixed), 3),
           "read_mixed_gbps": [round(x, 3) for x in mixed],
           "spill_write_gbps": round(spiller.bytes_written / wall / 1e9, 3)}
    if stats is not None:  # the read jobs' share of time inside their record reads' syscalls
        row["read_syscall_share"] = round(stats.syscall_s / max(stats.job_s, 1e-9), 3)
    print(f"{v.name:>12} backlog {args.backlog}: alone {row['read_alone_gbps']:.2f}  beside "
          f"spills p50 {row['read_mixed_gbps_p50']:.2f} min {row['read_mixed_gbps_min']:.2f} "
          f"GB/s; spills wrote {row['spill_write_gbps']:.2f} GB/s; read jobs in syscalls "
          f"{row.get('read_syscall_share', float('nan')):.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/tpkv-l3mix")
    ap.add_argument("--session-mib", type=int, default=450, help="bytes a resume reads")
    ap.add_argument("--sources", type=int, default=3, help="sessions resumes read, in turn")
    ap.add_argument("--resumes", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=0.2, help="pause between resumes")
    ap.add_argument("--backlog", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--variants", default="old=8:16")
    ap.add_argument("--raw-gib", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    n = (args.session_mib << 20) // GEOMETRY.block_bytes
    arena = aligned_empty(2 * n * GEOMETRY.block_bytes)
    blocks = [arena[k * GEOMETRY.block_bytes:(k + 1) * GEOMETRY.block_bytes] for k in range(n)]
    out = [arena[(n + k) * GEOMETRY.block_bytes:(n + k + 1) * GEOMETRY.block_bytes]
           for k in range(n)]
    for k, b in enumerate(blocks):
        b[:] = pattern(k, GEOMETRY.block_bytes)
    raw_bytes = int(args.raw_gib * (1 << 30)) // (64 << 20) * (64 << 20)
    raw_start = raw_odirect(root / "raw.bin", raw_bytes)
    print(f"raw O_DIRECT 64 MiB: read {raw_start['read']:.2f} write {raw_start['write']:.2f} GB/s",
          flush=True)
    rows = []
    for backlog in args.backlog:
        args.backlog = backlog
        for spec in args.variants.split(","):
            row = run_variant(Variant.parse(spec), root / "store", blocks, out, args)
            row["backlog"] = backlog
            rows.append(row)
    args.backlog = None
    raw_end = raw_odirect(root / "raw.bin", raw_bytes)
    print(f"raw O_DIRECT 64 MiB at the end: read {raw_end['read']:.2f} write "
          f"{raw_end['write']:.2f} GB/s", flush=True)
    ceiling = max(raw_start["read"], raw_end["read"])
    for row in rows:
        row["mixed_vs_raw_read"] = round(row["read_mixed_gbps_p50"] / ceiling, 3)
        row["alone_vs_raw_read"] = round(row["read_alone_gbps"] / ceiling, 3)
        print(f"{row['variant']['name']:>12} backlog {row['backlog']}: beside spills "
              f"{row['mixed_vs_raw_read']:.3f} of the raw read ({ceiling:.2f} GB/s), alone "
              f"{row['alone_vs_raw_read']:.3f}")
    result = {"command": "python " + " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc)
              .isoformat(timespec="seconds"), "session_bytes": n * GEOMETRY.block_bytes,
              "raw_gbps_start": {k: round(x, 3) for k, x in raw_start.items()},
              "raw_gbps_end": {k: round(x, 3) for k, x in raw_end.items()}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    os.sync()


if __name__ == "__main__":
    main()
