"""Host cost of issuing a batch of block copies L2 -> L1, by call path, beside the GPU time.

    python bench/copy_issue.py [--blocks 256 768 4096] [--out bench/results/copy_issue.json]

A resume moves a whole session (hundreds to thousands of blocks) inside the step's host
schedule, so the host time to hand the copies to the GPU adds to the resume unless it is small
against the copy itself. Per call path (cudaMemcpyBatchAsync through cuda.bindings with Python
lists, or through the loaded runtime with numpy arrays) and per shape (whole blocks, or the
layer-by-layer chunks the executor issues so that attention on layer 0 can start first):
host_us (median issue time), gpu_ms (copy time on the stream), GB/s and its ratio to one 1 GiB
pinned copy measured in the same run. Every run's bytes are checked against the source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.transfer import ceilings  # noqa: E402
from tests.pool_cases import random_fill  # noqa: E402
from tpkv.config import GiB, HostConfig, KvGeometry  # noqa: E402
from tpkv.workers import cuda_rt  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.executor import PlanExecutor  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402

# The e2e benchmark's 1B model: 16 layers, 8 KV heads of 64, bf16, 16 tokens = 512 KiB a block.
GEOMETRY = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                      block_tokens=16)


def issue(executor: PlanExecutor, layered: bool, src: np.ndarray, dst: np.ndarray
          ) -> tuple[float, float]:
    """(host seconds to issue, GPU ms of the copies) of one L2 -> L1 batch."""
    executor.layer_events = layered
    stream = executor.engine.streams["h2d"]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    t0 = time.perf_counter()
    executor._h2d(src, dst)
    host = time.perf_counter() - t0
    stop = torch.cuda.Event(enable_timing=True)
    stop.record(stream)
    stop.synchronize()
    return host, start.elapsed_time(stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 768, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="bench/results/copy_issue.json")
    args = ap.parse_args()
    ceil = ceilings(GiB, 5)
    print(f"ceiling: one 1 GiB pinned copy H2D {ceil['h2d']:.1f} GB/s", flush=True)
    g, n_max = GEOMETRY, max(args.blocks)
    host = HostPool(g, n_max, HostConfig(budget_bytes=n_max * g.block_bytes,
                                         arena_bytes=GiB // g.block_bytes * g.block_bytes))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(g, n_max, "cuda")
    for i, arena in enumerate(host.arenas):
        random_fill(arena, i)
    executor = PlanExecutor(CopyEngine(hbm, host), None, timeout_s=60.0)
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for n in args.blocks:
        src = rng.permutation(n_max)[:n]  # scattered L2 slots, as after many sessions' churn
        dst = rng.permutation(n_max)[:n]
        for raw in (True, False):
            cuda_rt.USE_RAW_BATCH = raw
            if raw and cuda_rt.raw_batch_call() is None:
                print("the loaded CUDA runtime has no direct cudaMemcpyBatchAsync; skipped")
                continue
            for layered in (False, True):
                hbm.tensor.zero_()
                runs = [issue(executor, layered, src, dst) for _ in range(args.reps)]
                got = hbm.tensor[torch.from_numpy(dst).cuda()].cpu()
                want = torch.stack([host.block(int(s)) for s in src])
                exact = bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
                host_s = float(np.median([r[0] for r in runs]))
                gpu_ms = float(np.median([r[1] for r in runs]))
                gbps = n * g.block_bytes / (gpu_ms / 1e3) / 1e9
                row = {"blocks": n, "call": "ctypes" if raw else "bindings",
                       "shape": f"layers/{executor.layers_per_copy}" if layered else "blocks",
                       "host_us": round(host_s * 1e6, 1), "gpu_ms": round(gpu_ms, 3),
                       "gbps": round(gbps, 2), "ratio": round(gbps / ceil["h2d"], 3),
                       "host_vs_copy": round(host_s * 1e3 / gpu_ms, 3), "exact": exact}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not exact:
                    raise SystemExit(f"copy of {n} blocks ({row['call']}, {row['shape']}) "
                                     "is not bit-exact")
    cuda_rt.USE_RAW_BATCH = True
    host.close()
    out = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(), "block_bytes": g.block_bytes,
           "ceilings_gbps": ceil, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
