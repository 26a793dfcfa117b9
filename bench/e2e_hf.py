"""bench/e2e.py's peer (d): transformers' LlamaForCausalLM of the same shapes with its offloaded
DynamicCache, one cache per session (it has no paged batching), on the same sessions and rounds."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from bench.e2e_emulate import model_config


def hf_model(name: str, device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model_config(name)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      head_dim=c.head_dim, rope_theta=c.rope_theta,
                      tie_word_embeddings=c.tie_embeddings, max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, c.dtype)).eval()
    return model


def run_hf(sizes: Any, contexts: list[int], device: torch.device) -> dict[str, Any]:
    from transformers import DynamicCache

    t_start = time.perf_counter()
    model = hf_model(sizes.model, device)
    vocab = model.config.vocab_size
    offload = device.type == "cuda"  # the offloaded cache needs CUDA streams
    names = [f"s{i}" for i in range(len(contexts))]
    caches: dict[str, Any] = {}
    last: dict[str, int] = {}
    rng = np.random.default_rng(sizes.seed + 1)
    steps: list[float] = []
    ttft: list[float] = []
    failures: list[str] = []
    gen_tokens, t_turns, turns, capped = 0, 0.0, 0, False

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def forward(session: str, ids: list[int]) -> int:
        out = model(input_ids=torch.tensor([ids], device=device), past_key_values=caches[session],
                    use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    for rnd in range(sizes.rounds):
        t0 = time.perf_counter()
        for i in rng.permutation(len(names)).tolist():
            s = names[i]
            n = contexts[i] if rnd == 0 else sizes.user_tokens
            prompt = rng.integers(0, vocab, n).tolist()  # the same draws as the tpkv runs
            if capped:
                continue
            try:
                if rnd == 0:
                    caches[s] = DynamicCache(offloading=offload)
                sync()
                t1 = time.perf_counter()
                prev = [last[s]] if s in last else []  # the last token of the previous turn
                tok = forward(s, prev + prompt)
                sync()
                ttft.append((time.perf_counter() - t1) * 1e3)
                for _ in range((sizes.gen_tokens if rnd else 1) - 1):
                    t1 = time.perf_counter()
                    tok = forward(s, [tok])
                    sync()
                    steps.append((time.perf_counter() - t1) * 1e3)
                last[s] = tok
                turns += 1
                gen_tokens += sizes.gen_tokens if rnd else 0
            except torch.OutOfMemoryError as exc:
                failures.append(f"round {rnd} {s}: OutOfMemoryError: {exc}"[:300])
                caches.pop(s, None)
            if time.perf_counter() - t_start > sizes.hf_seconds:
                capped = True
        if rnd:
            t_turns += time.perf_counter() - t0
        print(f"  round {rnd}: {time.perf_counter() - t0:.1f} s, {turns} turns", flush=True)
    resumed = ttft[len(contexts):]  # turns after the fill round
    held = sum(1 for c in caches.values() if c.get_seq_length() > 0)
    out = {"label": "transformers DynamicCache(offloading=True)", "sessions": len(contexts),
           "sessions_held": held, "oom_or_failures": len(failures), "failures": failures,
           "turns_done": turns, "capped_at_s": sizes.hf_seconds if capped else None,
           "decode_tokens_per_s": round(gen_tokens / t_turns, 1) if t_turns else None,
           "step_ms_p50": _pct(steps, 50), "step_ms_p99": _pct(steps, 99),
           "resume_ms_p50": _pct(resumed, 50), "resume_ms_p99": _pct(resumed, 99),
           "note": "resume = time to first token of a returning turn (its cache streams "
                   "from host memory layer by layer); batch size 1",
           "wall_s": round(time.perf_counter() - t_start, 1)}
    caches.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None
