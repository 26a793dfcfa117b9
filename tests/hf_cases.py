"""Shared by the transformers cache tests: a tiny seeded Llama, multi-turn chats, references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

BT = 4  # tokens per block
VOCAB = 128
SESSIONS, TURNS = 4, 3
L1_BLOCKS, L2_BLOCKS = 16, 20  # per rank; the 4 sessions end with about 50 blocks, L2 holds
# more than the largest session (a resume from L3 passes through L2 whole)
Tokens = dict[str, list[list[int]]]  # session -> new tokens of each turn
Losses = dict[tuple[str, int], int]  # (session, turn) -> first token the tiers lost


def tiny_llama(kv_heads: int = 2, heads: int = 4, layers: int = 2, seed: int = 0,
               hidden: int = 64) -> Any:
    """A Llama-architecture model from a config, seeded random weights, fp32, no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def chat(generate: Callable[[str, int, torch.Tensor, int], torch.Tensor],
         seed: int = 0) -> Tokens:
    """Turns round robin over the sessions: between two turns of a session the three others
    run, so small tiers must move it down (L2, then L3) and back. Each turn feeds the whole
    conversation (as with DynamicCache); generate(session, turn, ids, max_new) -> all ids."""
    rng = np.random.default_rng(seed)
    history: dict[str, torch.Tensor] = {}
    out: Tokens = {}
    for turn in range(TURNS):
        for i in range(SESSIONS):
            s = f"s{i}"
            n = int(rng.integers(12, 21)) if turn == 0 else int(rng.integers(3, 9))
            user = torch.as_tensor(rng.integers(0, VOCAB, (1, n)), dtype=torch.long)
            ids = user if turn == 0 else torch.cat([history[s], user], dim=1)
            full = generate(s, turn, ids, int(rng.integers(4, 7)))
            assert torch.equal(full[:, :ids.shape[1]], ids)
            out.setdefault(s, []).append(full[0, ids.shape[1]:].tolist())
            history[s] = full
    return out


def dynamic_reference(model: Any, losses: Losses | None = None) -> tuple[Tokens, dict[str, Any]]:
    """The chat with one DynamicCache a session. Where the tiered run lost K/V (losses), the
    cache is cropped to the same token first, so the model feeds the same tokens again in the
    same forward shapes as the tiered run did."""
    from transformers import DynamicCache

    from tpkv.models.hf_attach import cache_kwarg

    caches: dict[str, Any] = {}

    def generate(s: str, turn: int, ids: torch.Tensor, max_new: int) -> torch.Tensor:
        cache = caches.setdefault(s, DynamicCache())
        first = (losses or {}).get((s, turn))
        if first is not None:
            cache.crop(first - cache.get_seq_length())
        return model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=max_new,
                              do_sample=False)

    with torch.no_grad():
        return chat(generate), caches


def tiered_chat(model: Any, tiers: Any) -> tuple[Tokens, Losses]:
    """The chat through HfTiers.generate; which (session, turn) lost K/V, from which token."""
    losses: Losses = {}

    def generate(s: str, turn: int, ids: torch.Tensor, max_new: int) -> torch.Tensor:
        seen = len(tiers.stats.losses)
        out = tiers.generate(s, ids, max_new_tokens=max_new, do_sample=False)
        for session, first in tiers.stats.losses[seen:]:
            assert session == s
            losses[(s, turn)] = min(first, losses.get((s, turn), first))
        return out

    with torch.no_grad():
        return chat(generate), losses


def same_kv(tiers: Any, caches: dict[str, Any]) -> int:
    """Every session's K/V read back from the tiers equals its DynamicCache's, bit for bit;
    returns the number of tensors compared."""
    n = 0
    for s, ref in caches.items():
        got = tiers.cache(s).read_kv()
        assert len(got) == len(ref.layers)
        for layer, (k, v) in enumerate(got):
            assert torch.equal(k, ref.layers[layer].keys), f"{s} layer {layer} keys differ"
            assert torch.equal(v, ref.layers[layer].values), f"{s} layer {layer} values differ"
            n += 2
    return n
