"""Rank functions of the consistency tests (run in spawned processes)."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

from tests.multiproc.harness import (
    Workload,
    check_against_controller,
    make_config,
    workload_step,
    write_fresh,
)
from tpkv.protocol.plan import Tier

KINDS = {"d2h": (Tier.HBM, Tier.DRAM), "h2d": (Tier.DRAM, Tier.HBM),
         "spill": (Tier.DRAM, Tier.SSD), "load": (Tier.SSD, Tier.DRAM)}


def consistency_rank(rank: int, world: int, num_plans: int, seed: int, ssd_root: str,
                     skip: tuple[int, int] | None = None,
                     miss: tuple[int, int] | None = None, checks: int = 1) -> dict[str, Any]:
    """Run the workload until `num_plans` plans; `skip` = (rank, epoch): that rank silently
    skips a move of that plan; `miss` = (rank, epoch): its first L3 read from then misses.
    The slot maps and bytes are checked against the controller `checks` times, evenly over
    the run (the last at its end); the blocks seen on each tier are summed over the checks."""
    import tpkv

    rt = tpkv.init(make_config(world, ssd_root), controller="local")
    if skip is not None and rank == skip[0]:
        rt.worker.fault_skip[skip[1]] = 0
    if miss is not None and rank == miss[0]:
        rt.worker.fault_miss_from = miss[1]
    workload = Workload(seed)
    steps, started = 0, time.monotonic()
    moves = {"d2h": 0, "h2d": 0, "spill": 0, "load": 0}

    def forward(step: Any) -> None:
        write_fresh(rt.worker, step, rank)
        for plan in step.plans:
            for kind, (src, dst) in KINDS.items():
                moves[kind] += int(plan.mask(src, dst).sum())

    counts = {"l1": 0, "l2": 0, "l3": 0}
    for k in range(1, checks + 1):
        while rt.worker.epoch < num_plans * k // checks:
            workload_step(rt, workload, rank, forward)
            steps += 1
        for tier, n in check_against_controller(rt).items():
            counts[tier] += n
    out = {"steps": steps, "plans": rt.worker.epoch, "seconds": time.monotonic() - started,
           "misses_injected": miss is not None and rank == miss[0]
           and rt.worker.fault_miss_from is None,
           "mismatches": rt.num_mismatches, "retries": rt.num_retries, "moves": moves,
           "commit_refusals": rt.num_commit_refusals,
           "mismatch": None if rt.last_mismatch is None else {
               "epoch": rt.last_mismatch.epoch, "ranks": list(rt.last_mismatch.ranks),
               "message": str(rt.last_mismatch)}, **counts}
    rt.close()
    return out


def liveness_rank(rank: int, world: int, victim: int, mode: str, at_step: int, ssd_root: str,
                  wait_timeout_s: float) -> dict[str, Any]:
    """Run steps until `victim` dies (mode "kill": SIGKILL) or hangs ("hang") at `at_step`; the
    others must fail within the bound with a RankTimeoutError naming it."""
    import tpkv
    from tpkv.errors import RankTimeoutError

    rt = tpkv.init(make_config(world, ssd_root, wait_timeout_s=wait_timeout_s,
                               heartbeat_s=wait_timeout_s / 16), controller="local")
    workload = Workload(1)
    last_ok = time.monotonic()
    try:
        for step in range(10_000):
            if rank == victim and step == at_step:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            workload_step(rt, workload, rank)
            last_ok = time.monotonic()
    except RankTimeoutError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "ranks": list(exc.ranks),
                "waited_s": time.monotonic() - last_ok}
    return {"error": None}
