"""Start-up: time from `tpkv.init` to the first step at a large pinned L2, in a fresh process,
in a second one (numba's kernels then load from its disk cache) and after a close and restart in
the same process, and until the whole L2 is pinned, against the raw cudaHostRegister speed
measured in the same run.

    python bench/startup.py [--l2-gib 96] [--l1-gib 2] [--fresh-cache]   # on the GPU machine
    python bench/startup.py --device cpu --l2-gib 1 --l1-gib 0.25 --out /tmp/s.json  # a smoke run

Each measured process: `tpkv.init(config, controller="local", device="cuda")` with L1 and L2 of
the given sizes and L3 off; then a first step (one session, one token); then quiet steps while
L2 is still being pinned in the background and after it is done (their host time: pinning must
not slow steps); then close. After both, raw cudaHostRegister of a fresh mmap of 8 GiB (faulted
in by the call, as L2 is) in 1 GiB pieces, 8 at once: the ceiling of pinning speed. Each run
also reports where its time went: imports (torch, the CUDA driver, numba, tpkv), the phases of
init (`tpkv.startup`: CUDA context, process groups, L1 allocation, L2 mapping and first arena,
the worker's and the controller's numba kernels, which load on a thread beside the others, the
controller, the runtime) and the first step, and how many numba kernels it compiled (none in a
second process: `--fresh-cache` starts both from an empty cache to show it); on a cold cache,
the kernels compile in parallel processes (tpkv.kernel_pool): their count, wall time, time until
each was ready and each kernel's CPU seconds. Writes
bench/results/startup.json and a PNG. Goals (#34): first step <= 5 s after init at 96 GiB,
<= 3 s in the second process, whole L2 pinned at >= 0.9 of the raw speed, steps while pinning
as fast as after (p50 within 1.1x).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def one_process(l1_gib: float, l2_gib: float, device: str = "cuda") -> dict[str, Any]:
    """Runs inside a fresh process; returns its figures."""
    imports: dict[str, float] = {}
    t = time.perf_counter()
    import torch
    imports["torch"] = time.perf_counter() - t
    if device == "cuda":
        t = time.perf_counter()
        torch.cuda.is_available()  # loads the driver: counted apart from the CUDA context
        imports["cuda_driver"] = time.perf_counter() - t
    t = time.perf_counter()
    import numba
    from numba.core import event
    imports["numba"] = time.perf_counter() - t
    t = time.perf_counter()
    import tpkv
    from tpkv import startup
    from tpkv.config import HbmConfig, HostConfig, KvGeometry, TpkvConfig

    init = tpkv.init  # imports tpkv.launch and the workers
    imports["tpkv"] = time.perf_counter() - t
    imported_s = sum(imports.values())
    compiled: list[str] = []  # numba kernels compiled (not loaded from its disk cache)

    class Compiles(event.Listener):  # type: ignore[misc]
        def on_start(self, ev: event.Event) -> None:
            compiled.append(str(ev.data["dispatcher"].py_func.__qualname__))

        def on_end(self, ev: event.Event) -> None:
            pass

    event.register("numba:compile", Compiles())
    g = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                   block_tokens=16)  # 512 KiB blocks (a 1B Llama's shape)
    cfg = TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=int(l1_gib * GiB) // g.block_bytes),
                     l2=HostConfig(budget_bytes=int(l2_gib * GiB), max_memory_fraction=0.9))
    t0 = time.perf_counter()
    rt = init(cfg, controller="local", device=device)
    init_s = time.perf_counter() - t0
    phases = startup.times()
    compiled_in_init = len(compiled)
    host = rt.worker.host
    ready_at_init = host.ready_slots
    rt.open_session("s", num_tokens=1)
    rt.run_step(["s"], [1], lambda step: None)
    first_step_s = time.perf_counter() - t0
    phases["first_step"] = first_step_s - init_s
    def quiet_step() -> float:  # no new tokens: the session never outgrows L1
        t = time.perf_counter()
        rt.run_step(["s"], [0], lambda step: None)
        took = time.perf_counter() - t
        time.sleep(0.002)  # a decode step's cadence, about
        return took

    during: list[float] = []
    while host.pinning:
        during.append(quiet_step())
    pinned_s = time.perf_counter() - t0
    after = [quiet_step() for _ in range(min(max(200, len(during)), 2000))]
    l2_bytes = host.num_slots * host.block_bytes
    online = rt.controller.table.slots(tpkv.Tier.DRAM)
    t1 = time.perf_counter()
    rt.close()
    close_s = time.perf_counter() - t1
    # A restart in the same process right away (half the L2, so that the old L2, released in
    # the background, and the new one fit the host together): time to its first step.
    from tpkv.workers.pools import wait_released

    half = dataclasses.replace(cfg, l2=dataclasses.replace(
        cfg.l2, budget_bytes=cfg.l2.budget_bytes // 2))
    t2 = time.perf_counter()
    rt = init(half, controller="local", device=device)
    rt.open_session("s", num_tokens=1)
    rt.run_step(["s"], [1], lambda step: None)
    restart_s = time.perf_counter() - t2
    released = wait_released(120)
    release_s = time.perf_counter() - t1
    rt.close()
    wait_released(120)

    def ms(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q) * 1e3) if xs else None

    from tpkv import kernel_pool

    return {"import_s": imported_s, "import_breakdown_s": imports, "init_breakdown_s": phases,
            "kernel_pool": kernel_pool.report(),
            "numba_compiled_in_init": compiled_in_init, "numba_compiled": len(compiled),
            "numba_compiled_kernels": sorted(set(compiled)),
            "numba_cache_dir": numba.config.CACHE_DIR or None, "init_s": init_s,
            "first_step_s": first_step_s,
            "ready_slots_at_init": ready_at_init, "l2_slots": host.num_slots,
            "l2_bytes": l2_bytes, "controller_l2_slots_at_end": online,
            "l2_pinned_s": host.pin_seconds, "l2_usable_s_after_init": pinned_s,
            "pin_error": host.pin_error, "close_s": close_s,
            "restart_first_step_s": restart_s, "released_s_after_close": release_s,
            "released": released,
            "steps_while_pinning": len(during), "step_ms_while_pinning_p50": ms(during, 50),
            "step_ms_while_pinning_p99": ms(during, 99), "steps_after": len(after),
            "step_ms_after_p50": ms(after, 50), "step_ms_after_p99": ms(after, 99)}


def raw_register(gib: int) -> dict[str, Any]:
    """cudaHostRegister of a fresh anonymous mmap in 1 GiB pieces, 8 at once."""
    from tpkv.workers import cuda_rt

    maps = [mmap.mmap(-1, GiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(gib)]
    import ctypes
    ptrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: cuda_rt.host_register(p, GiB), ptrs))
    took = time.perf_counter() - t
    for p in ptrs:
        cuda_rt.host_unregister(p)
    return {"gib": gib, "seconds": took, "gb_per_s": gib * GiB / took / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--l2-gib", type=float, default=96.0, help="L2 budget (GiB)")
    ap.add_argument("--l1-gib", type=float, default=2.0, help="L1 size (GiB)")
    ap.add_argument("--raw-gib", type=int, default=8, help="size of the raw register ceiling")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (nothing is pinned)")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="both processes share a new, empty NUMBA_CACHE_DIR: the first compiles "
                         "every kernel, the second must compile none")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_process(a.l1_gib, a.l2_gib, a.device)))
        return
    runs = []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:" + os.environ.get("PYTHONPATH", "")}
    if a.fresh_cache:
        env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpkv-numba-")
    for name in ("first process", "second process"):
        print(f"{name}: tpkv.init with L1 {a.l1_gib:g} GiB, L2 {a.l2_gib:g} GiB ...", flush=True)
        out = subprocess.run([sys.executable, __file__, "--child", "--l2-gib", str(a.l2_gib),
                              "--l1-gib", str(a.l1_gib), "--device", a.device],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"{name} failed:\n{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["process"] = name
        runs.append(r)
        print(f"  init {r['init_s']:.2f} s, first step {r['first_step_s']:.2f} s after init's "
              f"start, whole L2 usable {r['l2_usable_s_after_init']:.2f} s, close "
              f"{r['close_s']:.2f} s (released {r['released_s_after_close']:.2f} s after; a "
              f"restart's first step {r['restart_first_step_s']:.2f} s); steps while pinning p50 "
              f"{r['step_ms_while_pinning_p50']} ms ({r['steps_while_pinning']}), after "
              f"{r['step_ms_after_p50']:.3f} ms", flush=True)
        print("  import " + ", ".join(f"{k} {v:.2f}" for k, v in r["import_breakdown_s"].items())
              + " s; init " + ", ".join(f"{k} {v:.2f}" for k, v in r["init_breakdown_s"].items())
              + f" s; numba compiled {r['numba_compiled']} kernels", flush=True)
        if r["kernel_pool"]:  # a cold cache: the kernels compiled in parallel processes
            kp = r["kernel_pool"]
            print(f"  kernel pool: {kp['processes']} processes, {kp['wall_s']:.2f} s; ready "
                  + ", ".join(f"{x:.2f}" for x in kp["ready_s"]) + " s; kernels (CPU s) "
                  + ", ".join(f"{k['kernel'].split(':')[1]} {k['cpu_s']:.2f}"
                              for k in kp["kernels"]), flush=True)
            if "loaded_during" in kp:  # the critical path's pieces
                longest = max(kp["kernels"], key=lambda k: k["s"], default=None)
                print("  pool: imported and compiler warm "
                      + ", ".join(f"{k} {v:.2f}" for k, v in (kp["ready_parts_s"] or [{}])[-1]
                                  .items() if k != "start_cpu_s")
                      + " s; longest kernel " + (f"{longest['kernel'].split(':')[1]} "
                                                  f"{longest['s']:.2f} s" if longest else "-")
                      + f"; {kp['loaded_during']} loaded here during the pool "
                      f"({kp['load_during_s']:.2f} s)", flush=True)
    raw = raw_register(a.raw_gib) if a.device == "cuda" else {"gib": 0, "seconds": 0.0,
                                                                "gb_per_s": float("nan")}
    for r in runs:
        r["pin_gb_per_s"] = r["l2_bytes"] / r["l2_pinned_s"] / 1e9 if r["l2_pinned_s"] else None
        r["pin_ratio_to_raw"] = (r["pin_gb_per_s"] / raw["gb_per_s"]
                                 if r["pin_gb_per_s"] else None)
    print(f"raw cudaHostRegister: {raw['gb_per_s']:.2f} GB/s ({raw['gib']} GiB, 8 at once); "
          f"L2 pinned at {runs[0]['pin_gb_per_s'] or 0:.2f} and {runs[1]['pin_gb_per_s'] or 0:.2f}"
          f" GB/s: ratio {runs[0]['pin_ratio_to_raw'] or 0:.2f} / "
          f"{runs[1]['pin_ratio_to_raw'] or 0:.2f} (goal >= 0.9)")
    if a.fresh_cache:
        shutil.rmtree(env["NUMBA_CACHE_DIR"], ignore_errors=True)
    result = {"command": "python bench/startup.py " + " ".join(sys.argv[1:]),
              "l1_gib": a.l1_gib, "l2_gib": a.l2_gib, "runs": runs, "raw_register": raw,
              "goals": {"first_step_s_first": 5.0, "first_step_s_second": 3.0,
                        "pin_ratio_to_raw": 0.9}}
    Path(a.out).write_text(json.dumps(result, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        names = [r["process"] for r in runs]
        ax.barh(names, [r["init_s"] for r in runs], label="init")
        ax.barh(names, [r["first_step_s"] - r["init_s"] for r in runs],
                left=[r["init_s"] for r in runs], label="to first step")
        ax.scatter([r["l2_usable_s_after_init"] for r in runs], names, color="k", zorder=3,
                   label="whole L2 pinned")
        ax.set_xlabel("seconds from tpkv.init")
        ax.set_title(f"start-up, L2 {a.l2_gib:g} GiB")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(Path(a.out).with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
