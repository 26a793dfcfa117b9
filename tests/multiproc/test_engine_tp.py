"""TP 2 on CPU (gloo, two spawned processes) decodes the same tokens as TP 1, logits close."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpkv.models.engine import PagedEngine
from tpkv.models.llama import build_model
from tpkv.models.tp import apply_tp
from tpkv.models.turns import StepReport

BT, SLOTS = 4, 64
# Float32 throughout. TP splits the row-parallel sums in two and adds the halves (gloo), so
# logits differ from TP 1 by reduction order only (measured: 5e-6 at most); 1e-4 leaves margin
# and stays far below the smallest top-1 gap of this scenario (3e-3), so tokens must agree.
ATOL = RTOL = 1e-4


def run_scenario(rank: int, world_size: int) -> dict[str, Any]:
    """Two turns of four sessions through the step loop; blocks scattered over L1 by a seeded
    scheduler (the same on every rank, as the controller's one slot mapping would be)."""
    torch.set_num_threads(1)
    model = apply_tp(build_model("tiny", seed=0), rank, world_size)
    g = model.kv_geometry(tp_size=world_size, block_tokens=BT)
    pool = torch.full((SLOTS, *g.block_shape), float("nan"))
    reports: list[StepReport] = []
    engine = PagedEngine(model, pool, scheduler_seed=9, report=reports.append)
    rng = np.random.default_rng(0)
    tokens: dict[str, list[tuple[int, ...]]] = {}
    for turn in range(2):
        for i, s in enumerate("abcd"):
            engine.add_turn(s, rng.integers(0, 512, 3 + 7 * i + turn).tolist(), 5 + i)
        for f in engine.run():
            tokens.setdefault(f.session, []).append(f.token_ids)
    return {"tokens": tokens, "logits": [r.output.logits for r in reports],
            "mass": [np.concatenate(r.output.block_mass) for r in reports],
            "new": [r.num_new_tokens for r in reports],
            "heads": model.blocks[0].attn.wq.out_features // model.config.head_dim}


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        torch.save(run_scenario(rank, world_size), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_tp2_gloo_gives_the_tokens_of_tp1(tmp_path):
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = run_scenario(0, 1)
    assert single["tokens"] and len(single["logits"]) > 4
    cfg = build_model("tiny").config
    for got in ranks:
        assert got["tokens"] == single["tokens"]
        assert len(got["logits"]) == len(single["logits"])
        for a, b in zip(got["logits"], single["logits"]):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
        # Each rank sees its own half of the heads: its mass totals layers x heads/2 x tokens.
        assert got["heads"] == cfg.num_heads // 2
        for mass, new in zip(got["mass"], got["new"]):
            total = cfg.num_layers * got["heads"] * sum(new)
            assert mass.sum() == pytest.approx(total, rel=1e-5)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.equal(a, b)  # after the all-reduce the ranks hold the same numbers
