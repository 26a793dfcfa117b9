"""A small TP app for the launch tests: steps of a seeded workload, then the consistency check.

Under torchrun: `torchrun --nproc-per-node 2 tests/e2e/app.py` (PYTHONPATH at the repo root).
Under Ray: `tpkv launch --tp 2 tests.e2e.app:main`, or tpkv.launch_ray(main, tp=2).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import tpkv
from tests.multiproc.harness import Workload, check_against_controller, make_config, workload_step


def main(num_steps: int = 40) -> dict[str, Any]:
    """Every rank: join tpkv (Ray controller), run the steps, check maps and bytes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    root = os.environ.get("TPKV_TEST_SSD_DIR")
    started = time.monotonic()
    with tpkv.init(make_config(world, root, wait_timeout_s=60.0)) as rt:
        workload = Workload(5)
        for _ in range(int(num_steps)):
            workload_step(rt, workload, rank)
        counts = check_against_controller(rt)
        out = {"rank": rank, "world": world, "plans": rt.worker.epoch, **counts,
               "seconds": round(time.monotonic() - started, 2)}
    return out


if __name__ == "__main__":
    print("TPKV_APP_RESULT " + json.dumps(main()), flush=True)
