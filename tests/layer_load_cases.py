"""The stored blocks and the gated copy of the vLLM connector's layer-wise load tests (unit and
GPU): a prompt stored from some vLLM blocks, the plan that loads it into others."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.plan import StepPlan
from tpkv.integrations.vllm.planner import Planner

BT = 4
NUM_BLOCKS = 16
NUM_LAYERS = 4
SEED = chain_seed("test-model", BT)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks
STORED = [0, 1, 2, 3]  # the vLLM blocks request "w" computed the prompt in
LOADED = [8, 9, 10, 11]  # the blocks request "r" loads it into


class GatedViews(list):  # type: ignore[type-arg]
    """The copy thread's layer views; fetching layer `gated` waits until `gate` is set (a copy
    of that layer held back for as long as the test wants), or raises with `fail`."""

    def __init__(self, views: list[torch.Tensor], gated: int, fail: bool = False) -> None:
        super().__init__(views)
        self.gated = gated
        self.fail = fail
        self.gate = threading.Event()

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if i == self.gated:
            if self.fail:
                raise RuntimeError(f"layer {i}'s copy fails")
            self.gate.wait(30)
        return super().__getitem__(i)


def kv_caches(device: str = "cpu") -> dict[str, torch.Tensor]:
    """NUM_LAYERS layers laid out as vLLM's CPU backend does: [blocks, K/V, tokens, 8]."""
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(NUM_BLOCKS, 2, BT, 8, generator=g).to(device) for name in NAMES}


def stored_setup(device: str = "cpu"
                 ) -> tuple[dict[str, torch.Tensor], BlockCopier, Planner, StepPlan]:
    """Request "w" stored PROMPT's 3 blocks; the plan of request "r"'s step, which loads them
    into LOADED (before any load, those blocks hold other KV), on `device`."""
    caches = kv_caches(device)
    copier = BlockCopier(1 << 20)
    copier.register(caches, NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    planner.matched_tokens(SimpleNamespace(request_id="w", all_token_ids=PROMPT), 0)
    plan = planner.plan([("w", 13)], lambda r: STORED)
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and len(report.saved) == 3
    planner.report(report)
    planner.finished("w")
    r = SimpleNamespace(request_id="r", all_token_ids=list(PROMPT))
    assert planner.matched_tokens(r, 0) == 12
    planner.after_alloc(r, LOADED, 12)
    plan = planner.plan([("r", 13)], lambda r: LOADED)
    assert [(s.block_ids, s.background) for s in plan.loads] == [(LOADED[:3], False)]
    for t in caches.values():
        assert not torch.equal(t[LOADED[0]], t[STORED[0]])
    return caches, copier, planner, plan


def loaded(caches: dict[str, torch.Tensor], name: str) -> bool:
    t = caches[name]
    return all(torch.equal(t[dst], t[src]) for src, dst in zip(STORED[:3], LOADED[:3]))
