"""Step-path cost of the vLLM connector's moves to disk: wait_for_save with the moves written on
the step's path (disk_queue_bytes 0) and with the background writer, CPU only.

Each mode runs the connector's worker half (BlockCopier) and scheduler half (Planner) without
vLLM over fake KV caches: host memory holds `--rest` blocks at rest (plus `--queue` blocks for
writes on their way, background mode), is filled first, then `--blocks` new blocks are saved,
`--per-step` a step, with `--forward-ms` of idle between steps standing for the forward pass.
Every save then moves one older block to disk; a third mode, memory only, has room for every
block (what a save costs without any disk tier). Reported per mode: the time of
apply_after_forward (vLLM's wait_for_save) per step and per saved block, the time until every
write has landed, and the blocks given up because the writer fell behind.

    python bench/vllm_disk.py [--blocks 128] [--block-mib 2] [--out bench/results/vllm_disk.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch

from tpkv.integrations.disk_format import record_bytes
from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.options import DiskSpec
from tpkv.integrations.vllm.planner import Planner

BLOCK_TOKENS = 16
LAYERS = 16


def run_mode(args: argparse.Namespace, queue: int | None, root: str) -> dict[str, Any]:
    """One mode: queue None is memory only (no disk tier, room for every block), 0 the moves
    written on the step's path, > 0 the background writer with that queue."""
    page = args.block_mib * (1 << 20) // LAYERS
    block = page * LAYERS
    seed = chain_seed("bench-vllm-disk", BLOCK_TOKENS)
    disk_blocks = args.rest + args.blocks + args.per_step
    spec = DiskSpec(root, disk_blocks * record_bytes(BLOCK_TOKENS, block), seed, BLOCK_TOKENS,
                    "bench-vllm-disk", queue_bytes=queue * block) if queue is not None else None
    host_blocks = args.rest + (queue or 0) if queue is not None else disk_blocks
    copier = BlockCopier(host_blocks * block, spec)
    num_kv = max(args.per_step, 1)
    gen = torch.Generator().manual_seed(0)
    kv = {f"layer{i}": torch.randint(0, 256, (num_kv, page), dtype=torch.uint8, generator=gen)
          for i in range(LAYERS)}
    copier.register(kv, num_kv)
    planner = Planner(BLOCK_TOKENS, seed, args.rest + disk_blocks)
    store = copier.store
    assert store is not None
    step_s: list[float] = []
    lost = 0
    token = 0

    def step(timed: bool) -> None:
        nonlocal token, lost
        prompt = list(range(token, token + args.per_step * BLOCK_TOKENS + 1))
        token += len(prompt)
        req = SimpleNamespace(request_id=f"r{token}", all_token_ids=prompt)
        planner.matched_tokens(req, 0)
        plan = planner.plan([(req.request_id, len(prompt))], lambda r: list(range(num_kv)))
        began = time.perf_counter()
        copier.apply_after_forward(plan)  # what wait_for_save runs
        took = time.perf_counter() - began
        report = copier.take_report()
        if report is not None:
            lost += len(report.lost) if timed else 0
            planner.report(report)
        planner.finished(req.request_id)
        if timed:
            step_s.append(took)
        time.sleep(args.forward_ms / 1e3)

    for _ in range(-(-args.rest // args.per_step)):  # fill memory: later saves move blocks
        step(timed=False)
    store.flush()
    written0 = store.writer.num_written if store.writer is not None else 0
    began = time.perf_counter()
    for _ in range(args.blocks // args.per_step):
        step(timed=True)
    steps_done = time.perf_counter() - began
    store.flush(300)
    landed = time.perf_counter() - began
    written = (store.writer.num_written - written0 if store.writer is not None
               else len(store.disk) if store.disk is not None else 0)
    store.close()
    per_block = [s / args.per_step * 1e3 for s in step_s]
    return {
        "queue_blocks": queue,
        "steps": len(step_s),
        "step_ms_mean": round(statistics.fmean(step_s) * 1e3, 3),
        "step_ms_p50": round(statistics.median(step_s) * 1e3, 3),
        "step_ms_max": round(max(step_s) * 1e3, 3),
        "step_ms_per_block": round(statistics.fmean(per_block), 3),
        "step_ms_per_block_p50": round(statistics.median(per_block), 3),
        "step_ms_per_block_p90": round(statistics.quantiles(per_block, n=10)[-1], 3),
        "steps_s": round(steps_done, 3),
        "all_written_s": round(landed, 3),
        "blocks_written": written,
        "blocks_given_up": lost,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks saved in the timed steps")
    ap.add_argument("--per-step", type=int, default=4, help="blocks saved a step")
    ap.add_argument("--block-mib", type=int, default=2, help="MiB a block (16 layers)")
    ap.add_argument("--rest", type=int, default=8, help="blocks host memory holds at rest")
    ap.add_argument("--queue", type=int, default=16, help="background writer's queue, blocks")
    ap.add_argument("--forward-ms", type=float, default=150.0,
                    help="idle between steps, standing for the forward pass")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (the block gather; more stall on a busy CPU)")
    ap.add_argument("--dir", default=None, help="where the disk tier goes (a temp dir in /tmp)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    load_at_start = round(os.getloadavg()[0], 2)
    results = {}
    modes: tuple[tuple[str, int | None], ...] = (
        ("memory_only", None), ("on_step_path", 0), ("background", args.queue))
    for name, queue in modes:
        root = tempfile.mkdtemp(prefix="tpkv-vllm-disk-", dir=args.dir)
        try:
            results[name] = run_mode(args, queue, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out = {
        "bench": "vllm_disk",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "disk_dir_parent": args.dir or tempfile.gettempdir(),
                    "load_avg_1m_at_start": load_at_start,
                    "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "results": results,
        "speedup_step_path_p50": round(results["on_step_path"]["step_ms_p50"]
                                       / max(results["background"]["step_ms_p50"], 1e-9), 1),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
