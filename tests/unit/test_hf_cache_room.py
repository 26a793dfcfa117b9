"""TpkvCache's passes without a step: K/V a pass holds for every layer are written into the
block at the pass's end (one copy), in whatever order the layers come, and read back exact."""

from __future__ import annotations

import pytest
import torch

from tests.hf_cases import BT, one_process, tiers_config, tiny_llama

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    one_process(monkeypatch)
    torch.set_num_threads(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 2, 1, 3]])
def test_layers_in_any_order_read_back_what_they_wrote(order):
    """A prompt pass of 6 tokens, then one-token passes to the end of the second block and
    into the third (most with no step): each layer's K/V read back (read_kv) is what it was
    given, whatever the order of the layers within a pass (a pass ends at the last layer)."""
    import tpkv

    model = tiny_llama(layers=4)
    gen = torch.Generator().manual_seed(sum(i * v for i, v in enumerate(order)))
    fed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(4)}
    with tpkv.attach(model, tiers_config(model, 32, 16, None), block_tokens=BT,
                     controller="local", device="cpu") as tiers:
        cache = tiers.cache("s")
        for new in [6] + [1] * (3 * BT - 6):
            for layer in order:
                k, v = (torch.randn(1, 2, new, 16, generator=gen) for _ in range(2))
                keys, values = cache.update(k, v, layer)
                fed[layer].append((k, v))
                want_k = torch.cat([kk for kk, _ in fed[layer]], dim=2)
                assert torch.equal(keys, want_k) and keys.is_contiguous(), layer
                assert torch.equal(values, torch.cat([vv for _, vv in fed[layer]], dim=2))
            assert cache.get_seq_length() == sum(k.shape[2] for k, _ in fed[0])
        assert tiers.stats.passes_without_step >= 2 * BT - 6  # all but one a block
        for layer, (keys, values) in enumerate(cache.read_kv()):
            assert torch.equal(keys, torch.cat([k for k, _ in fed[layer]], dim=2)), layer
            assert torch.equal(values, torch.cat([v for _, v in fed[layer]], dim=2)), layer


def test_max_new_tokens_as_generate_reads_it():
    """What plan_turn is told a turn makes at most: max_new_tokens, else max_length less the
    ids, from the call, then its generation_config, then the model's."""
    from transformers import GenerationConfig

    from tpkv.models.hf_attach import max_new_tokens

    model = tiny_llama()
    model.generation_config = GenerationConfig(max_length=30)
    assert max_new_tokens(model, 12, {"max_new_tokens": 5, "max_length": 40}) == 5
    assert max_new_tokens(model, 12, {"max_length": 40}) == 28
    assert max_new_tokens(model, 12, {}) == 18
    assert max_new_tokens(model, 40, {}) == 0
    cfg = GenerationConfig(max_new_tokens=7)
    assert max_new_tokens(model, 12, {"generation_config": cfg}) == 7
    model.generation_config = GenerationConfig(max_new_tokens=3)
    assert max_new_tokens(model, 12, {}) == 3
