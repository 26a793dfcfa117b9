"""Host time of the calls that issue a resume's copy into L1, part by part, and the whole path
(a stream mark, then CopyEngine.h2d) by what the thread did just before it.

    python bench/host_path.py [--out bench/results/host_path.json]

A resume's copies cannot start before the host has issued them: the controller's plan, the
rank's checks, a timing mark on the copy stream, the descriptors and cudaMemcpyBatchAsync. The
e2e's timelines (bench/resume_timeline.py) see these calls take 3-5 times what they take here
back to back, so the path is also timed after the thread spun, waited on the GPU, or slept.
Shapes: 520 blocks of 512 KiB (the e2e's 1B model, a 260 MB resume) in runs of 40, 8 and 1
contiguous blocks on both sides (13, 65 and 520 descriptors), and 120 blocks in runs of 40.
Host microseconds, median (and 90th percentile) of 290 calls (110 for the path by state)
after 10 not counted, each after the device is idle. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tpkv.config import GiB, HostConfig, KvGeometry  # noqa: E402
from tpkv.workers import cuda_rt, kernels  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402

# The e2e benchmark's 1B model: 16 layers, 8 KV heads of 64, bf16, 16 tokens = 512 KiB a block.
GEOMETRY = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                      block_tokens=16)
L1_SLOTS, L2_SLOTS = 4096, 8192


def timed(fn: Callable[[], Any], before: Callable[[], None] | None = None, reps: int = 300,
          skip: int = 10) -> dict[str, float]:
    """Host microseconds of fn(), each call after the device is idle and `before()`."""
    xs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    kept = np.asarray(xs[skip:]) / 1e3
    return {"p50_us": round(float(np.median(kept)), 1),
            "p90_us": round(float(np.percentile(kept, 90)), 1)}


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gpu_wait() -> None:
    """Wait on an event behind ~5 ms of device work (as a step waits for its forward)."""
    torch.cuda._sleep(5_000_000)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/host_path.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/host_path.py times CUDA calls: it needs a GPU")
    g = GEOMETRY
    host = HostPool(g, L2_SLOTS, HostConfig(budget_bytes=L2_SLOTS * g.block_bytes,
                                            arena_bytes=1 * GiB))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(g, L1_SLOTS, "cuda")
    engine = CopyEngine(hbm, host)
    kernels.warm()
    rng = np.random.default_rng(0)
    stream = engine.streams["h2d"]
    current = torch.cuda.current_stream()
    mark = torch.cuda.Event()
    mark.record(current)

    def runs(n: int, total: int, run: int) -> np.ndarray:
        starts = rng.choice(total // run, n // run, replace=False) * run
        return (starts[:, None] + np.arange(run)).reshape(-1).astype(np.int64)

    def timing_event() -> None:
        torch.cuda.Event(enable_timing=True).record(stream)

    def in_stream() -> None:
        with torch.cuda.stream(stream):
            pass

    parts: dict[str, Any] = {
        "Event(enable_timing=True) + record": timed(timing_event),
        "Event() + record": timed(lambda: torch.cuda.Event().record(stream)),
        "stream.wait_stream(current)": timed(lambda: stream.wait_stream(current)),
        "stream.wait_event(event)": timed(lambda: stream.wait_event(mark)),
        "with torch.cuda.stream(s)": timed(in_stream),
        "torch.cuda.current_stream(device)": timed(lambda: torch.cuda.current_stream(hbm.device)),
    }
    def shape(n: int, run: int) -> dict[str, Any]:
        l1, l2 = runs(n, L1_SLOTS, run), runs(n, L2_SLOTS, run)
        src, dst, size = kernels.merged_copies(hbm.base_ptr, g.block_bytes, host.arena_ptrs,
                                               host.slots_per_arena, l1, l2, True, True)
        return {
            "blocks": n, "run": run, "descriptors": len(src),
            "merged_copies": timed(lambda: kernels.merged_copies(
                hbm.base_ptr, g.block_bytes, host.arena_ptrs, host.slots_per_arena, l1, l2,
                True, True)),
            "memcpy_batch": timed(lambda: cuda_rt.memcpy_batch(dst, src, size,
                                                               stream.cuda_stream)),
            "CopyEngine.h2d": timed(lambda: engine.h2d(l2, l1, ordered=True)),
        }

    shapes = []
    for n, run in ((520, 40), (520, 8), (520, 1), (120, 40)):
        shapes.append(shape(n, run))
        print(json.dumps(shapes[-1]), flush=True)
    for name, t in parts.items():
        print(f"{name:40s} {t}", flush=True)

    l1, l2 = runs(520, L1_SLOTS, 40), runs(520, L2_SLOTS, 40)

    def path() -> None:  # the executor's _mark, then the copy
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.Event(enable_timing=True).record(stream)
        engine.h2d(l2, l1, ordered=True)

    states: dict[str, Callable[[], None] | None] = {
        "hot (back to back)": None,
        "after a 5 ms spin": lambda: spin(0.005),
        "after waiting on ~5 ms of device work": gpu_wait,
        "after a 5 ms sleep": lambda: time.sleep(0.005),
        "after a 50 ms sleep": lambda: time.sleep(0.05),
    }
    by_state = {}
    for name, before in states.items():
        by_state[name] = timed(path, before, reps=120)
        print(f"path {name:38s} {by_state[name]}", flush=True)
    out = {"command": "python " + " ".join(sys.argv),
           "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(), "python": sys.version.split()[0],
           "torch": torch.__version__, "block_bytes": g.block_bytes, "parts_us": parts,
           "shapes": shapes, "path_520_blocks_13_descriptors_by_state_us": by_state}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
