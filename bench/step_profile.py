"""Where a step of the e2e engine goes: forward of a turn's prompt after a long context, and of a
decode step, per attention implementation, timed with CUDA events (no tiers involved).

    python bench/step_profile.py [--model 1b] [--context 12288] [--batch 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tpkv.models.engine import PagedEngine  # noqa: E402
from tpkv.models.llama import build_model  # noqa: E402
from tpkv.models.paged import paged_attention_ref, paged_attention_sdpa  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> float:
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(out))


def profile(fn) -> dict:
    """Self CPU and device time of one call of fn, and its six costliest device ops."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync()
    events = prof.key_averages()
    dev = [(e.key[:60], getattr(e, "self_device_time_total", 0) / 1e3) for e in events]
    return {"self_cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
            "self_device_ms": round(sum(t for _, t in dev), 2),
            "top_device": [[k, round(t, 3)] for k, t in sorted(dev, key=lambda x: -x[1])[:6]]}


def decode_fn(eng: PagedEngine, tables: list[np.ndarray], context: int):
    """One decode step of sessions s0.. (each `context` tokens cached) that forgets its token
    after: the same step every call."""
    def decode() -> None:
        for i in range(len(tables)):
            s = eng.seqs[f"s{i}"]
            del s.token_ids[context + 1:]
            s.num_cached = context
            if len(s.token_ids) == context:
                s.token_ids.append(1)
        eng.decode_step([(f"s{i}", tables[i]) for i in range(len(tables))])
    return decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1b")
    ap.add_argument("--context", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = ap.parse_args()
    model = build_model(args.model, seed=0, device=args.device)
    bt = 16
    per = -(-(args.context + args.turn + 64) // bt)
    g = model.kv_geometry(block_tokens=bt)
    pool = torch.zeros((per * args.batch + 8, g.num_layers, 2, bt, g.num_kv_heads, g.head_dim),
                       dtype=model.config.torch_dtype, device=args.device)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    rows = {}
    variants = (("sdpa+graphs", paged_attention_sdpa, True), ("sdpa", paged_attention_sdpa, False),
                ("ref", paged_attention_ref, False))
    for name, impl, graphs in variants:
        eng = PagedEngine(model, pool, attention=impl, cuda_graphs=graphs and args.device != "cpu")
        tables = [np.arange(i * per, (i + 1) * per) for i in range(args.batch)]
        for i in range(args.batch):
            eng.seqs.pop(f"s{i}", None)
            eng.prefill(f"s{i}", rng.integers(0, vocab, args.context).tolist(), tables[i])
            eng.seqs[f"s{i}"].num_cached = args.context
        sync()
        seq = eng.seqs["s0"]

        def turn(eng: PagedEngine = eng, seq=seq, tables=tables) -> None:
            """The turn's new tokens after the context, then forget them."""
            del seq.token_ids[args.context:]
            seq.num_cached = args.context
            eng.prefill("s0", rng.integers(0, vocab, args.turn).tolist(), tables[0])

        decode = decode_fn(eng, tables, args.context)

        rows[name] = {"turn_prefill_ms": round(timed(turn), 2),
                      "decode_step_ms": round(timed(decode), 2)}
        # again once decode graphs exist: eager work after a capture must not slow down
        rows[name]["turn_prefill_after_decode_ms"] = round(timed(turn), 2)
        print(name, rows[name], flush=True)
        if torch.cuda.is_available():
            for what, fn in (("decode", decode), ("turn", turn)):
                rows[name][f"{what}_profile"] = profile(fn)
    out = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "setting": f"{args.model}, {args.batch} sessions of {args.context} tokens, turn of "
                      f"{args.turn} tokens; medians of 5, host-timed with a device sync",
           "rows": rows}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
