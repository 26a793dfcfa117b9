"""A small multi-turn workload through the tiered engine (TP 1, CPU) and its no-fault reference."""

from __future__ import annotations

from typing import Any

import torch

from tests.multiproc.test_engine_tiered import BT, Turns, drive, reference
from tpkv.config import PolicyConfig, TpkvConfig
from tpkv.models.llama import Llama, build_model
from tpkv.models.tiered import tiered_config

# The workload and its reference are those of the engine-on-tiers test.
__all__ = ["BT", "drive", "reference", "tiny_model_and_reference", "tiny_tiers"]


def tiny_model_and_reference() -> tuple[Any, Turns]:
    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device="cpu")
    return model, reference(model)


def tiny_tiers(model: Llama, ssd_root: str, wait_timeout_s: float = 30.0) -> TpkvConfig:
    """L1 of 32 blocks, L2 of 16: the six sessions (about 80 blocks) need L3."""
    return tiered_config(model, 1, block_tokens=BT, l1_blocks=32, l2_blocks=16,
                         ssd_root=ssd_root, wait_timeout_s=wait_timeout_s,
                         policy=PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0))
