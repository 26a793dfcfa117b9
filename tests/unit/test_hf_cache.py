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
    SESSIONS,
    TURNS,
    dynamic_reference,
    same_kv,
    tiered_chat,
    tiny_llama,
)
from tpkv.config import HbmConfig, HostConfig, PolicyConfig, SsdConfig
from tpkv.errors import ConfigError

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(1)


def tiers_config(model: Any, l1: int, l2: int, ssd_root: str | None) -> dict[str, Any]:
    """Tier sizes in blocks; loads always beat recomputes (a slow prefill rate)."""
    from tpkv.models.hf_attach import model_geometry

    block_bytes = model_geometry(model, block_tokens=BT).block_bytes
    l3 = (SsdConfig(root=ssd_root, budget_bytes=4096 * block_bytes, o_direct=False,
                    io_threads=2) if ssd_root else SsdConfig())
    return {"l1": HbmConfig(num_blocks=l1),
            "l2": HostConfig(budget_bytes=l2 * block_bytes, arena_bytes=l2 * block_bytes),
            "l3": l3, "policy": PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0)}


def run_tiered(model: Any, l1: int, l2: int, ssd_root: str | None,
               miss: bool = False) -> dict[str, Any]:
    """The chat through tpkv.attach; then every session's K/V against DynamicCache's."""
    import tpkv

    with tpkv.attach(model, tiers_config(model, l1, l2, ssd_root), block_tokens=BT,
                     controller="local", device="cpu") as tiers:
        if miss:
            tiers.rt.worker.fault_miss_from = 1  # the first L3 read fails its checks
        got, losses = tiered_chat(model, tiers)
        want, caches = dynamic_reference(model, losses)
        return {"got": got, "want": want, "losses": losses, "stats": tiers.stats,
                "resumed": {s: list(c.resumed_from) for s, c in tiers.caches.items()},
                "kv_checked": same_kv(tiers, caches), "mismatches": tiers.rt.num_mismatches}


@pytest.mark.timeout(120)
def test_tiers_give_dynamic_cache_tokens_through_l2_and_l3(tmp_path):
    model = tiny_llama()
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"))
    assert sum(len(t) for t in out["want"].values()) == SESSIONS * TURNS
    assert out["got"] == out["want"]
    assert out["kv_checked"] == SESSIONS * 2 * model.config.num_hidden_layers
    moves, resumed = out["stats"].moves, out["resumed"]
    assert moves["l1_l2"] > 0 and moves["l2_l3"] > 0, moves  # demoted, then spilled
    assert moves["l3_l2"] > 0 and moves["l2_l1"] > 0, moves  # and loaded back
    tiers_seen = {t for ts in resumed.values() for t in ts}
    assert {"l2", "l3"} <= tiers_seen, resumed  # some turn resumed from each tier
    assert out["losses"] == {} and out["stats"].lost_tokens == 0  # loads, no recompute
    assert out["mismatches"] == 0 and out["stats"].retries == 0


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
    assert out["losses"], "no L3 read missed"  # the fault hit a session's resume
    assert out["stats"].retries >= 1 and out["stats"].lost_tokens > 0
    # DynamicCache cropped at the same tokens: the same forward shapes, the same tokens
    assert out["got"] == out["want"]


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
