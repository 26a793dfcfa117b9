"""Controller benchmark: schedule() latency for a 1024-session step at 1M and 10M tracked blocks.

    python bench/controller.py [--sizes 1000000 10000000] [--steps 1000] [--no-actor] [--digest]
                               [--no-prepare | --ab]

CPU only. Builds a population through schedule() itself (prefill steps, demotions and spills
happen on the way), runs until no tier drains any more (the bulk load leaves L1 and L2 above
their high marks; this warm-up lifts max_moves_per_step), 200 more steps, then times steps:
1024 sessions add a token each and 4 of them are swapped each step for idle sessions that come
back from L2 or L3, announced a step ahead (a session answers ~300 tokens per turn: 1024 / 300
~ 3.4 turns end per step); then the same without swaps (decode only).
Every plan is confirmed as two ranks would. Writes bench/results/controller.json. Besides wall
time, each run records the thread CPU time of schedule() and, from 100 more steps under
cProfile, the calls per step (all, and numpy's): measures that a machine shared with other work
disturbs less. With --digest, each run also records a sha256 over every StepResult (outside the
timed region), to check that a faster controller returns exactly what the slower one did.

Between steps the loop calls Controller.prepare(), as the engine does after launching a
forward and the actor after replying: it runs off the critical path, and is timed on its own
(prepare_p50_us, prepare_p99_us), never inside the schedule numbers. --no-prepare leaves it
out; --ab alternates 50-step blocks with and without it in one process (schedule_*_prepared,
schedule_*_unprepared). The results (and their hash) are the same in every mode.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import datetime
import gc
import hashlib
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpkv.config import (  # noqa: E402
    HbmConfig,
    HostConfig,
    KvGeometry,
    PolicyConfig,
    SsdConfig,
    TpkvConfig,
)
from tpkv.controller import Controller  # noqa: E402
from tpkv.protocol.digest import (
    canonical,  # noqa: E402
    plan_digest,  # noqa: E402
)
from tpkv.protocol.messages import StepResult  # noqa: E402
from tpkv.protocol.plan import MoveResult  # noqa: E402
from tpkv.protocol.wire import encode  # noqa: E402

BATCH = 1024
SWAP = 4  # sessions replaced per step
BLOCKS_PER_SESSION = 64  # 1024 tokens of 16
L1_SLOTS = 131_072
# 512-byte blocks: only slot counts matter here, and L2's budget must fit this machine.
GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=2, head_dim=16, dtype="float8_e4m3fn",
                      block_tokens=16, tp_size=2)


MAX_MOVES = PolicyConfig().max_moves_per_step


def make_config(num_blocks: int, ssd_dir: str) -> TpkvConfig:
    bb = GEOMETRY.block_bytes
    return TpkvConfig(
        geometry=GEOMETRY, l1=HbmConfig(num_blocks=L1_SLOTS),
        l2=HostConfig(budget_bytes=max(num_blocks // 4, 4 * L1_SLOTS) * bb * GEOMETRY.tp_size),
        l3=SsdConfig(root=ssd_dir, budget_bytes=SsdConfig.budget_for(num_blocks, GEOMETRY)),
        policy=PolicyConfig(max_moves_per_step=MAX_MOVES))


def confirm(c: Controller, res: StepResult) -> None:
    """Every rank applied the plans, and wrote every spill so far (a disk that keeps up)."""
    for plan in res.plans:
        d = plan_digest(plan)
        c.commit([MoveResult(plan.epoch, r, plan.num_moves, d, spills_written_below=plan.epoch + 1)
                  for r in range(GEOMETRY.tp_size)])


def populate(num_blocks: int, ssd_dir: str) -> tuple[Controller, list[str]]:
    """Open sessions until num_blocks exist, prefilling 1024 sessions a step."""
    # Room for the blocks the timed decode steps add (1024 sessions, one per 16 tokens each).
    rows = num_blocks + num_blocks // 20 + 150_000
    c = Controller(make_config(num_blocks, ssd_dir), table_capacity=rows)
    rng = np.random.default_rng(0)
    names: list[str] = []
    total = 0
    while total < num_blocks:
        sizes = rng.integers(BLOCKS_PER_SESSION // 2, 3 * BLOCKS_PER_SESSION // 2, BATCH)
        sizes = np.minimum(sizes, np.maximum(1, (num_blocks - total) // BATCH + 1))
        batch = [f"s{len(names) + i}" for i in range(BATCH)]
        for n, k in zip(batch, sizes.tolist()):
            c.open_session(n, k * GEOMETRY.block_tokens - 1)
        confirm(c, c.schedule(batch, np.zeros(BATCH, dtype=np.int64)))
        names += batch
        total = c.table.capacity - c.table.free_rows.top
    return c, names


class Workload:
    """A decode batch that changes slowly: each step `swap` sessions leave for idle ones, which
    were announced a step before. State carries over from one run() to the next."""

    def __init__(self, c: Controller, names: list[str]) -> None:
        self.c = c
        self.handles = {n: c.sessions.handle(c.sessions.lookup(n)) for n in names}
        self.batch = names[-BATCH:]
        running = set(self.batch)
        self.idle = [n for n in names if n not in running]
        self.rng = np.random.default_rng(1)
        self.nxt: list[str] = []
        self.hasher: hashlib._Hash | None = None  # set: every StepResult is digested
        self.cpu_us: list[float] = []  # thread CPU time of each schedule() call
        self.prepare = True  # call Controller.prepare() between steps (timed apart)
        self.prepare_us: list[float] = []  # wall time of each prepare() call

    def run(self, steps: int, use_handles: bool = True, swap: int = SWAP) -> np.ndarray:
        """schedule() latencies in us (Python's GC stays on, as it would in the actor)."""
        c, rng, ones = self.c, self.rng, np.ones(BATCH, dtype=np.int64)
        lat = np.zeros(steps)
        for t in range(steps):
            for i, n in zip(rng.choice(BATCH, len(self.nxt), replace=False).tolist(), self.nxt):
                self.idle.append(self.batch[i])
                self.batch[i] = n
            pick = sorted(rng.choice(len(self.idle) - BATCH // 2, swap, replace=False))
            self.nxt = [self.idle.pop(int(i)) for i in pick[::-1]]  # not just swapped out
            ids = (np.array([self.handles[n] for n in self.batch], dtype=np.int64)
                   if use_handles else self.batch)
            upcoming = {n: 1 for n in self.nxt}
            if self.prepare:  # between steps, off the critical path: not in `lat`
                start = time.perf_counter_ns()
                c.prepare()
                self.prepare_us.append((time.perf_counter_ns() - start) / 1e3)
            cpu = time.thread_time_ns()
            start = time.perf_counter_ns()
            res = c.schedule(ids, ones, upcoming)
            lat[t] = (time.perf_counter_ns() - start) / 1e3
            self.cpu_us.append((time.thread_time_ns() - cpu) / 1e3)
            if self.hasher is not None:
                self.hasher.update(encode(canonical(res.to_dict())))
            confirm(c, res)
        return lat


def count_calls(w: Workload, steps: int) -> dict[str, float]:
    """Load-independent work per step, under cProfile: Python function calls plus calls into
    C, and of those the numpy ones (functions, methods, ufunc methods; operators and indexing
    are not calls and do not count)."""
    prof = cProfile.Profile()
    schedule = w.c.schedule

    def profiled(*args: object, **kwargs: object) -> object:
        prof.enable()
        try:
            return schedule(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            prof.disable()

    w.c.schedule = profiled  # type: ignore[method-assign]
    try:
        w.run(steps)
    finally:
        del w.c.schedule
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    numpy = sum(v[0] for (path, _, name), v in stats.items()
                if "numpy" in path or (path == "~" and "numpy" in name))
    return {"calls_per_step": sum(v[0] for v in stats.values()) / steps,
            "numpy_calls_per_step": numpy / steps}


def actor_bench(steps: int) -> dict[str, float]:
    """The same step through the named Ray actor: one round trip per step."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from tpkv.controller.actor import ControllerClient, get_or_create

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="tpkv-bench",
             log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as d:
            client = ControllerClient(get_or_create(make_config(1 << 20, d)))
            names = [f"a{i}" for i in range(BATCH)]
            for n in names:
                client.open_session(session_id=n, num_tokens=255)
            client.schedule(names, np.zeros(BATCH, dtype=np.int64))
            lat = []
            for _ in range(steps):
                start = time.perf_counter_ns()
                client.schedule(names, np.ones(BATCH, dtype=np.int64))
                lat.append((time.perf_counter_ns() - start) / 1e3)
            snap = client.snapshot()
        return {"actor_step_p50_us": float(np.percentile(lat, 50)),
                "actor_step_p99_us": float(np.percentile(lat, 99)),
                "actor_tracked_blocks": int(snap["table"]["live_blocks"]),
                "actor_in_actor_schedule_p50_us": float(snap["plan_latency_us"]["p50"])}
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--actor-steps", type=int, default=300)
    ap.add_argument("--no-actor", action="store_true")
    ap.add_argument("--digest", action="store_true",
                    help="record a sha256 over every StepResult of each run")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-prepare", action="store_true",
                      help="never call Controller.prepare() between steps")
    mode.add_argument("--ab", action="store_true",
                      help="timed steps in 50-step blocks alternately with and without prepare()")
    ap.add_argument("--max-moves", type=int, default=PolicyConfig().max_moves_per_step,
                    help="PolicyConfig.max_moves_per_step")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "controller.json"))
    args = ap.parse_args()
    globals()["MAX_MOVES"] = args.max_moves
    out: dict[str, object] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "batch_sessions": BATCH, "swapped_per_step": SWAP, "l1_slots": L1_SLOTS,
        "cpu_count": os.cpu_count(), "runs": {}}
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            c, names = populate(n, d)
            build_s = time.perf_counter() - t0
            w = Workload(c, names)
            w.prepare = not args.no_prepare
            if args.digest:
                w.hasher = hashlib.sha256()
            # The bulk load leaves L1 and L2 above their high marks. Drain them as a bulk load
            # would (a large move budget), then time steps with the default budget.
            config = c.config
            c.config = dataclasses.replace(config, policy=dataclasses.replace(
                config.policy, max_moves_per_step=1 << 16))
            warm = 0
            while (any(c.draining.values()) or warm < 200) and warm < 3000:
                w.run(50)
                warm += 50
            c.config = config
            w.run(200)
            w.cpu_us, w.prepare_us = [], []
            rebuilds = dict(c.order_rebuilds)
            ab: dict[bool, list[np.ndarray]] = {True: [], False: []}
            ab_cpu: dict[bool, list[float]] = {True: [], False: []}
            if args.ab:
                for i in range(0, args.steps, 50):
                    w.prepare = (i // 50) % 2 == 0
                    ab[w.prepare].append(w.run(min(50, args.steps - i)))
                    ab_cpu[w.prepare] += w.cpu_us[-len(ab[w.prepare][-1]):]
                lat = np.concatenate(ab[True] + ab[False])
                w.prepare = True
            else:
                lat = w.run(args.steps)
            cpu = np.array(w.cpu_us)
            prep = np.array(w.prepare_us)
            rebuilds = {k: v - rebuilds.get(k, 0) for k, v in c.order_rebuilds.items()}
            lat_names = w.run(max(args.steps // 4, 50), use_handles=False)
            lat_decode = w.run(max(args.steps // 4, 50), swap=0)
            digest = w.hasher.hexdigest() if w.hasher is not None else None
            w.hasher = None
            snap = c.snapshot(max_sessions=0)
            live = snap["table"]["live_blocks"]
            run = {
                "tracked_blocks": live, "sessions": snap["num_sessions"],
                "schedule_p50_us": float(np.percentile(lat, 50)),
                "schedule_p99_us": float(np.percentile(lat, 99)),
                "schedule_max_us": float(lat.max()),
                "schedule_cpu_p50_us": float(np.percentile(cpu, 50)),
                "schedule_cpu_p99_us": float(np.percentile(cpu, 99)),
                "prepare": ("alternate 50-step blocks" if args.ab else
                            "off" if args.no_prepare else
                            "between steps, off the critical path, timed apart"),
                "eviction_order_rebuilds": rebuilds,
                "schedule_p50_us_by_name": float(np.percentile(lat_names, 50)),
                "decode_only_p50_us": float(np.percentile(lat_decode, 50)),
                "decode_only_p99_us": float(np.percentile(lat_decode, 99)),
                "bytes_per_block": c.metadata_bytes() / live,
                "bytes_per_table_row": c.metadata_bytes() / c.table.capacity,
                "table_rows": c.table.capacity,
                "bytes_by_part": {"block_table": c.table.nbytes(),
                                  "session_rows": c.sessions.arena.nbytes(),
                                  "sessions": c.sessions.nbytes() - c.sessions.arena.nbytes(),
                                  "batch_table": c.batch_table.nbytes()},
                "tiers": {k: snap["tiers"][k]["used"] for k in ("L1", "L2", "L3")},
                "events": dict(collections.Counter(e["kind"] for e in c.events)),
                "build_s": round(build_s, 1), "warmup_steps": warm, "steps": args.steps}
            if len(prep):
                run["prepare_p50_us"] = float(np.percentile(prep, 50))
                run["prepare_p99_us"] = float(np.percentile(prep, 99))
            for on, name in ((True, "prepared"), (False, "unprepared")):
                if ab[on]:
                    a = np.concatenate(ab[on])
                    run[f"schedule_p50_us_{name}"] = float(np.percentile(a, 50))
                    run[f"schedule_p99_us_{name}"] = float(np.percentile(a, 99))
                    run[f"schedule_cpu_p50_us_{name}"] = float(np.percentile(ab_cpu[on], 50))
                    run[f"schedule_cpu_p99_us_{name}"] = float(np.percentile(ab_cpu[on], 99))
            if digest is not None:
                run["results_sha256"] = digest
            run.update(count_calls(w, 100))  # after the timed runs (not in digest or events)
            out["runs"][str(n)] = run  # type: ignore[index]
            print(json.dumps({str(n): run}), flush=True)
            del c, names, w
            gc.collect()
    runs = out["runs"]
    assert isinstance(runs, dict)
    for n, r in runs.items():  # e.g. schedule_p50_us_1M, schedule_p99_us_10M
        tag = f"{int(n) // 1_000_000}M" if int(n) % 1_000_000 == 0 else n
        out[f"schedule_p50_us_{tag}"] = r["schedule_p50_us"]
        out[f"schedule_p99_us_{tag}"] = r["schedule_p99_us"]
    first = runs[str(args.sizes[0])]
    out["schedule_p50_us"] = first["schedule_p50_us"]  # the smallest run (1M by default)
    out["schedule_p99_us"] = first["schedule_p99_us"]
    out["bytes_per_block"] = runs[str(args.sizes[-1])]["bytes_per_block"]  # the largest run
    if not args.no_actor:
        out.update(actor_bench(args.actor_steps))
        out["actor_calls_per_step"] = 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
