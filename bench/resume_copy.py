"""The copies of one resume, as the e2e benchmark issues them, against the link's ceiling.

    python bench/resume_copy.py [--blocks 705] [--out bench/results/resume_copy.json]

A resume of the e2e's 1B model brings ~700 blocks of 512 KiB from L2 into L1, placed in runs
of consecutive slots on both sides (the e2e's copies averaged 33 blocks a descriptor after
merging). This times that one batch (device time, median of --reps, the link warmed first)
for ways of spreading it over DMA sub-streams, alone and beside an L1 -> L2 batch of the same
size (a resume that demotes), and alone right after 8 ms of GPU work and 1 ms idle (as a
resume follows a forward and its planning), and prints each against the ceiling measured in
the same run: one contiguous pinned copy of 1 GiB (`bench/transfer.py`'s). The ways: the
CopyEngine's (equal numbers of descriptors per sub-stream, merged runs on one stream) with 8
sub-streams and with 1. A split into equal bytes per sub-stream, measured against it, lost and
was removed (docs/decisions.md, "One resume's batch on one stream"; `2bd07df:` has it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.transfer import ceilings, cuda_time_ms  # noqa: E402
from tpkv.config import GiB, HostConfig, KvGeometry  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402

GEOMETRY = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16")  # 512 KiB
# (label, CopyEngine keyword arguments)
VARIANTS: list[tuple[str, dict]] = [
    ("count-s8", {"method": "dma", "dma_streams": 8}),  # the engine's default for these blocks
    ("count-s1", {"method": "dma", "dma_streams": 1}),
]


def runs_slots(rng: np.random.Generator, n: int, run: int, num_slots: int) -> np.ndarray:
    """n distinct slots in runs of `run` consecutive ones, runs in random order and places."""
    k = -(-n // run)
    starts = rng.choice(num_slots // run, size=k, replace=False) * run
    return (starts[:, None] + np.arange(run)).reshape(-1)[:n]


def once(engine: CopyEngine, up: tuple[np.ndarray, np.ndarray],
         down: tuple[np.ndarray, np.ndarray] | None) -> None:
    """The resume's batch into L1 (L2 slots, L1 slots), and `down` (L1, L2) out beside it."""
    handles = [engine.h2d(*up)]
    if down is not None:
        handles.append(engine.d2h(*down))
    for h in handles:
        assert h.event is not None
        torch.cuda.current_stream().wait_event(h.event)


def time_after_compute(fn: functools.partial, reps: int, compute_ms: float = 8.0,
                       idle_ms: float = 1.0) -> float:
    """Median device ms of fn() when it follows, as a resume does, `compute_ms` of GPU work
    without copies (a forward) and `idle_ms` with the GPU idle (the host planning)."""
    cycles = int(compute_ms * 1e-3 * torch.cuda.clock_rate() * 1e6) if hasattr(
        torch.cuda, "clock_rate") else int(compute_ms * 1.98e6)

    def busy_then_idle() -> None:
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        time.sleep(idle_ms / 1e3)
    return cuda_time_ms(fn, reps, before=busy_then_idle)


def contiguous_row(nbytes: int, ceil: dict[str, float], reps: int) -> dict:
    """The same bytes as one pinned copy: what the link gives a transfer of this size."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = cuda_time_ms(lambda: dev.copy_(host, non_blocking=True), reps)
    gbps = nbytes / ms / 1e6
    return {"run": None, "variant": "one-copy", "direction": "h2d", "ms": round(ms, 3),
            "gbps": round(gbps, 2), "ratio": round(gbps / ceil["h2d"], 3),
            "ceiling_ms": round(nbytes / ceil["h2d"] / 1e6, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=705)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 8, 33, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/resume_copy.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("resume_copy.py needs a GPU")
    g, n = GEOMETRY, args.blocks
    slots = 4 * n
    host = HostPool(g, slots, HostConfig(budget_bytes=slots * g.block_bytes, arena_bytes=GiB))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(g, slots, "cuda")
    ceil = ceilings(GiB, 5)
    print(f"ceiling (1 GiB pinned copy, GB/s): H2D {ceil['h2d']:.1f}  D2H {ceil['d2h']:.1f}  "
          f"both {ceil['both']:.1f}")
    nbytes = n * g.block_bytes
    rows = [contiguous_row(nbytes, ceil, args.reps)]
    print(f"one contiguous copy of the same bytes: {rows[0]['ms']:.3f} ms, "
          f"{rows[0]['ratio']:.3f} of the ceiling", flush=True)
    for run in args.runs:
        rng = np.random.default_rng(run)
        up = runs_slots(rng, n, run, slots // 2), runs_slots(rng, n, run, slots // 2)
        down = (runs_slots(rng, n, run, slots // 2) + slots // 2,  # the pools' other halves
                runs_slots(rng, n, run, slots // 2) + slots // 2)
        for label, kw in VARIANTS:
            engine = CopyEngine(hbm, host, **kw)
            for both, after in ((False, False), (True, False), (False, True)):
                fn = functools.partial(once, engine, up, down if both else None)
                ms = time_after_compute(fn, args.reps) if after else cuda_time_ms(fn, args.reps)
                moved = nbytes * (2 if both else 1)
                key = "both" if both else "h2d"
                gbps = moved / ms / 1e6
                descr = engine.num_descriptors["h2d"] / max(1, engine.num_blocks["h2d"])
                rows.append({"run": run, "variant": label, "direction": key,
                             "after_compute": after,
                             "ms": round(ms, 3), "gbps": round(gbps, 2),
                             "ratio": round(gbps / ceil[key], 3),
                             "ceiling_ms": round(moved / ceil[key] / 1e6, 3),
                             "descriptors_per_block": round(descr, 3)})
                print(f"run {run:4d} {label:10s} {key:4s}{' after compute' if after else ''} "
                      f"{ms:7.3f} ms {gbps:6.1f} GB/s "
                      f"{gbps / ceil[key]:.3f} of the ceiling", flush=True)
    host.close()
    out = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "blocks": n, "block_bytes": g.block_bytes,
           "ceilings_gbps": ceil, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
