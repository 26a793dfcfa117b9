"""Cost of the all-gather confirmation per plan and per decode step, as a share of step time.

    python bench/consistency.py                          # CPU: gloo at TP 2, 4, 8
    python bench/consistency.py --device cuda --tp 2 4 8 # GPU machine: gloo and NCCL

Each TP size runs in spawned processes. Per backend it measures (1) the latency of one
confirmation, issued and waited back to back: one plan (a [4] int64 row) and one decode step
(3 plans, the most a step has: [3, 4]); (2) decode steps with the confirmation beside compute, as
the worker runs it: issue, compute, wait; the cost to the step is the issue time plus what is
left to wait after compute, and the step time with and without it. Compute is a stand-in: on
the CPU a sleep of --step-ms (a GPU step leaves the CPU free); on the GPU a matmul-only decode
step of a 1.1B Llama (22 layers, hidden 2048, MLP 5632, batch --batch, bf16), timed.
It also times the digests a worker computes per plan (plan_digest and its own map's digest).
Results are merged into bench/results/consistency.json, one run per device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpkv.protocol.digest import plan_digest  # noqa: E402
from tpkv.protocol.plan import MovePlan  # noqa: E402
from tpkv.workers.confirm import BoundedGroup, Confirmer  # noqa: E402
from tpkv.workers.mirror import SlotMirror  # noqa: E402
from tpkv.workers.slots import SlotAllocator  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "consistency.json"


def stats(us: list[float]) -> dict[str, float]:
    a = np.asarray(us)
    return {"mean": round(float(a.mean()), 1), "p50": round(float(np.percentile(a, 50)), 1),
            "p99": round(float(np.percentile(a, 99)), 1)}


class FakeDecode:
    """Matmuls of a 1.1B Llama decode step (no attention), or a sleep on the CPU."""

    def __init__(self, device: torch.device, batch: int, step_ms: float) -> None:
        self.device, self.step_ms = device, step_ms
        if device.type == "cuda":
            g = torch.Generator(device).manual_seed(0)
            shapes = [(2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048)]
            self.w = [[torch.randn(s, device=device, dtype=torch.bfloat16, generator=g) * 0.02
                       for s in shapes] for _ in range(22)]
            self.x = torch.randn(batch, 2048, device=device, dtype=torch.bfloat16)

    def issue(self) -> None:
        if self.device.type != "cuda":
            return
        x = self.x
        for wqkv, wo, wgu, wd in self.w:
            qkv = x @ wqkv
            x = x + qkv[:, :2048] @ wo
            gu = x @ wgu
            x = x + (gu[:, :5632] * gu[:, 5632:]) @ wd

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            time.sleep(self.step_ms / 1e3)


def measure(conf: Confirmer, compute: FakeDecode, steps: int, sync: Any) -> dict[str, Any]:
    rows1 = np.array([[1, 64, 123456789, 0]], dtype=np.int64)
    rows3 = np.repeat(rows1, 3, axis=0)
    out: dict[str, Any] = {}
    for name, rows in (("per_plan_us", rows1), ("per_step_3_plans_us", rows3)):
        lat = []
        for i in range(steps + 20):
            t0 = time.perf_counter()
            conf.wait(conf.start(lambda r=rows: (r, r)))
            if i >= 20:
                lat.append((time.perf_counter() - t0) * 1e6)
        out[name] = stats(lat)
    base, with_, cost, cpu = [], [], [], []
    for i in range(2 * steps + 20):
        confirm = i % 2 == 1
        dist.barrier(group=sync)  # ranks start a step together, as TP compute keeps them
        t0, c0 = time.perf_counter(), time.thread_time()
        issue_us = wait_us = issue_cpu = wait_cpu = 0.0
        if confirm:
            p = conf.start(lambda: (rows3, rows3))
            issue_us = (time.perf_counter() - t0) * 1e6
            issue_cpu = (time.thread_time() - c0) * 1e6
        compute.issue()
        compute.finish()
        if confirm:
            t1, c1 = time.perf_counter(), time.thread_time()
            conf.wait(p)
            wait_us = (time.perf_counter() - t1) * 1e6
            wait_cpu = (time.thread_time() - c1) * 1e6
        step_us = (time.perf_counter() - t0) * 1e6
        if i >= 20:
            (with_ if confirm else base).append(step_us)
            if confirm:
                cost.append(issue_us + wait_us)
                cpu.append(issue_cpu + wait_cpu)
    step_us = float(np.mean(base))
    out["beside_compute"] = {
        "step_us_without": stats(base), "step_us_with": stats(with_),
        "cost_on_step_us": stats(cost), "cpu_of_step_thread_us": stats(cpu),
        "share_of_step": round(float(np.mean(cost)) / step_us, 5),
        "measured_step_delta_share": round((float(np.mean(with_)) - step_us) / step_us, 5)}
    out["in_front_share_per_step"] = round(out["per_step_3_plans_us"]["mean"] / step_us, 5)
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.device("cuda", rank % gpus) if gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    compute = FakeDecode(device, args.batch, args.step_ms)
    sync = dist.new_group(backend="gloo")
    results = {}
    for name in (["gloo", "nccl"] if device.type == "cuda" else ["gloo"]):
        if name == "nccl" and gpus < world:  # NCCL needs one GPU per rank
            results[name] = {"skipped": f"NCCL at TP {world} needs {world} GPUs, {gpus} here"}
            continue
        pg = dist.new_group(backend=name, timeout=timedelta(seconds=60))
        cdev = device if name == "nccl" else torch.device("cpu")
        conf = Confirmer(BoundedGroup(pg, rank, world, 60.0, None, "confirm", cdev))
        results[name] = measure(conf, compute, args.steps, sync)
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def wait_for(q: Any, procs: list[Any], timeout_s: float) -> Any:
    """Rank 0's results; fail at once if a rank died, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"ranks {dead} died (exit codes "
                                   f"{[procs[i].exitcode for i in dead]})") from None
    for p in procs:
        p.kill()
    raise TimeoutError(f"no results after {timeout_s:g} s")


