"""Shared by the transformers cache tests (unit, TP 2 and GPU): a tiny seeded Llama, multi-turn
chats, DynamicCache references, and the TP 1 run through tiny tiers with its checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

BT = 4  # tokens per block
VOCAB = 128
SESSIONS, TURNS = 4, 3
L1_BLOCKS, L2_BLOCKS = 16, 20  # per rank; the 4 sessions end with about 50 blocks, L2 holds
# more than the largest session (a resume from L3 passes through L2 whole)
Tokens = dict[str, list[list[int]]]  # session -> new tokens of each turn
Losses = dict[tuple[str, int], int]  # (session, turn) -> first token the tiers lost


def tiny_llama(kv_heads: int = 2, heads: int = 4, layers: int = 2, seed: int = 0,
               hidden: int = 64, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Any:
    """A Llama-architecture model from a config, seeded random weights (made in fp32 on the
    CPU, then cast and moved: the same weights on every device), no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def chat(generate: Callable[[str, int, torch.Tensor, int], torch.Tensor],
         device: torch.device | str = "cpu", seed: int = 0) -> Tokens:
    """Turns round robin over the sessions: between two turns of a session the three others
    run, so small tiers must move it down (L2, then L3) and back. Each turn feeds the whole
    conversation (as with DynamicCache), on `device`; generate(session, turn, ids, max_new) ->
    all ids."""
    rng = np.random.default_rng(seed)
    history: dict[str, torch.Tensor] = {}
    out: Tokens = {}
    for turn in range(TURNS):
        for i in range(SESSIONS):
            s = f"s{i}"
            n = int(rng.integers(12, 21)) if turn == 0 else int(rng.integers(3, 9))
            user = torch.as_tensor(rng.integers(0, VOCAB, (1, n)), dtype=torch.long,
                                   device=device)
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
        return chat(generate, model.device), caches


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
        return chat(generate, model.device), losses


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


def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 1 in this process: torchrun's variables (from a parent) would make tpkv.init join a
    process group."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def tiers_config(model: Any, l1: int, l2: int, ssd_root: str | None) -> dict[str, Any]:
    """Tier sizes in blocks; loads always beat recomputes (a slow prefill rate). L3 through the
    POSIX backend, buffered (a tmp directory may not take O_DIRECT; "auto" could pick kvikio
    on a GPU machine with GPUDirect Storage). Spills unpaced: paced, a loaded machine's disk
    (as the tiny blocks measure it) has L2 blocks dropped, not spilled, and their tokens
    lost, where these tests check that every resume loads."""
    from tpkv.config import HbmConfig, HostConfig, PolicyConfig, SsdConfig
    from tpkv.models.hf_attach import model_geometry

    block_bytes = model_geometry(model, block_tokens=BT).block_bytes
    l3 = (SsdConfig(root=ssd_root, budget_bytes=4096 * block_bytes, backend="posix",
                    o_direct=False, io_threads=2) if ssd_root else SsdConfig())
    return {"l1": HbmConfig(num_blocks=l1),
            "l2": HostConfig(budget_bytes=l2 * block_bytes, arena_bytes=l2 * block_bytes),
            "l3": l3, "policy": PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0,
                                             spill_pacing=False)}


def run_tiered(model: Any, l1: int, l2: int, ssd_root: str | None,
               miss: bool = False, controller: str = "local") -> dict[str, Any]:
    """The chat through tpkv.attach at TP 1 on the model's device (L1 there; L2 pinned when
    CUDA is present), then the DynamicCache chat on the same model, and every session's K/V
    of both compared. miss: the first L3 read fails its checks. controller: as tpkv.attach
    takes it."""
    import tpkv

    with tpkv.attach(model, tiers_config(model, l1, l2, ssd_root), block_tokens=BT,
                     controller=controller, device=model.device) as tiers:
        if miss:
            tiers.rt.worker.fault_miss_from = 1
        got, losses = tiered_chat(model, tiers)
        want, caches = dynamic_reference(model, losses)
        return {"got": got, "want": want, "losses": losses, "stats": tiers.stats,
                "resumed": {s: list(c.resumed_from) for s, c in tiers.caches.items()},
                "kv_checked": same_kv(tiers, caches), "mismatches": tiers.rt.num_mismatches,
                "l1_device": str(tiers.rt.worker.hbm.tensor.device),
                "l2_pinned": tiers.rt.worker.host.pinned,
                "l2_pinned_bytes": tiers.rt.worker.host.pinned_bytes,
                "l2_bytes": tiers.rt.worker.host.total_bytes}


def check_through_l2_and_l3(out: dict[str, Any], num_layers: int) -> None:
    """run_tiered on tiny tiers: DynamicCache's tokens and K/V, sessions moved down to L2 and
    L3 and resumed from each, all by loads (nothing recomputed, no retry)."""
    assert sum(len(t) for t in out["want"].values()) == SESSIONS * TURNS
    assert out["got"] == out["want"]
    assert out["kv_checked"] == SESSIONS * 2 * num_layers
    moves, resumed = out["stats"].moves, out["resumed"]
    assert moves["l1_l2"] > 0 and moves["l2_l3"] > 0, moves  # demoted, then spilled
    assert moves["l3_l2"] > 0 and moves["l2_l1"] > 0, moves  # and loaded back
    tiers_seen = {t for ts in resumed.values() for t in ts}
    assert {"l2", "l3"} <= tiers_seen, resumed  # some turn resumed from each tier
    assert out["losses"] == {} and out["stats"].lost_tokens == 0  # loads, no recompute
    assert out["mismatches"] == 0 and out["stats"].retries == 0


def check_l3_miss_refed(out: dict[str, Any], num_layers: int) -> None:
    """run_tiered with miss=True: the miss hit a session's resume, the turn ran again and fed
    the lost tokens again; DynamicCache, cropped at the same tokens, runs the same forward
    shapes, so tokens and K/V are equal too."""
    assert out["losses"], "no L3 read missed"
    assert out["stats"].retries >= 1 and out["stats"].lost_tokens > 0
    assert out["got"] == out["want"]
    assert out["kv_checked"] == SESSIONS * 2 * num_layers
    assert out["mismatches"] == 0


CHAT_WORDS = ("[UNK]", "user", "assistant", ":", "Hello", "And", "then", "?")


def save_tiny_chat_model(path: str, kv_heads: int = 2) -> str:
    """A tiny seeded Llama with a word-level tokenizer and a chat template, saved with
    save_pretrained: what a README example loads with from_pretrained(path) (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = models.WordLevel(vocab={w: i for i, w in enumerate(CHAT_WORDS)}, unk_token="[UNK]")
    raw = Tokenizer(words)
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(path)
    tiny_llama(kv_heads=kv_heads).save_pretrained(path)
    return path
