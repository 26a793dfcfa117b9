"""Sweep of copy-engine settings (DMA sub-streams, kernel launch shape) for picking defaults.

    python bench/copy_sweep.py [--gib 1] [--out bench/results/copy_sweep.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.transfer import GEOMETRIES, ceilings, run_copy  # noqa: E402
from tpkv.config import GiB, HostConfig  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/copy_sweep.json")
    args = ap.parse_args()
    total = int(args.gib * GiB)
    ceil = ceilings(total, args.reps)
    print("ceilings", {k: round(v, 1) for k, v in ceil.items()})
    rows = []
    for name, g in GEOMETRIES.items():
        n = total // g.block_bytes
        host = HostPool(g, n, HostConfig(budget_bytes=n * g.block_bytes))
        host.wait_pinned()  # pinned in the background: time it whole
        hbm = HbmPool(g, n, "cuda")
        variants: list[tuple[str, dict]] = [
            (f"dma-s{k}", {"method": "dma", "dma_streams": k}) for k in (1, 4, 8, 16, 32)]
        variants += [(f"kernel-t{t}-w{w}", {"method": "kernel",
                                            "kernel_args": {"threads": t, "words_per_cta": w}})
                     for t in (512, 1024) for w in (2048, 8192)]
        for label, kw in variants:
            engine = CopyEngine(hbm, host, **kw)
            for direction in ("h2d", "d2h", "both"):
                gbps, _ = run_copy(engine, direction, args.reps, seed=2)
                rows.append({"geometry": name, "variant": label, "direction": direction,
                             "gbps": round(gbps, 2), "ratio": round(gbps / ceil[direction], 3)})
                print(f"{name} {label:22s} {direction:4s} {gbps:6.1f} {gbps / ceil[direction]:.3f}")
        host.close()
        del hbm
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
