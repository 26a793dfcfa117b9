"""The Llama-style model: presets, seeded weights, causality, RoPE, geometry, TP sharding shapes."""

from __future__ import annotations

import pytest
import torch

from tpkv.errors import ConfigError
from tpkv.models.llama import ModelConfig, apply_rope, build_model, dense_generate, rope_cos_sin
from tpkv.models.tp import apply_tp, maybe_init_dist, tp_info
from tpkv.workers.pools import HbmPool


def test_presets_have_the_promised_sizes():
    tiny, small, big = (ModelConfig.preset(n) for n in ("tiny", "small", "1b"))
    assert 100_000 <= tiny.num_params() <= 1_000_000
    assert tiny.num_params() < small.num_params() < 10_000_000
    assert 1.1e9 <= big.num_params() <= 1.3e9  # Llama-3.2-1B: 1.24B
    g = big.kv_geometry(tp_size=1, block_tokens=16)
    assert g.token_bytes_all_ranks == 32 * 1024  # 32 KiB of KV per token in bf16


@pytest.mark.parametrize("tied", [False, True])
def test_num_params_counts_the_real_module(tied):
    cfg = ModelConfig.preset("tiny", tie_embeddings=tied)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_bad_configs_fail_with_numbers():
    with pytest.raises(ConfigError, match="not a multiple"):
        ModelConfig.preset("tiny", num_kv_heads=3)
    with pytest.raises(ConfigError, match="even head_dim"):
        ModelConfig.preset("tiny", head_dim=15)
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig.preset("tiny", dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="no model preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.preset("tiny", hidden_size=0)


def test_seeded_weights_are_reproducible():
    a, b, c = build_model("tiny", seed=7), build_model("tiny", seed=7), build_model("tiny", 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_model_is_causal_and_decodes_varied_tokens():
    model = build_model("tiny", seed=0)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(1))
    full = model(ids)  # [30, vocab]
    prefix = model(ids[:17])
    torch.testing.assert_close(full[:17], prefix, atol=1e-5, rtol=1e-5)
    tokens, logits = dense_generate(model, ids.tolist(), 12)
    assert logits.shape == (12, 512) and len(set(tokens)) > 3  # not one repeated token


def test_rope_scores_depend_on_relative_position_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 16, generator=g), torch.randn(1, 2, 16, generator=g)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.tensor([pq]), 16, 10_000.0)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 16, 10_000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum(-1)

    torch.testing.assert_close(score(9, 4), score(1005, 1000), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(9, 4), score(9, 5), atol=1e-3)


def test_kv_geometry_matches_the_l1_pool_and_the_sharded_model():
    cfg = ModelConfig.preset("tiny")
    g = build_model(cfg).kv_geometry(tp_size=2, block_tokens=8)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (3, 4, 16, "float32")
    assert g.block_shape == (3, 2, 8, 2, 16)
    assert HbmPool(g, 5, "cpu").tensor.shape == (5, 3, 2, 8, 2, 16)
    with pytest.raises(ConfigError, match="kv_heads % tp"):
        cfg.kv_geometry(tp_size=8)


def test_apply_tp_shards_column_and_row_parallel_weights():
    full = build_model("tiny", seed=3)
    model = apply_tp(build_model("tiny", seed=3), rank=1, world_size=2)
    assert tp_info(model) == (1, 2) and tp_info(full) == (0, 1)
    attn, full_attn = model.blocks[0].attn, full.blocks[0].attn
    assert attn.wq.weight.shape == (64, 128) and attn.wk.weight.shape == (32, 128)
    assert attn.wo.weight.shape == (128, 64)
    torch.testing.assert_close(attn.wq.weight, full_attn.wq.weight[64:], atol=0, rtol=0)
    torch.testing.assert_close(attn.wk.weight, full_attn.wk.weight[32:], atol=0, rtol=0)
    torch.testing.assert_close(attn.wo.weight, full_attn.wo.weight[:, 64:], atol=0, rtol=0)
    mlp = model.blocks[2].mlp
    assert mlp.w_up.weight.shape == (128, 128) and mlp.w_down.weight.shape == (128, 128)
    assert torch.equal(model.embed.weight, full.embed.weight)  # replicated
    assert model.kv_geometry(2).heads_per_rank * 16 == attn.wk.out_features
    with pytest.raises(ConfigError, match="already applied"):
        apply_tp(model, 0, 2)
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        apply_tp(build_model("tiny"), 0, 8)
    with pytest.raises(ConfigError, match="rank 2"):
        apply_tp(build_model("tiny"), 2, 2)


def test_one_plain_process_has_no_dist():
    assert maybe_init_dist() is None