def step_thread_cost_warm(reps: int = 2000) -> dict[str, float]:
    """What a step pays on its own thread with warm caches: hand the rows over (start) and
    collect a finished answer (wait); the collective itself is stubbed out."""

    class Stub:
        device, rank, world_size, timeout_s = torch.device("cpu"), 0, 2, 30.0

    conf = Confirmer(Stub())  # type: ignore[arg-type]
    conf._gather = lambda flat: np.concatenate([flat, flat])  # type: ignore[method-assign]
    rows = np.zeros((3, 4), dtype=np.int64)
    start_us, wait_us = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        p = conf.start(lambda: (rows, rows))
        t1 = time.perf_counter()
        while not p.done:
            time.sleep(0)
        t2 = time.perf_counter()
        conf.wait(p)
        t3 = time.perf_counter()
        start_us.append((t1 - t0) * 1e6)
        wait_us.append((t3 - t2) * 1e6)
    conf.close()
    return {"start_us_p50": round(float(np.percentile(start_us, 50)), 1),
            "wait_us_p50": round(float(np.percentile(wait_us, 50)), 1)}


def digest_cost(num_moves: int, reps: int = 200) -> dict[str, float]:
    """Digests per plan: plan_digest (the expected row) and this rank's own (its row); the
    worker computes both on the confirmation thread, off the step."""
    rng = np.random.default_rng(0)
    n = num_moves
    ids = rng.choice(1 << 20, n, replace=False).astype(np.int64)
    plan = MovePlan(1, ids, np.zeros(n), np.arange(n), np.ones(n), np.arange(n),
                    np.zeros(n), np.arange(n), ("s",))
    mirror = SlotMirror(SlotAllocator(n, "L1"), SlotAllocator(n, "L2"), capacity=1 << 20)
    mirror.put(ids, np.zeros(n), np.arange(n), ["s"] * n, np.arange(n))
    t0 = time.perf_counter()
    for _ in range(reps):
        plan_digest(plan)
        mirror.digest(plan.block_ids)
    return {"moves": n, "us": round((time.perf_counter() - t0) / reps * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="CPU stand-in for the decode step time (a sleep)")
    ap.add_argument("--batch", type=int, default=32, help="GPU fake decode batch")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    runs: dict[str, Any] = {}
    for tp in args.tp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, tp, port, args, q)) for r in range(tp)]
        for p in procs:
            p.start()
        runs[str(tp)] = wait_for(q, procs, timeout_s=900)
        for p in procs:
            p.join(timeout=60)
        print(f"TP {tp}: " + json.dumps({k: {"per_plan_us": v["per_plan_us"]["mean"],
                                              "share": v["beside_compute"]["share_of_step"]}
                                          for k, v in runs[str(tp)].items()
                                          if "skipped" not in v}), flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    run = {
        "command": "python " + " ".join(sys.argv), "date": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu or f"CPU ({platform.processor() or platform.machine()}), "
                         f"{os.cpu_count()} cores: all TP ranks share them",
        "torch": torch.__version__, "step_time": (
            f"measured fake decode step (matmuls of a 1.1B Llama, batch {args.batch}, bf16)"
            if gpu else f"stand-in: {args.step_ms} ms sleep per step (GPU compute leaves "
                        f"the CPU free)"),
        "goal": "confirmation cost <= 1% of the decode step time",
        "digests_per_plan_on_confirmation_thread": [digest_cost(n) for n in (16, 256, 4096)],
        "step_thread_cost_warm": step_thread_cost_warm(),
        "tp": runs}
    data = json.loads(OUT.read_text()) if OUT.exists() else {"runs": {}}
    data["runs"][args.device] = run
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
