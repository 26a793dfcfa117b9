"""A warm-up run before the measured configurations of bench/e2e.py.

The first configuration a process runs pays once for what the later ones find done: numba
kernels compiled (their disk cache is empty on a fresh machine), CUDA graphs captured, the
allocator grown, library handles made. On the H200 (2026-12-02) the same (c2-em14) run as the
first configuration of its process took 19.1 s for its first turn round against 14.4 s after
another configuration: a comparison between configurations (the transports of --compare-local,
an A/B) would measure the order. So every run starts with this one, with small tiers, through
every tier path (demotions, spills, L3 read aheads, loads and recomputes), and throws its
result away.

Its sessions span the run's context lengths evenly, so that the kernels of every size and
cuDNN's plans of every prefill bucket are met here first (each configuration captures its own
CUDA graphs before its rounds: PagedEngine.capture_graphs). With a quarter of the lengths, as
before, the first configuration met them in its measured turns: on the H200 (2026-12-03, (b2)
with --compare-local) its first 9 returning turns' forwards took 120-153 ms through the Ray
actor against 46-51 ms for the same turns in process after it, 0.8 s of the 1.2 s between the
two.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.e2e_run import run_tiered
from bench.e2e_setup import Setting
from tpkv.config import GiB

WARM_SESSIONS = 16


def warm_sizes(sizes: Any) -> Any:
    """The run's sizes for the warm-up: 16 sessions of its context lengths, its L1, an eighth of
    its L2 and a quarter of its L3 (so that L1 and L2 overflow and L3 is read back), two rounds
    of short turns."""
    return dataclasses.replace(
        sizes, sessions=WARM_SESSIONS, rounds=2, gen_tokens=max(2, sizes.gen_tokens // 4),
        l2_gib=sizes.l2_gib / 8, l3_gib=sizes.l3_gib / 4, profile=0, arrivals=0)


def warm_contexts(small: Any) -> list[int]:
    """Each warm-up session's first-turn tokens: evenly from the shortest context to the
    longest, shuffled (seeded) so that short and long ones mix in the rounds."""
    lo, hi = small.context
    lengths = np.linspace(lo, hi, small.sessions).round().astype(int)
    return np.random.default_rng(small.seed + 7).permutation(lengths).tolist()


def warm_up(sizes: Any, device: torch.device, ceil: dict[str, float], controller: str,
            spill: str = "cost") -> dict[str, Any]:
    """One short tiered run on its own L3 directory (deleted after); returns its result, with
    its wall time as "seconds"."""
    small = warm_sizes(sizes)
    contexts = warm_contexts(small)
    root = tempfile.mkdtemp(prefix="tpkv-e2e-warm-")
    setting = Setting("warm-up", "warm-up (not measured)", int(small.l1_gib * GiB),
                      int(small.l2_gib * GiB), root, int(small.l3_gib * GiB), spill=spill)
    started = time.perf_counter()
    try:
        result = run_tiered(setting, small, contexts, device, ceil, controller)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if result["oom_or_failures"]:
        raise SystemExit(f"the warm-up run failed: {result['failures']}")
    return {**result, "seconds": time.perf_counter() - started}
