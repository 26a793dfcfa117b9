"""Engine soak (not in CI): random sessions through the tiered engine on tiny tiers, with the
controller killed every few seconds, checked turn by turn against an engine that never moves.

    python -m bench.soak_engine                # 10 minutes, bench/results/soak_engine.json
    python -m bench.soak_engine --minutes 2

TP 1 on the CPU, the tiny Llama. L1 of 32 blocks and L2 of 16 hold a fraction of the sessions,
so every turn moves blocks L1 <-> L2 <-> L3. A "kill" replaces the controller with a fresh one
that lost its table (as a restarted actor is); the runtime rebuilds it from the rank's slot map
and the L3 manifests at its next call. Sessions end at random (their blocks are released and
their L3 files deleted) and new ones take their names. Every turn's tokens must equal the
reference engine's (an L1 that holds everything). RSS, open files and L3 disk use are sampled
over time. Exit status 1 on any mismatch or a growing open-file count.
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


def soak(root: Path, seconds: float, kill_every_s: float, sample_every_s: float,
         seed: int) -> dict[str, Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiny_tiers(model, str(root / "l3"))
    g = model.kv_geometry(tp_size=1, block_tokens=cfg.geometry.block_tokens)
    pool = torch.full((512, g.num_layers, 2, g.block_tokens, g.num_kv_heads, g.head_dim),
                      float("nan"))
    ref = PagedEngine(model, pool, scheduler_seed=3)
    rng = np.random.default_rng(seed)
    rt = init(cfg, controller="local", device="cpu")
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
                               "open_files": open_files(), "disk_bytes": disk_bytes(root)})
                last_sample = now
    finally:
        counts["steps"] = tiered.stats.steps
        counts["rebuilds"] = rt.num_rebuilds
        rt.close()
    return {"counts": counts, "moves": dict(tiered.stats.moves),
            "recompute_tokens": tiered.stats.recompute_tokens, "series": series,
            "flat": {k: flatness(series, k) for k in ("rss_bytes", "open_files", "disk_bytes")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every-s", type=float, default=3.0)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak_engine.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpkv-soak-engine-") as tmp:
        out = soak(Path(tmp), args.minutes * 60, args.kill_every_s, args.sample_every_s,
                   args.seed)
    out["command"] = "python -m bench.soak_engine " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    c = out["counts"]
    files = [s["open_files"] for s in out["series"]]
    print(json.dumps({**c, "moves": out["moves"], "flat": out["flat"]}))
    grew = len(files) > 2 and max(files[len(files) // 2:]) > max(files[:len(files) // 2])
    return 1 if c["mismatches"] or c["rebuilds"] != c["kills"] or grew else 0


if __name__ == "__main__":
    raise SystemExit(main())
