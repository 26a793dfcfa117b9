"""Cost on rank 0's step of Returns.sample against the size of the slot map (CPU only).

    python bench/returns_sample.py [--blocks 1048576] [--sessions 256] [--reps 50]

Builds one rank's SlotMirror of --blocks blocks (rows shuffled between --sessions sessions, as a
table filled over time is; 32 Ki on L1, 128 Ki on L2, the rest on L3) and times
Returns.sample for 1, 8 and 32 turns waiting outside the batch, none of them read ahead yet
(each then asks ReturningReads.needed, i.e. the mirror's blocks of the session on L3), plus
one SlotMirror.session_logical lookup. Prints JSON (milliseconds: median and least).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpkv.models.returns import Returns  # noqa: E402
from tpkv.protocol.plan import Tier  # noqa: E402
from tpkv.workers.mirror import SlotMirror  # noqa: E402
from tpkv.workers.returning import ReturningReads  # noqa: E402
from tpkv.workers.slots import SlotAllocator  # noqa: E402

L1, L2 = 32 << 10, 128 << 10


def build_mirror(num_blocks: int, num_sessions: int, seed: int = 0) -> SlotMirror:
    rng = np.random.default_rng(seed)
    mirror = SlotMirror(SlotAllocator(L1, "L1"), SlotAllocator(L2, "L2"), capacity=num_blocks)
    sess = rng.permutation(np.arange(num_blocks) % num_sessions)  # session of each row
    logical = np.zeros(num_blocks, dtype=np.int64)
    for s in range(num_sessions):  # logical index in row order within each session
        on = np.flatnonzero(sess == s)
        logical[on] = np.arange(len(on))
    tiers = np.full(num_blocks, int(Tier.SSD), dtype=np.int64)
    slots = np.full(num_blocks, -1, dtype=np.int64)
    order = rng.permutation(num_blocks)
    tiers[order[:L1]], slots[order[:L1]] = int(Tier.HBM), np.arange(L1)
    tiers[order[L1:L1 + L2]], slots[order[L1:L1 + L2]] = int(Tier.DRAM), np.arange(L2)
    names = [f"s{i}" for i in range(num_sessions)]
    mirror.put(np.arange(num_blocks, dtype=np.int64), tiers, slots,
               [names[i] for i in sess.tolist()], logical)
    return mirror


def rank0(mirror: SlotMirror) -> Returns:
    """Returns on rank 0 of a stand-in runtime whose worker has the real ReturningReads lookups on
    `mirror` (with an L3 whose read-ahead budget holds any session, nothing read ahead)."""
    ahead = SimpleNamespace(done=lambda name: None, holds=lambda n: True)
    store: Any = SimpleNamespace(ahead=ahead)
    spills: Any = SimpleNamespace(busy=lambda name: False)
    worker: Any = SimpleNamespace(mirror=mirror, store=store,
                                  returning=ReturningReads(store, mirror, spills))
    pol = SimpleNamespace(prefill_tokens_per_s=1e4, ssd_read_bytes_per_s=1e9,
                          gpu_share_weight=1.0)
    cfg = SimpleNamespace(wait_timeout_s=5.0, policy=pol)
    return Returns(SimpleNamespace(config=cfg, rank=0, worker=worker))  # type: ignore[arg-type]


def timed_ms(fn: Any, reps: int) -> dict[str, float]:
    """Median and least of `reps` calls, in ms (the least: the cost with the cores to itself)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"p50": round(float(np.median(times)) * 1e3, 3),
            "min": round(float(np.min(times)) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    t0 = time.perf_counter()
    mirror = build_mirror(args.blocks, args.sessions)
    build_s = time.perf_counter() - t0
    returns = rank0(mirror)
    out: dict[str, Any] = {"blocks": args.blocks, "sessions": args.sessions,
                           "build_s": round(build_s, 2),
                           "session_logical_ms": timed_ms(
                               lambda: mirror.session_logical("s1", int(Tier.SSD)), args.reps)}
    for waiting in (1, 8, 32):
        turns = [SimpleNamespace(session=f"s{i}") for i in range(waiting)]
        assert returns.sample(turns) == []  # all need a read ahead, none done
        out[f"sample_ms_{waiting}_waiting"] = timed_ms(
            lambda turns=turns: returns.sample(turns), args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
