"""256 KiB blocks both ways at once: DMA attribute hints, SM-capped kernels, DMA + kernel mixes.

    python bench/both_probe.py [--gib 1] [--reps 7] [--out bench/results/both_probe.json]

Each variant moves every block of a 1 GiB pool (half each way for "both"); ratios are against
the same run's contiguous pinned-copy ceilings. Two rounds, variants alternating, against drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.transfer import (  # noqa: E402
    GEOMETRIES,
    ceilings,
    cuda_time_ms,
    placed_slots,
    run_copy,
)
from tpkv.config import GiB, HostConfig  # noqa: E402
from tpkv.workers import cuda_rt  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402


def dma_attr(order: str, overlap: bool, hints: bool) -> Any:
    rt = cuda_rt.runtime()
    attr = rt.cudaMemcpyAttributes()
    attr.srcAccessOrder = getattr(rt.cudaMemcpySrcAccessOrder,
                                  f"cudaMemcpySrcAccessOrder{order}")
    if overlap:
        attr.flags = 1  # cudaMemcpyFlagPreferOverlapWithCompute
    if hints:
        host, dev = rt.cudaMemLocation(), rt.cudaMemLocation()
        host.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
        dev.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
        dev.id = 0
        attr.srcLocHint, attr.dstLocHint = host, dev
    return attr


def mixed_ms(hbm: HbmPool, host: HostPool, num_streams: int, reps: int, seed: int) -> float:
    """Both directions' descriptors interleaved in the same batches, over num_streams streams."""
    import numpy as np

    n = hbm.num_slots
    h, l2 = placed_slots(n, seed, "random")
    half = n // 2
    bb = hbm.block_bytes
    d_src, d_dst = hbm.slot_ptrs(h[:half]), host.slot_ptrs(l2[:half])
    u_src, u_dst = host.slot_ptrs(l2[half:]), hbm.slot_ptrs(h[half:])
    src = np.stack([d_src, u_src], 1).reshape(-1)
    dst = np.stack([d_dst, u_dst], 1).reshape(-1)
    streams = [torch.cuda.Stream() for _ in range(num_streams)]

    def once() -> None:
        cur = torch.cuda.current_stream()
        for part, s in zip(np.array_split(np.arange(len(src)), num_streams), streams):
            s.wait_stream(cur)
            cuda_rt.memcpy_batch(dst[part].tolist(), src[part].tolist(), [bb] * len(part),
                                 s.cuda_stream, 256)
            cur.wait_stream(s)

    return cuda_time_ms(once, reps)


def variants(num_sms: int) -> list[tuple[str, dict[str, Any], Any, tuple[str, ...]]]:
    """(label, CopyEngine kwargs, dma attr or None, directions)."""
    out: list[tuple[str, dict[str, Any], Any, tuple[str, ...]]] = [
        ("dma-default", {"method": "dma"}, None, ("h2d", "d2h", "both"))]
    out += [(f"dma-s{k}", {"method": "dma", "dma_streams": k}, None, ("both",)) for k in (2, 4, 16)]
    for order, overlap, hints in (("Any", False, False), ("Stream", True, False),
                                  ("Any", True, False), ("Stream", False, True)):
        label = f"dma-{order.lower()}{'-overlap' if overlap else ''}{'-hints' if hints else ''}"
        out.append((label, {"method": "dma"}, (order, overlap, hints), ("both",)))
    for ctas in (16, 64):
        kargs = {"max_ctas": ctas}
        out.append((f"kernel-c{ctas}", {"method": "kernel", "kernel_args": kargs}, None,
                    ("h2d", "d2h") + (("both",) if ctas <= num_sms // 2 else ())))
        out.append((f"h2d-dma+d2h-kernel-c{ctas}",
                    {"method": {"h2d": "dma", "d2h": "kernel"}, "kernel_args": kargs}, None,
                    ("both",)))
        out.append((f"h2d-kernel-c{ctas}+d2h-dma",
                    {"method": {"h2d": "kernel", "d2h": "dma"}, "kernel_args": kargs}, None,
                    ("both",)))
    return out


def interference(hbm: HbmPool, host: HostPool, num_sms: int, reps: int) -> list[dict]:
    """A bf16 GEMM loop on the compute stream, alone and with copies both ways beside it."""
    import numpy as np

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    n = hbm.num_slots
    rng = np.random.default_rng(9)
    hs, ls = rng.permutation(n), rng.permutation(n)
    half = n // 2
    setups: list[tuple[str, dict[str, Any] | None]] = [("alone", None), ("dma", {"method": "dma"})]
    setups += [(f"h2d-dma+d2h-kernel-c{c}", {"method": {"h2d": "dma", "d2h": "kernel"},
                                             "kernel_args": {"max_ctas": c}}) for c in (8, 16, 32)]
    rows = []
    for label, kw in setups:
        engine = CopyEngine(hbm, host, **kw) if kw else None
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            if engine is not None:
                for _ in range(4):
                    engine.d2h(hs[:half], ls[:half])
                    engine.h2d(ls[half:], hs[half:])
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                a @ a
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        times.sort()
        rows.append({"setup": label, "gemm_ms_median": round(times[len(times) // 2], 3)})
        print("interference", rows[-1], flush=True)
    base = rows[0]["gemm_ms_median"]
    for r in rows:
        r["slowdown"] = round(r["gemm_ms_median"] / base, 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/both_probe.json")
    args = ap.parse_args()
    total = int(args.gib * GiB)
    ceil = ceilings(total, args.reps)
    print("ceilings", {k: round(v, 1) for k, v in ceil.items()})
    g = GEOMETRIES["llama8b-tp8"]
    n = total // g.block_bytes
    host = HostPool(g, n, HostConfig(budget_bytes=n * g.block_bytes))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(g, n, "cuda")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for rnd in range(args.rounds):
        for label, kw, attr, directions in variants(num_sms):
            engine = CopyEngine(hbm, host, **kw)
            if attr is not None:
                engine.dma_attr = dma_attr(*attr)
            for direction in directions:
                for placement in ("random", "l2-runs", "runs16"):
                    try:
                        gbps, used = run_copy(engine, direction, args.reps, seed=5,
                                              placement=placement)
                    except Exception as exc:  # an attribute this driver refuses
                        print(f"{label} {direction}: {exc}")
                        break
                    ratio = gbps / ceil[direction]
                    rows.append({"round": rnd, "variant": label, "direction": direction,
                                 "placement": placement, "method": used,
                                 "gbps": round(gbps, 2), "ratio": round(ratio, 3)})
                    print(f"r{rnd} {label:28s} {direction:4s} {placement:7s} {gbps:6.1f} "
                          f"{ratio:.3f}", flush=True)
    for rnd in range(args.rounds):
        for k in (2, 8, 16):
            gbps = n * g.block_bytes / mixed_ms(hbm, host, k, args.reps, 5) / 1e6
            rows.append({"round": rnd, "variant": f"mixed-s{k}", "direction": "both",
                         "placement": "random", "method": "dma", "gbps": round(gbps, 2),
                         "ratio": round(gbps / ceil["both"], 3)})
            print(f"r{rnd} mixed-s{k} both random {gbps:6.1f} {gbps / ceil['both']:.3f}",
                  flush=True)
    inter = interference(hbm, host, num_sms, args.reps)
    host.close()
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
           "num_sms": num_sms, "block_bytes": g.block_bytes, "ceilings": ceil, "rows": rows,
           "interference": inter}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
