"""Attention of a turn after a cached prefix (a few dozen new tokens against thousands cached),
by implementation: host and GPU time per call, and whether it can be captured in a CUDA graph.

    python bench/prefill_attention.py [--prefix 12000] [--new 65] [--out ...]

A returning turn's prefill is host-bound when launched kernel by kernel (bench/step_profile.py):
this picks the implementation for the engine's prefill graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(host ms per call, GPU ms per call) medians."""
    fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    host.sort()
    gpu.sort()
    return host[len(host) // 2], gpu[len(gpu) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefix", type=int, default=12000)
    ap.add_argument("--new", type=int, default=65)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], help="query heads, KV heads")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/prefill_attention.json")
    args = ap.parse_args()
    hq, hkv, d = args.heads[0], args.heads[1], 64
    seq, qn = args.prefix + args.new, args.new
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, qn, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, seq, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, seq, d, device=dev, dtype=torch.bfloat16, generator=g)
    mask = (torch.arange(seq, device=dev)[None, :]
            <= torch.arange(seq - qn, seq, device=dev)[:, None])
    k_rep, v_rep = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k_rep.float(), v_rep.float(), attn_mask=mask)
    variants: dict[str, tuple[Any, Callable[[], torch.Tensor]]] = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, backend in (("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("math", SDPBackend.MATH), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        ctx = ((lambda b=backend: sdpa_kernel([b])) if backend is not None
               else contextlib.nullcontext)
        variants[f"{name}-gqa"] = (ctx, lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True))
        variants[f"{name}-repeated"] = (ctx, lambda: sdpa(q, k_rep, v_rep, attn_mask=mask))
    rows = []
    for name, (ctx, fn) in variants.items():
        row: dict[str, Any] = {"variant": name}
        try:
            with ctx():
                out = fn()
                row["max_err"] = float((out.float() - ref).abs().max())
                row["host_ms"], row["gpu_ms"] = timed(fn, args.reps)
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                try:
                    with torch.cuda.graph(graph):
                        captured = fn()
                    graph.replay()
                    torch.cuda.synchronize()
                    row["graph"] = bool(torch.equal(captured, fn()))
                except Exception as exc:  # noqa: BLE001 - reported as the row's result
                    row["graph"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a backend that refuses these inputs
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "prefix": args.prefix,
                     "new": qn}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
