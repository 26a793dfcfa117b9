"""Not a test: times Planner.plan a step with the prefix index local and in its Ray actor.

`RAY_USAGE_STATS_ENABLED=0 python tests/ray/time_index_actor.py [STEPS]` (a local Ray cluster of
2 CPUs, shut down at the end). 8 requests each fill a block every step (the case with a call
every step: a step that stores nothing makes none); each step's saves are reported back as
stored. Prints the median and 90th percentile of plan()'s seconds, local and through the actor,
twice each.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from types import SimpleNamespace

import ray

from tpkv.integrations.index_service import IndexSpec
from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.plan import StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.ray_index import RayTransport
from tpkv.integrations.vllm.remote_index import RemoteIndex

BT = 16
CAPACITY = 100_000


def time_steps(planner: Planner, steps: int) -> list[float]:
    reqs = [SimpleNamespace(request_id=f"r{i}", all_token_ids=[i * 7 + j for j in range(BT)])
            for i in range(8)]
    for r in reqs:
        planner.matched_tokens(r, 0)
    ids = list(range(CAPACITY))
    times = []
    for s in range(steps):
        for r in reqs:
            r.all_token_ids.extend(range(s, s + BT))
        n = len(reqs[0].all_token_ids)
        began = time.perf_counter()
        plan = planner.plan([(r.request_id, n) for r in reqs], lambda _: ids)
        times.append(time.perf_counter() - began)
        planner.report(StepReport(saved={sv.key for sv in plan.saves}, ranks={0}))
    return times


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             namespace=f"tpkv-time-{uuid.uuid4().hex[:8]}")
    try:
        for i, kind in enumerate(("local", "ray", "local", "ray")):
            seed = chain_seed(f"time-index-actor-{i}", BT)  # a fresh actor each time
            index = None
            if kind == "ray":
                index = RemoteIndex(RayTransport(IndexSpec(CAPACITY, BT, seed)), CAPACITY, 2.0)
            t = sorted(time_steps(Planner(BT, seed, CAPACITY, index=index), steps))
            print(f"{kind:5s} plan(): median {statistics.median(t) * 1e6:.0f} us, "
                  f"p90 {t[int(len(t) * 0.9)] * 1e6:.0f} us over {steps} steps")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
