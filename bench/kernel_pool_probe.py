"""The kernel pool's critical path on a cold numba cache, on any machine: one fresh process runs
`tpkv.init(controller="local", device="cpu")` and a first step with a new, empty NUMBA_CACHE_DIR
and the pool forced to `--processes` (also below MIN_PROCESSES cores), and prints the pieces:
each child's ready time, its first compile, the longest kernel, the pool's wall time and the
parent's phases (`tpkv.startup.times()`) after it.

    python bench/kernel_pool_probe.py [--processes 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(processes: int) -> None:
    t0 = time.perf_counter()
    from tpkv import kernel_pool

    kernel_pool.cpus = lambda: processes  # type: ignore[assignment]
    kernel_pool.MIN_PROCESSES = 2
    import tpkv
    from tpkv import startup
    from tpkv.config import HbmConfig, HostConfig, KvGeometry, TpkvConfig

    imported = time.perf_counter() - t0
    g = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    cfg = TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=8),
                     l2=HostConfig(budget_bytes=16 * g.block_bytes))
    t = time.perf_counter()
    rt = tpkv.init(cfg, controller="local", device="cpu")
    init_s = time.perf_counter() - t
    rt.open_session("s", num_tokens=1)
    rt.run_step(["s"], [1], lambda step: None)
    first_step = time.perf_counter() - t
    phases = startup.times()
    rt.close()
    print(json.dumps({"import_s": imported, "init_s": init_s, "first_step_s": first_step,
                      "phases": phases, "pool": kernel_pool.report()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=12)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.processes)
        return
    cache = tempfile.mkdtemp(prefix="tpkv-numba-probe-")
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": f"{ROOT}:" + os.environ.get("PYTHONPATH", "")}
    try:
        out = subprocess.run([sys.executable, __file__, "--child", "--processes",
                              str(a.processes)], env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if out.returncode:
        sys.exit(out.stderr[-4000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    p = r["pool"]
    print(f"init {r['init_s']:.2f} s, first step {r['first_step_s']:.2f} s after init began; "
          "phases " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    if not p:
        print("no pool ran")
        return
    kernels = sorted(p["kernels"], key=lambda k: -k["s"])
    first = {}
    for k in p["kernels"]:
        first.setdefault(k["child"], k)
    print(f"pool: {p['processes']} processes, wall {p['wall_s']:.2f} s; ready (wall) "
          + ", ".join(f"{x:.2f}" for x in p["ready_s"]) + " s, (CPU) "
          + ", ".join(f"{x:.2f}" for x in p["ready_cpu_s"]) + " s")
    if p.get("ready_parts_s"):
        print("  ready parts (s): " + "; ".join(
            ", ".join(f"{k[:-2]} {v:.2f}" for k, v in d.items()) for d in p["ready_parts_s"]))
    if "loaded_during" in p:
        print(f"  signatures read by the parent at {p['signatures_read_s'] or 0:.2f} s; "
              f"{p['loaded_during']} overloads loaded during the pool in {p['load_during_s']:.2f}"
              " s")
    print("  first compile per child (wall/CPU s): " + ", ".join(
        f"{k['kernel'].split(':')[1]} {k['s']:.2f}/{k['cpu_s']:.2f}" for k in first.values()))
    print("  longest kernels (wall/CPU s): " + ", ".join(
        f"{k['kernel'].split(':')[1]} {k['s']:.2f}/{k['cpu_s']:.2f} (child {k['child']})"
        for k in kernels[:5]))
    chains = [p["ready_cpu_s"][c] + sum(k["cpu_s"] for k in p["kernels"] if k["child"] == c)
              for c in range(len(p["ready_cpu_s"]))]
    print("  CPU s per child (ready + its kernels): " + ", ".join(f"{x:.2f}" for x in chains))
    if p.get("ends_s"):
        print("  children done at (s after the pool began): "
              + ", ".join(f"{x:.2f}" for x in p["ends_s"]))


if __name__ == "__main__":
    main()
