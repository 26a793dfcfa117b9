"""Drive the paged engine with the multi-turn workload: closed loop, virtual clock; CLI demo."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpkv.models.engine import PagedEngine
from tpkv.models.llama import ModelConfig, build_model
from tpkv.models.tp import apply_tp, maybe_init_dist
from tpkv.models.turns import Finished
from tpkv.models.workload import TurnEvent, Workload, WorkloadConfig


@dataclass
class RunStats:
    """What one run did; `turns` maps session -> generated tokens of each of its turns."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    turns: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)


def run_workload(engine: PagedEngine, workload: Workload,
                 step_s: Callable[[float], float] | None = None,
                 on_event: Callable[[TurnEvent], None] | None = None) -> RunStats:
    """Run every turn of `workload` through `engine` until both are idle.

    The clock is virtual: it advances by each step's duration (`step_s(measured wall seconds)`,
    default the measured time) and jumps over idle gaps to the next turn, so think times cost
    nothing. A session is closed (its blocks released) after its last turn.
    """
    stats, now, started = RunStats(), 0.0, time.perf_counter()
    last_turn: set[str] = set()
    while not workload.done:
        for event in workload.pop_ready(now):
            engine.add_turn(event.session, event.prompt_token_ids.tolist(), event.max_new_tokens)
            stats.num_prefill_tokens += len(event.prompt_token_ids)
            if event.last_turn:
                last_turn.add(event.session)
            if on_event is not None:
                on_event(event)
        if not engine.has_work:
            next_s = workload.next_time_s()
            assert next_s is not None, "workload waits for turns the engine does not hold"
            now = max(now, next_s)
            continue
        t0 = time.perf_counter()
        finished: list[Finished] = engine.step()
        measured = time.perf_counter() - t0
        now += step_s(measured) if step_s is not None else measured
        stats.num_steps += 1
        for f in finished:
            stats.turns.setdefault(f.session, []).append(f.token_ids)
            stats.num_decode_tokens += len(f.token_ids)
            workload.complete(f.session, now)
            if f.session in last_turn:
                engine.close_session(f.session)
    stats.virtual_s, stats.wall_s = now, time.perf_counter() - started
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="tpkv paged engine demo (random weights)")
    parser.add_argument("--model", default="small", help="tiny, small or 1b")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--max-session-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rank = maybe_init_dist()
    world = torch.distributed.get_world_size() if rank is not None else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    cfg = ModelConfig.preset(args.model)
    model = apply_tp(build_model(cfg, seed=args.seed, device=device), rank or 0, world)
    wl_cfg = WorkloadConfig(
        num_sessions=args.sessions, num_users=args.users, system_prompt_tokens=128,
        doc_tokens=(256, 768), user_tokens=(8, 48), gen_tokens=(8, 32),
        max_session_tokens=args.max_session_tokens, vocab_size=cfg.vocab_size, seed=args.seed)
    # The default scheduler keeps everything in L1: size it for every user's longest session.
    slots = args.users * -(-args.max_session_tokens // args.block_tokens) + args.users
    geometry = model.kv_geometry(world, args.block_tokens)
    pool = torch.empty((slots, *geometry.block_shape), dtype=cfg.torch_dtype, device=device)
    engine = PagedEngine(model, pool, scheduler_seed=args.seed)
    stats = run_workload(engine, Workload(wl_cfg))
    if not rank:
        print(f"{len(stats.turns)} sessions, {sum(len(t) for t in stats.turns.values())} turns, "
              f"{stats.num_steps} steps; {stats.num_prefill_tokens} prompt and "
              f"{stats.num_decode_tokens} generated tokens in {stats.wall_s:.1f} s "
              f"(virtual {stats.virtual_s:.0f} s); L1 {slots} slots per rank, TP {world}")


if __name__ == "__main__":
    main()
