"""Small blocks (256 KiB): DMA descriptors per call and descriptor order, each direction.

    python bench/both_sweep.py [--gib 1] [--out bench/results/both_sweep.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.transfer import GEOMETRIES, ceilings, run_copy  # noqa: E402
from tpkv.config import GiB, HostConfig  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="bench/results/both_sweep.json")
    args = ap.parse_args()
    total = int(args.gib * GiB)
    ceil = ceilings(total, args.reps)
    g = GEOMETRIES["llama8b-tp8"]
    n = total // g.block_bytes
    host = HostPool(g, n, HostConfig(budget_bytes=n * g.block_bytes))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(g, n, "cuda")
    rows = []
    for rnd in range(2):  # two rounds, alternating settings, against drift
        for chunk in (256, 8192):
            for host_order in (True, False):
                engine = CopyEngine(hbm, host, method="dma", dma_chunk=chunk,
                                    host_order=host_order)
                for direction in ("h2d", "d2h", "both"):
                    gbps, _ = run_copy(engine, direction, args.reps, seed=3)
                    ratio = gbps / ceil[direction]
                    rows.append({"round": rnd, "chunk": chunk, "host_order": host_order,
                                 "direction": direction, "gbps": round(gbps, 2),
                                 "ratio": round(ratio, 3)})
                    print(f"r{rnd} c{chunk:5d} host_order={host_order!s:5s} {direction:4s} "
                          f"{gbps:6.1f} {ratio:.3f}")
    host.close()
    Path(args.out).write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
