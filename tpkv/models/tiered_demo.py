"""The tiered demo's driver: a multi-turn workload through a TieredEngine, and where its
sessions' blocks are at the end."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tpkv.launch.runtime import TpkvRuntime
from tpkv.models.llama import Llama
from tpkv.models.tiered import TIER_NAMES, TieredEngine


def tier_summary(rt: TpkvRuntime) -> dict[str, Any]:
    """Blocks per tier, and sessions by the farthest tier holding one of their blocks (every
    rank calls it: a collective)."""
    m = rt.controller_slot_map()
    tiers, sess = np.asarray(m["tiers"]), np.asarray(m["session_idx"])
    sessions = dict.fromkeys(TIER_NAMES.values(), 0)
    for s in np.unique(sess).tolist():
        sessions[TIER_NAMES.get(int(tiers[sess == s].max()), "l1")] += 1
    return {"blocks": {name: int((tiers == t).sum()) for t, name in TIER_NAMES.items()},
            "sessions": sessions}


def run_tiered_demo(rt: TpkvRuntime, model: Llama, workload_cfg: Any, seconds: float,
                    progress: Callable[[int, Any], None] | None = None,
                    **engine_kwargs: Any) -> dict[str, Any]:
    """Run the multi-turn workload (tpkv.models.workload, virtual clock: think times cost
    nothing) through a TieredEngine until it is done or for at most `seconds` of wall time;
    every rank calls this with the same arguments (rank 0 decides when to stop).
    `progress(turns done, TieredEngine.stats)` is called at the start and after every turn.
    Returns a summary dict."""
    from tpkv.models.workload import Workload

    tiered = TieredEngine(rt, model, **engine_kwargs)
    engine, workload = tiered.engine, Workload(workload_cfg)
    last: set[str] = set()
    now, started, decode_s, decode_tokens, turns = 0.0, time.perf_counter(), 0.0, 0, 0
    if progress is not None:
        progress(0, tiered.stats)
    while not workload.done:
        if rt.from_rank0(lambda: time.perf_counter() - started > seconds, "demo clock"):
            break
        for ev in workload.pop_ready(now):
            engine.add_turn(ev.session, ev.prompt_token_ids.tolist(), ev.max_new_tokens)
            if ev.last_turn:
                last.add(ev.session)
        if not engine.has_work:
            next_s = workload.next_time_s()
            if next_s is None:
                break
            now = max(now, next_s)
            continue
        engine.admit_pending()  # (whom the step runs, in waiting and running)
        decoding = not engine.prefill_next
        t0 = time.perf_counter()
        batch = len(engine.running) if decoding else 0
        finished = engine.step()
        took = time.perf_counter() - t0
        # The workload's virtual clock must be the same on every rank, or ranks pop different
        # turns: every rank advances it by rank 0's step time.
        now += float(rt.from_rank0(functools.partial(float, took), "demo step time"))
        if decoding:
            decode_s, decode_tokens = decode_s + took, decode_tokens + min(batch,
                                                                           engine.max_batch)
        for f in finished:
            turns += 1
            if progress is not None:
                progress(turns, tiered.stats)
            workload.complete(f.session, now)
            if f.session in last:
                engine.close_session(f.session)
    s = tiered.stats
    resume = {tier: {"count": len(v), "mean_ms": 1e3 * float(np.mean(v)) if v else None,
                     "p99_ms": 1e3 * float(np.percentile(v, 99)) if v else None}
              for tier, v in s.resume_s.items()}
    return {"wall_s": time.perf_counter() - started, "steps": s.steps, "turns": turns,
            "tiers": tier_summary(rt), "moves": dict(s.moves), "bytes": dict(s.bytes),
            "kept_moves": s.kept_moves, "kept_spills": s.kept_spills, "resume_latency": resume,
            "recompute_tokens": s.recompute_tokens, "retries": s.retries,
            "returns": {"read_ahead": tiered.returns.num_read_ahead,
                        "recomputed": tiered.returns.num_recomputed},
            "decode_tokens": decode_tokens,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0}
