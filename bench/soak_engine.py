"""Engine soak (not in CI): random sessions through the tiered engine on tiny tiers, with the
controller killed every few seconds, checked turn by turn against an engine that never moves.

    python -m bench.soak_engine                # 10 minutes, bench/results/soak_engine.json
    python -m bench.soak_engine --minutes 2
    python -m bench.soak_engine --device cuda  # the GPU, bench/results/soak_engine_cuda.json

TP 1, the tiny Llama. L1 of 32 blocks and L2 of 16 hold a fraction of the sessions, so every
turn moves blocks L1 <-> L2 <-> L3. A "kill" replaces the controller with a fresh one that lost
its table (as a restarted actor is); the runtime rebuilds it from the rank's slot map and the L3
manifests at its next call. Sessions end at random (their blocks are released and their L3 files
deleted) and new ones take their names. Every turn's tokens must equal the reference engine's
(an L1 that holds everything). RSS, open files and L3 disk use are sampled over time. On CUDA
(L1 on the GPU, L2 pinned) also the pinned host memory and the device memory: see gpu_memory.
Exit status 1 on any mismatch, a growing open-file count, or (CUDA) growing pinned or device
memory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.soak import disk_bytes, flatness, open_files, rss_bytes
from tests.faults.engine_run import tiny_tiers
from tpkv.controller.controller import Controller
from tpkv.launch.join import init
from tpkv.models.engine import PagedEngine
from tpkv.models.llama import build_model
from tpkv.models.tiered import TieredEngine

NAMES = [f"s{i}" for i in range(12)]
MAX_TOKENS = 36  # a session ends once it is this long: two of them always fit in L1
RESULTS = Path(__file__).parent / "results"
# CUDA series judged for growth, with the slack each may grow by (last-third median over the
# first third's). What tpkv and the kernel count exactly may not grow at all; caching
# allocators keep freed blocks and round requests (pinned host: powers of two; device: 2 MiB
# segments for small tensors), so one rare larger request may raise them once by a block.
GPU_SLACK_BYTES = {"l2_pinned_bytes": 0, "vm_locked_bytes": 0, "vm_pinned_bytes": 0,
                   "torch_host_pinned_bytes": 2 << 20, "device_allocated_bytes": 2 << 20,
                   "device_reserved_bytes": 2 << 20, "device_used_bytes": 2 << 20}


def proc_status_bytes(field: str) -> int:
    """A `kB` line of /proc/self/status (VmLck: mlocked pages; VmPin: pages pinned by drivers
    that account them) in bytes; 0 where the kernel has no such line."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def gpu_memory(rt: Any) -> dict[str, int]:
    """Pinned host and device memory of this process, from every source that counts it:
    tpkv's L2 pool (its cudaHostRegister'ed arenas), torch's caching pinned-host allocator
    (pin_memory staging; only where torch has host_memory_stats), the kernel's VmLck/VmPin
    (the driver may pin without accounting there, so they can read 0), torch's device
    allocator, and the device's used bytes (also what cupy and the CUDA context hold)."""
    free, total = torch.cuda.mem_get_info()
    out = {"l2_pinned_bytes": rt.worker.host.pinned_bytes,
           "vm_locked_bytes": proc_status_bytes("VmLck"),
           "vm_pinned_bytes": proc_status_bytes("VmPin"),
           "device_allocated_bytes": torch.cuda.memory_allocated(),
           "device_reserved_bytes": torch.cuda.memory_reserved(),
           "device_used_bytes": total - free}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        out["torch_host_pinned_bytes"] = int(host_stats().get("allocated_bytes.current", 0))
    return out


