"""Soak (not in CI): random L3 spills, loads and drops with periodic SIGKILLs, for minutes.

    python -m bench.soak                 # 10 minutes, writes bench/results/soak.json
    python -m bench.soak --minutes 2

The node (this process) keeps its L3 stores open and moves sessions between host buffers (L2)
and the SSD tier: spills (append + manifest), loads (read, every byte checked against the one
image each block version has), drops. Every few seconds a forked spill writer works on the same
directory and is SIGKILLed after a random number of operations; the node then restarts its
stores, checks that everything acknowledged reads back bit-exact and nothing else is served,
and drops the sessions that are not complete (they would be recomputed). It samples its RSS,
open files and the disk use of the directory over time. Exit status 1 on any mismatch, lost
block or growing open-file count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.faults.crashcheck import (  # the same model and checks as the CI crash tests
    MAX_INDEX,
    SESSIONS,
    Model,
    Tally,
    block_bytes_of,
    close_stores,
    open_stores,
    recover,
    run_op,
    verify,
)
from tests.faults.writer import KILLED, replay, spawn_and_kill, start_server


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def load(stores: list, model: Model, sid: str, l2: list[np.ndarray], tally: Tally) -> int:
    """L3 -> L2: read every index of `sid` on every rank into host buffers; check each byte."""
    for store in stores:
        hits = store.read_blocks(sid, np.arange(MAX_INDEX), l2)
        for idx in range(MAX_INDEX):
            tally.checked += 1
            want = model.acked.get(sid, {}).get(idx)
            if hits[idx] and (want is None or not np.array_equal(
                    l2[idx], block_bytes_of(sid, store.rank, idx, want))):
                tally.wrong += 1
                tally.fail(f"load {sid} rank {store.rank} index {idx}: wrong bytes")
            elif not hits[idx] and want is not None:
                tally.lost += 1
                tally.fail(f"load {sid} rank {store.rank} index {idx}: acked block missed")
            tally.hits += bool(hits[idx])
    return MAX_INDEX * len(stores)


def soak(root: Path, seconds: float, kill_every_s: float, sample_every_s: float,
         seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    model, tally = Model(), Tally()
    start_server()  # before the first sample: its descriptors are not a leak
    stores = open_stores(root)
    l2 = [np.empty(stores[0].block_bytes, np.uint8) for _ in range(MAX_INDEX)]
    counts = {"spills": 0, "loads": 0, "drops": 0, "blocks_loaded": 0, "kills": 0,
              "kills_mid_op": 0, "writer_acked_ops": 0, "restarts": 0}
    series: list[dict[str, Any]] = []
    start = time.monotonic()
    next_kill, next_sample = start + kill_every_s, start
    while (now := time.monotonic()) < start + seconds:
        if now >= next_sample:
            series.append({"t_s": round(now - start, 1), "rss_bytes": rss_bytes(),
                           "open_files": open_files(), "disk_bytes": disk_bytes(root),
                           "ops": counts["spills"] + counts["loads"] + counts["drops"]
                           + counts["writer_acked_ops"], "kills": counts["kills"],
                           "mismatches": tally.wrong + tally.lost})
            next_sample = now + sample_every_s
        if now >= next_kill:  # the spill writer dies mid-work; the node restarts its stores
            close_stores(stores)
            messages, exitcode = spawn_and_kill(root, model, seed=int(rng.integers(2**31)),
                                                wait_messages=int(rng.integers(0, 20)),
                                                delay_s=float(rng.uniform(0, 0.004)))
            counts["writer_acked_ops"] += replay(messages, model)
            assert exitcode == KILLED, f"the writer exited by itself: {exitcode}"
            counts["kills"] += 1
            counts["kills_mid_op"] += model.inflight is not None
            stores = open_stores(root)
            counts["restarts"] += 1
            verify(stores, model, tally, f"after kill {counts['kills']}")
            recover(stores, model, tally, f"after kill {counts['kills']}")
            next_kill = time.monotonic() + kill_every_s
            continue
        sid = SESSIONS[int(rng.integers(len(SESSIONS)))]
        if rng.random() < 0.5:
            counts["blocks_loaded"] += load(stores, model, sid, l2, tally)
            counts["loads"] += 1
        else:
            op = model.pick(rng)
            model.inflight = op
            run_op(stores, op)
            model.ack(op)
            counts["drops" if op.kind == "drop" else "spills"] += 1
    close_stores(stores)
    return {"counts": counts, "tally": tally, "series": series}


def flatness(series: list[dict[str, Any]], key: str) -> dict[str, float]:
    """First and last thirds of the samples (after the first one, the warm-up): their medians."""
    body = series[1:] if len(series) > 3 else series
    third = max(1, len(body) // 3)
    first = float(np.median([s[key] for s in body[:third]]))
    last = float(np.median([s[key] for s in body[-third:]]))
    return {"first_third_median": first, "last_third_median": last, "growth": last - first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every-s", type=float, default=2.0)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--root", help="L3 directory (default: a new temp directory, removed after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    own_root = args.root is None
    root = Path(args.root or tempfile.mkdtemp(prefix="tpkv-soak-")) / "l3"
    try:
        result = soak(root, args.minutes * 60, args.kill_every_s, args.sample_every_s, args.seed)
    finally:
        if own_root:
            shutil.rmtree(root.parent, ignore_errors=True)
    counts, tally, series = result["counts"], result["tally"], result["series"]
    flat = {key: flatness(series, key) for key in ("rss_bytes", "open_files", "disk_bytes")}
    report = {
        "minutes": args.minutes, "kill_every_s": args.kill_every_s, "seed": args.seed,
        "counts": counts,
        "blocks_checked": tally.checked, "hits_bit_exact": tally.hits,
        "wrong_blocks": tally.wrong, "lost_acked_blocks": tally.lost,
        "dirty_misses": tally.dirty_misses, "problems": tally.problems,
        "flatness": flat, "series": series,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    ops = counts["spills"] + counts["loads"] + counts["drops"] + counts["writer_acked_ops"]
    print(f"soak {args.minutes:g} min: {ops} operations ({counts['spills']} spills, "
          f"{counts['loads']} loads, {counts['drops']} drops by the node; "
          f"{counts['writer_acked_ops']} acked by killed writers), {counts['kills']} kills "
          f"survived ({counts['kills_mid_op']} mid-op), {tally.checked} blocks checked, "
          f"mismatches {tally.wrong} wrong + {tally.lost} lost")
    for key, f in flat.items():
        print(f"  {key:11s} first third {f['first_third_median']:>14,.0f}  last third "
              f"{f['last_third_median']:>14,.0f}  growth {f['growth']:>+12,.0f}")
    print(f"wrote {args.out}")
    bad = tally.wrong or tally.lost or tally.dirty_misses or flat["open_files"]["growth"] > 0
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
