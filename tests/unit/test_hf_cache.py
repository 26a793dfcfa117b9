"""TpkvCache at TP 1: greedy generate through tiny tiers (sessions through L2 and L3 between
turns) gives DynamicCache's tokens and K/V, and an all-L1 run's; the geometry checks."""

from __future__ import annotations

import pytest
import torch

from tests.hf_cases import (
    BT,
    L1_BLOCKS,
    L2_BLOCKS,
    check_l3_miss_refed,
    check_through_l2_and_l3,
    one_process,
    run_tiered,
    tiers_config,
    tiny_llama,
)
from tpkv.config import HbmConfig
from tpkv.errors import ConfigError

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    one_process(monkeypatch)
    torch.set_num_threads(1)


@pytest.mark.timeout(120)
def test_tiers_give_dynamic_cache_tokens_through_l2_and_l3(tmp_path):
    model = tiny_llama()
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"))
    check_through_l2_and_l3(out, model.config.num_hidden_layers)
    assert out["l1_device"] == "cpu"


@pytest.mark.timeout(120)
def test_all_l1_run_gives_the_same_tokens_without_moves(tmp_path):
    model = tiny_llama()
    big = run_tiered(model, 256, 16, None)
    assert big["got"] == big["want"]
    assert sum(big["stats"].moves.values()) == 0 and big["resumed"] == dict.fromkeys(
        big["resumed"], [])
    small = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"))
    assert small["got"] == big["got"]


@pytest.mark.timeout(120)
def test_an_l3_miss_feeds_the_lost_tokens_again(tmp_path):
    model = tiny_llama()
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"), miss=True)
    check_l3_miss_refed(out, model.config.num_hidden_layers)


def test_kv_heads_not_divisible_by_tp_is_a_config_error():
    import tpkv
    from tpkv.models.hf_attach import model_geometry

    model = tiny_llama(kv_heads=3, heads=6, hidden=96)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=3 .* tp=2"):
        model_geometry(model, tp_size=2)
    with pytest.raises(ConfigError, match=r"kv_heads % tp = 1"):
        tpkv.attach(model, {"l1": HbmConfig(num_blocks=8)}, tp_size=2, controller="local")
    g = model_geometry(model, tp_size=3, block_tokens=8)
    assert (g.num_layers, g.num_kv_heads, g.heads_per_rank, g.head_dim, g.dtype,
            g.block_tokens) == (2, 3, 1, 16, "float32", 8)


def test_a_config_whose_geometry_is_not_the_models_is_refused():
    import tpkv
    from tpkv.config import KvGeometry, TpkvConfig

    model = tiny_llama()
    wrong = TpkvConfig(geometry=KvGeometry(num_layers=2, num_kv_heads=4, head_dim=16,
                                           dtype="float32"), l1=HbmConfig(num_blocks=8))
    with pytest.raises(ConfigError, match="num_kv_heads: model 2, config 4"):
        tpkv.attach(model, wrong, controller="local")


@pytest.mark.timeout(60)
def test_a_forward_that_fails_half_way_leaves_the_cache_as_it_was():
    from transformers import DynamicCache

    import tpkv
    from tpkv.errors import TpkvError
    from tpkv.models.hf_attach import cache_kwarg

    model = tiny_llama()
    kw = cache_kwarg(model)
    first, second = torch.arange(3, 13).reshape(1, -1), torch.tensor([[40, 41, 42]])
    with torch.no_grad(), tpkv.attach(model, tiers_config(model, 64, 16, None),
                                      block_tokens=BT, controller="local", device="cpu") as t:
        ref, cache = DynamicCache(), t.cache("chat")
        want = model.generate(first, **{kw: ref}, max_new_tokens=4, do_sample=False)
        got = model.generate(first, **{kw: cache}, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want) and cache.get_seq_length() == ref.get_seq_length() == 13
        k = torch.zeros(1, 1, 5, 16)  # layer 0 takes 5 tokens, then layer 1 gets bad heads
        cache.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0)
        with pytest.raises(ConfigError, match="1 heads x 16 dims"):
            cache.update(k, k, 1)
        with pytest.raises(TpkvError, match="one sequence"):
            cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
        assert cache.get_seq_length() == 13  # the failed pass wrote nothing that counts
        ids = torch.cat([got, second], dim=1)
        want = model.generate(ids, **{kw: ref}, max_new_tokens=4, do_sample=False)
        got = model.generate(ids, **{kw: cache}, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
        for (keys, values), layer in zip(cache.read_kv(), ref.layers, strict=True):
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
