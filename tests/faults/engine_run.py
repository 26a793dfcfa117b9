"""A small multi-turn workload through the tiered engine (TP 1, CPU) and its no-fault reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tpkv.config import PolicyConfig, TpkvConfig
from tpkv.models.engine import PagedEngine
from tpkv.models.llama import Llama, build_model
from tpkv.models.tiered import tiered_config

BT, SESSIONS, TURNS, GROUP = 4, 6, 3, 2
Turns = dict[str, list[tuple[int, ...]]]


def drive(engine: PagedEngine, seed: int = 0) -> Turns:
    """Turns of two sessions at a time, round robin over six: between two turns of a session
    the four others run, so a small L1 demotes it and a small L2 spills it to L3."""
    rng = np.random.default_rng(seed)
    out: Turns = {}
    for turn in range(TURNS):
        for first in range(0, SESSIONS, GROUP):
            for i in range(first, first + GROUP):
                n = int(rng.integers(12, 21)) if turn == 0 else int(rng.integers(3, 9))
                engine.add_turn(f"s{i}", rng.integers(0, 512, n).tolist(),
                                int(rng.integers(4, 7)))
            for f in engine.run():
                out.setdefault(f.session, []).append(f.token_ids)
    return out


def reference(model: Llama) -> Turns:
    """The same workload with an L1 that holds everything: nothing moves, nothing fails."""
    g = model.kv_geometry(tp_size=1, block_tokens=BT)
    heads = model.blocks[0].attn.wk.out_features // model.config.head_dim
    pool = torch.full((256, g.num_layers, 2, BT, heads, g.head_dim), float("nan"))
    return drive(PagedEngine(model, pool, scheduler_seed=3))


def tiny_model_and_reference() -> tuple[Any, Turns]:
    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device="cpu")
    return model, reference(model)


def tiny_tiers(model: Llama, ssd_root: str, wait_timeout_s: float = 30.0) -> TpkvConfig:
    """L1 of 32 blocks, L2 of 16: the six sessions (about 80 blocks) need L3."""
    return tiered_config(model, 1, block_tokens=BT, l1_blocks=32, l2_blocks=16,
                         ssd_root=ssd_root, wait_timeout_s=wait_timeout_s,
                         policy=PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0))
