"""Not a test: times a step's in-step load into a CPU KV cache, copied whole in BlockCopier.load
or layer by layer (tpkv/integrations/vllm/layer_load.py), without vLLM.

`python tests/vllm/time_layer_loads.py [REPS]`: 64 stored blocks of 32 layers of 32 KiB loaded
into other vLLM blocks; prints the medians of when load returns, when layer 0 is in and when
every layer is in.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.plan import StepPlan
from tpkv.integrations.vllm.planner import Planner

NUM_LAYERS = 32
NUM_VLLM_BLOCKS = 200
BT = 16
PAGE_FLOATS = 8192  # 32 KiB a layer of a block
LOADED_BLOCKS = 64
NAMES = [f"layer{i}" for i in range(NUM_LAYERS)]


def setup() -> tuple[BlockCopier, StepPlan]:
    """A copier that stored LOADED_BLOCKS blocks of request "w", and the plan of request "r"'s
    step, which loads them into other vLLM blocks."""
    caches = {name: torch.randn(NUM_VLLM_BLOCKS, PAGE_FLOATS) for name in NAMES}
    copier = BlockCopier(1 << 31)
    copier.register(caches, NUM_VLLM_BLOCKS)
    planner = Planner(BT, chain_seed("timing", BT), capacity_blocks=10**5)
    prompt = list(range(LOADED_BLOCKS * BT + 1))
    planner.matched_tokens(SimpleNamespace(request_id="w", all_token_ids=prompt), 0)
    plan = planner.plan([("w", len(prompt))], lambda r: list(range(LOADED_BLOCKS + 1)))
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None
    planner.report(report)
    planner.finished("w")
    again = SimpleNamespace(request_id="r", all_token_ids=list(prompt))
    planner.matched_tokens(again, 0)
    ids = list(range(100, 101 + LOADED_BLOCKS))
    planner.after_alloc(again, ids, LOADED_BLOCKS * BT)
    return copier, planner.plan([("r", len(prompt))], lambda r: ids)


def median_ms(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] * 1e3


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    mib = LOADED_BLOCKS * NUM_LAYERS * PAGE_FLOATS * 4 >> 20
    for mode in ("whole", "layers"):
        returned: list[float] = []
        first: list[float] = []
        every: list[float] = []
        for _ in range(reps):
            copier, plan = setup()
            began = time.perf_counter()
            copier.load(plan.loads, None if mode == "whole" else NAMES)
            returned.append(time.perf_counter() - began)
            copier.wait_layer(NAMES[0])
            first.append(time.perf_counter() - began)
            for name in NAMES:
                copier.wait_layer(name)
            assert copier.finish_layer_loads()
            every.append(time.perf_counter() - began)
            assert copier.take_failed_block_ids() == set()
            assert copier.num_loaded_blocks == LOADED_BLOCKS
            copier.close()
        print(f"{mode}: {LOADED_BLOCKS} blocks x {NUM_LAYERS} layers ({mib} MiB): load returns "
              f"{median_ms(returned):.2f} ms, layer 0 in {median_ms(first):.2f} ms, every layer "
              f"{median_ms(every):.2f} ms (medians of {reps})")


if __name__ == "__main__":
    main()
