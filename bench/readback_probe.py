"""Does a decode step's token readback wait behind the demotions copied beside its forward?

    python bench/readback_probe.py [--blocks 600] [--trials 20] [--out PATH]

A stand-in forward (matmuls of about the decode step's GPU time) is queued, then `--blocks`
1 MiB blocks are copied L1 -> L2 the way a step's deferred demotions are (ordered after an
event recorded before the forward), then the step reads its tokens back. Host ms per step,
median of the trials, per variant (variants interleaved, against drift):
  quiet       no demotions; tokens by .tolist()
  dma8        demotions by batched DMA on 8 streams (the default for small blocks); .tolist()
  dma1        the same on 1 stream
  dma8-pinned .tolist() replaced by a non-blocking copy into pinned memory + event
  dma8-mapped the tokens written into mapped pinned memory by an SM kernel (no copy engine)
  kernel16    demotions by the SM copy kernel on 16 CTAs; .tolist()
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tpkv.config import GiB, HostConfig, KvGeometry  # noqa: E402
from tpkv.models import readback  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402

GEOM = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 1 MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=600)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--forward-ms", type=float, default=6.0)
    ap.add_argument("--out", default="bench/results/readback_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = 4 * args.blocks
    hbm = HbmPool(GEOM, n, dev)
    host = HostPool(GEOM, n, HostConfig(budget_bytes=n * GEOM.block_bytes, arena_bytes=GiB))
    host.wait_pinned()  # pinned in the background: time it whole
    engines = {"dma8": CopyEngine(hbm, host, method="dma"),
               "dma1": CopyEngine(hbm, host, method="dma", dma_streams=1),
               "kernel16": CopyEngine(hbm, host, method="kernel",
                                      kernel_args={"max_ctas": 16})}
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(3, 128256, device=dev, dtype=torch.float32)
    out = readback.HostReadback(dev)

    def forward(k: int) -> None:
        for _ in range(k):
            torch.mm(a, a)

    # calibrate the stand-in forward to --forward-ms of GPU time
    forward(20)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    forward(50)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 50 * 1e3
    k = max(1, round(args.forward_ms / per))
    rng = np.random.default_rng(0)

    def step(variant: str) -> tuple[float, float]:
        l1 = rng.choice(n, args.blocks, replace=False)
        l2 = rng.choice(n, args.blocks, replace=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mark = torch.cuda.Event()
        mark.record()
        forward(k)
        handle = None
        if variant != "quiet":
            eng = engines.get(variant.split("-")[0], engines["dma8"])
            handle = eng.d2h_pieces(l1, l2, 0, after=mark)[-1]
        if variant == "dma8-pinned":
            tokens = out.pinned(logits.argmax(dim=-1)).tolist()
        elif variant == "dma8-mapped":
            tokens = out.mapped(logits.argmax(dim=-1)).tolist()
        else:
            tokens = logits.argmax(dim=-1).tolist()
        ms = (time.perf_counter() - t0) * 1e3
        assert tokens == logits.argmax(dim=-1).tolist()
        if handle is not None:
            handle.wait()
        return ms, (time.perf_counter() - t0) * 1e3

    variants = ["quiet", "dma8", "dma1", "dma8-pinned", "dma8-mapped", "kernel16"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    copies: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up
        step(v)
    for _ in range(args.trials):
        for v in variants:
            ms, all_ms = step(v)
            times[v].append(ms)
            copies[v].append(all_ms)
    rows = {v: {"step_ms_p50": round(float(np.median(times[v])), 3),
                "with_copies_ms_p50": round(float(np.median(copies[v])), 3)} for v in variants}
    copy_ms = args.blocks * GEOM.block_bytes / 55e9 * 1e3
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "blocks": args.blocks,
           "block_bytes": GEOM.block_bytes, "forward_ms_per_mm": round(per, 3), "mm": k,
           "copy_ms_at_55gbps": round(copy_ms, 3), "variants": rows}
    print(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    host.close()


if __name__ == "__main__":
    main()
