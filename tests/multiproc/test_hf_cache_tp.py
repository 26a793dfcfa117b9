"""TpkvCache at TP 2 on CPU (gloo): a tiny Llama loaded with `from_pretrained(tp_plan="auto")` on
two ranks, each holding kv_heads / 2 heads, generates DynamicCache's tokens through the tiers."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

from tests.hf_cases import (
    BT,
    L1_BLOCKS,
    L2_BLOCKS,
    SESSIONS,
    TURNS,
    dynamic_reference,
    same_kv,
    tiered_chat,
    tiny_llama,
)
from tests.multiproc.harness import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # from_pretrained needs it for tp_plan


def hf_tp_rank(rank: int, world: int, model_dir: str, ssd_root: str,
               mode: str) -> dict[str, Any]:
    """One rank as torchrun would start it: transformers forms the process group (through the
    harness's store, as through torchrun's agent store) and shards the model; then attach."""
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import LlamaForCausalLM

    import tpkv
    from tpkv.config import HbmConfig, HostConfig, PolicyConfig, SsdConfig
    from tpkv.models.fingerprint import llama_fingerprint, params_digest
    from tpkv.models.hf_attach import model_geometry
    from tpkv.models.llama import build_model
    from tpkv.models.tp import apply_tp

    model = LlamaForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    # a sharded tpkv Llama: each rank digests its shards, the fingerprint is one for the group
    llama_fp = llama_fingerprint(apply_tp(build_model("tiny", seed=0), rank, world))
    block_bytes = model_geometry(model, block_tokens=BT).block_bytes
    tiers_cfg = {"l1": HbmConfig(num_blocks=L1_BLOCKS),
                 "l2": HostConfig(budget_bytes=L2_BLOCKS * world * block_bytes,
                                  arena_bytes=L2_BLOCKS * block_bytes),
                 "l3": SsdConfig(root=ssd_root, budget_bytes=4096 * block_bytes,
                                 o_direct=False, io_threads=2),
                 # spills unpaced, as hf_cases.tiers_config says why: "load" checks that
                 # every resume loads
                 "policy": PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0,
                                        spill_pacing=False),
                 "wait_timeout_s": 60.0}
    with tpkv.attach(model, tiers_cfg, block_tokens=BT, controller="local") as tiers:
        if mode == "miss" and rank == 0:
            tiers.rt.worker.fault_miss_from = 1  # the first L3 read on rank 0 fails its checks
        got, losses = tiered_chat(model, tiers)
        want, caches = dynamic_reference(model, losses)  # the same sharded model
        s = tiers.stats
        return {"got": got, "want": want, "losses": sorted(losses.items()),
                "moves": dict(s.moves), "retries": s.retries, "lost_tokens": s.lost_tokens,
                "resumed": sorted({t for c in tiers.caches.values() for t in c.resumed_from}),
                "kv_checked": same_kv(tiers, caches), "mismatches": tiers.rt.num_mismatches,
                "fp": tiers.rt.config.model_fingerprint, "llama_fp": llama_fp,
                "shard_digest": params_digest(model), "tp": tiers.geometry.tp_size,
                "heads_per_rank": tiers.geometry.heads_per_rank,
                "cache_heads": int(caches["s0"].layers[0].keys.shape[1]),
                "ahead": (tiers.rt.num_ahead_used, tiers.rt.num_ahead_unused),
                "passes": (s.steps, s.passes_without_step)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["load", "miss"])
def test_tp2_from_pretrained_tp_plan_auto_gives_dynamic_cache_tokens(tmp_path, mode):
    model = tiny_llama()  # 2 KV heads: one a rank
    model.save_pretrained(tmp_path / "model")
    results = run_ranks(hf_tp_rank, 2, str(tmp_path / "model"), str(tmp_path / "l3"), mode,
                        timeout_s=220)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        out = results[r]
        assert out["ok"], out.get("trace")
        assert (out["tp"], out["heads_per_rank"], out["cache_heads"]) == (2, 1, 1)
        assert sum(len(t) for t in out["want"].values()) == SESSIONS * TURNS
        assert out["got"] == out["want"]
        assert out["kv_checked"] == SESSIONS * 2 * 2
        moves = out["moves"]
        assert moves["l1_l2"] > 0 and moves["l2_l3"] > 0, moves
        assert moves["l3_l2"] > 0 and moves["l2_l1"] > 0, moves
        assert out["mismatches"] == 0
        if mode == "load":
            assert {"l2", "l3"} <= set(out["resumed"]), out["resumed"]
            assert out["losses"] == [] and out["retries"] == 0
        else:  # every rank re-prefilled from the same token (the miss was rank 0's alone)
            assert out["losses"] and out["retries"] >= 1 and out["lost_tokens"] > 0
    assert results[0]["got"] == results[1]["got"]
    # passes that fit their step's room ran with no step, the same ones on both ranks; the
    # rest found some steps planned ahead (rank 0 sends and counts them), none in vain (every
    # turn runs to max_new_tokens: no pass plans past a turn's last)
    steps, without = results[0]["passes"]
    assert without > 0 and steps > 0 and results[1]["passes"] == (steps, without)
    used, unused = results[0]["ahead"]
    assert used > 0 and unused == 0 and results[1]["ahead"] == (0, 0), results[0]["ahead"]
    # each rank holds other shards, the fingerprint is the same on both (gathered)
    assert results[0]["shard_digest"] != results[1]["shard_digest"]
    assert results[0]["fp"] == results[1]["fp"] and results[0]["fp"].startswith("hf-")
    assert results[0]["llama_fp"] == results[1]["llama_fp"]
    assert results[0]["moves"] == results[1]["moves"]
    assert results[0]["losses"] == results[1]["losses"]
