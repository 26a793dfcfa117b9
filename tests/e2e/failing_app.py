"""An app whose rank 1 fails mid-run: the launch must fail within the bound, naming rank 1."""

from __future__ import annotations

import os

import tpkv
from tests.multiproc.harness import Workload, make_config, workload_step


def main(fail_rank: int = 1, at_step: int = 5, wait_timeout_s: float = 6.0) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = make_config(world, None, wait_timeout_s=wait_timeout_s, heartbeat_s=0.25)
    with tpkv.init(config) as rt:
        workload = Workload(2)
        for step in range(100):
            if rank == fail_rank and step == at_step:
                raise RuntimeError(f"boom on rank {rank} at step {step}")
            workload_step(rt, workload, rank)