def soak(root: Path, seconds: float, kill_every_s: float, sample_every_s: float,
         seed: int, device: str = "cpu") -> dict[str, Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device=device)
    cfg = tiny_tiers(model, str(root / "l3"))
    g = model.kv_geometry(tp_size=1, block_tokens=cfg.geometry.block_tokens)
    pool = torch.full((512, g.num_layers, 2, g.block_tokens, g.num_kv_heads, g.head_dim),
                      float("nan"), device=device)
    ref = PagedEngine(model, pool, scheduler_seed=3)
    rng = np.random.default_rng(seed)
    rt = init(cfg, controller="local", device=device)
    l2_pinned = rt.worker.host.pinned  # (close unpins it)
    tiered = TieredEngine(rt, model, report_prefill=False)
    engine = tiered.engine
    counts = {"turns": 0, "steps": 0, "sessions_ended": 0, "kills": 0, "mismatches": 0}
    series: list[dict[str, Any]] = []
    started = last_kill = last_sample = time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            group = rng.choice(len(NAMES), size=2, replace=False).tolist()
            for i in group:
                s = NAMES[i]
                n = int(rng.integers(12, 21)) if s not in engine.seqs else int(rng.integers(3, 9))
                prompt, gen = rng.integers(0, 512, n).tolist(), int(rng.integers(4, 7))
                engine.add_turn(s, prompt, gen)
                ref.add_turn(s, prompt, gen)
            got = {f.session: f.token_ids for f in engine.run()}
            want = {f.session: f.token_ids for f in ref.run()}
            counts["turns"] += len(want)
            counts["mismatches"] += sum(got.get(s) != t for s, t in want.items())
            for i in group:
                s = NAMES[i]
                if len(ref.seqs[s].token_ids) > MAX_TOKENS or rng.random() < 0.05:
                    engine.close_session(s)
                    ref.close_session(s)
                    counts["sessions_ended"] += 1
            now = time.monotonic()
            if now - last_kill > kill_every_s:  # the next call finds a controller with no table
                counts["kills"] += 1
                rt.controller = Controller(cfg, restarts=counts["kills"], awaiting_rebuild=True)
                last_kill = now
            if now - last_sample > sample_every_s:
                series.append({"t_s": round(now - started, 1), "rss_bytes": rss_bytes(),
                               "open_files": open_files(), "disk_bytes": disk_bytes(root),
                               **(gpu_memory(rt) if device == "cuda" else {})})
                last_sample = now
    finally:
        counts["steps"] = tiered.stats.steps
        counts["rebuilds"] = rt.num_rebuilds
        rt.close()
    keys = ["rss_bytes", "open_files", "disk_bytes"]
    keys += [k for k in GPU_SLACK_BYTES if series and k in series[0]]
    out = {"counts": counts, "moves": dict(tiered.stats.moves),
           "recompute_tokens": tiered.stats.recompute_tokens, "series": series,
           "flat": {k: flatness(series, k) for k in keys}}
    if device == "cuda":
        out["gpu"] = {"name": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "l2_pinned": l2_pinned}
    return out


def growing(out: dict[str, Any]) -> list[str]:
    """The series that grew: open files whose second half reached a count the first half never
    did; on CUDA also a pinned or device memory series whose last third's median exceeds the
    first third's by more than its slack."""
    files = [s["open_files"] for s in out["series"]]
    grew = []
    if len(files) > 2 and max(files[len(files) // 2:]) > max(files[:len(files) // 2]):
        grew.append("open_files")
    grew += [k for k, slack in GPU_SLACK_BYTES.items()
             if k in out["flat"] and out["flat"][k]["growth"] > slack]
    return grew


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every-s", type=float, default=3.0)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", help="default: bench/results/soak_engine.json, or "
                                  "soak_engine_cuda.json with --device cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    out_path = Path(args.out or RESULTS / ("soak_engine.json" if args.device == "cpu"
                                           else f"soak_engine_{args.device}.json"))
    with tempfile.TemporaryDirectory(prefix="tpkv-soak-engine-") as tmp:
        out = soak(Path(tmp), args.minutes * 60, args.kill_every_s, args.sample_every_s,
                   args.seed, args.device)
    out["command"] = "python -m bench.soak_engine " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k != "out" and v is not None)
    out["grew"] = growing(out)
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    c = out["counts"]
    print(json.dumps({**c, "moves": out["moves"], "flat": out["flat"], "grew": out["grew"]}))
    unpinned = args.device == "cuda" and not out["gpu"]["l2_pinned"]  # then pins went unwatched
    return 1 if c["mismatches"] or c["rebuilds"] != c["kills"] or out["grew"] or unpinned else 0


if __name__ == "__main__":
    raise SystemExit(main())
