"""TpkvCache at TP 1: greedy generate through tiny tiers (sessions through L2 and L3 between
turns) gives DynamicCache's tokens and K/V, and an all-L1 run's; the geometry checks."""

from __future__ import annotations

from typing import Any

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
def test_tiers_give_dynamic_cache_tokens_through_l2_and_l3(tmp_path, transport):
    model = tiny_llama()
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"), controller=transport)
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
def test_an_l3_miss_feeds_the_lost_tokens_again(tmp_path, transport):
    model = tiny_llama()
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"), miss=True,
                     controller=transport)
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


@pytest.mark.timeout(120)
def test_decode_steps_read_no_block_and_the_kept_copy_equals_the_blocks(tmp_path, monkeypatch):
    """The past is gathered from the blocks once per layer at a turn that follows another
    session or a resume (from L2 and L3 here), never per decode step; a turn right after the
    same session's turn gathers nothing. After every turn the contiguous copy a pass hands to
    attention equals the blocks (read_kv) and DynamicCache's K/V, bit for bit."""
    import numpy as np
    from transformers import DynamicCache

    import tpkv
    from tests.hf_cases import VOCAB
    from tpkv.models.hf_attach import cache_kwarg
    from tpkv.models.hf_cache import TpkvCache

    gathers: list[int] = []
    real = TpkvCache._gather

    def counting(self: TpkvCache, layer: int, num_tokens: int,
                 *new: Any) -> tuple[torch.Tensor, ...]:
        gathers.append(layer)
        return real(self, layer, num_tokens, *new)

    monkeypatch.setattr(TpkvCache, "_gather", counting)
    model = tiny_llama()
    layers, kw = model.config.num_hidden_layers, cache_kwarg(model)
    rng = np.random.default_rng(3)
    refs: dict[str, DynamicCache] = {}
    history: dict[str, torch.Tensor] = {}
    order = ["s0", "s0", "s1", "s2", "s3", "s0", "s0", "s1", "s2", "s3", "s1", "s0", "s0"]
    prev, tiers_seen, same_turns = None, set(), 0
    with torch.no_grad(), tpkv.attach(model, tiers_config(model, L1_BLOCKS, L2_BLOCKS,
                                                          str(tmp_path / "l3")),
                                      block_tokens=BT, controller="local", device="cpu") as t:
        for s in order:
            n = 3 if s in history else 10
            user = torch.as_tensor(rng.integers(0, VOCAB, (1, n)))
            ids = torch.cat([history[s], user], dim=1) if s in history else user
            cache = t.cache(s)
            loads = len(cache.resumed_from)
            gathers.clear()
            got = model.generate(ids, **{kw: cache}, max_new_tokens=4, do_sample=False)
            ref = refs.setdefault(s, DynamicCache())
            want = model.generate(ids, **{kw: ref}, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, want), s
            new_loads = cache.resumed_from[loads:]
            tiers_seen.update(new_loads)
            assert len(new_loads) <= 1, new_loads  # loads only at a turn's first pass here
            if s != prev or new_loads:
                assert sorted(gathers) == list(range(layers)), (s, gathers)
            else:
                assert gathers == [], (s, gathers)
                same_turns += 1
            views = list(cache.views)
            for layer, ((k, v), blocks, dyn) in enumerate(zip(views, cache.read_kv(),
                                                              ref.layers, strict=True)):
                assert k.shape[2] == got.shape[1] - 1, (s, layer)  # the last token not fed yet
                assert torch.equal(k, blocks[0]) and torch.equal(v, blocks[1]), (s, layer)
                assert torch.equal(k, dyn.keys) and torch.equal(v, dyn.values), (s, layer)
            history[s], prev = got, s
    assert {"l2", "l3"} <= tiers_seen, tiers_seen  # the copy was rebuilt after both kinds
    assert same_turns >= 2  # and kept across turns of one session
