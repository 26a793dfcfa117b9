"""Each tpkv.init gets a controller of its own, made from its config, on either transport: one
runtime's close ends the controller its init made, so the next init in the same process and
Ray cluster (a notebook, a test run, a service restarting its engine) starts afresh."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")


def test_a_second_init_after_close_gets_a_fresh_controller_with_its_config(
        transport: str) -> None:
    """On d963d29 the second init through Ray (in a cluster the caller started) found the
    first runtime's actor by name: L1 of 24 blocks instead of the 40 asked for, and session
    s0 still open there (DuplicateSessionError at its turn)."""
    import tpkv
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model, dense_generate
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    prompt = list(range(5, 30))
    want = [tuple(dense_generate(model, prompt, 4)[0])]
    runtimes: list[Any] = []  # kept: the first runtime's objects outlive its close
    for l1 in (24, 40):
        cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=l1, l2_blocks=64,
                            policy=PolicyConfig(cooldown_s=0.0))
        rt = tpkv.init(cfg, controller=transport, device="cpu")
        runtimes.append(rt)
        try:
            snap = rt.controller.snapshot()
            assert snap["tiers"]["L1"]["slots"] == l1 and snap["sessions"] == []
            engine = TieredEngine(rt, model, report_prefill=False).engine
            engine.add_turn("s0", prompt, 4)  # left open at close
            assert [f.token_ids for f in engine.run()] == want
        finally:
            rt.close()
