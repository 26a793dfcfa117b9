"""Per later turn of `model.generate`: TpkvCache (L1 holds about 2 sessions, so each turn resumes
from L2) against DynamicCache on the device and DynamicCache(offloading=True), on a random Llama.

Sessions of `--context` tokens are visited in turn (a fill round), then `--turns` more rounds of
`--user` new and `--gen` generated tokens each (TpkvCache's through HfTiers.generate, the others'
through model.generate). Per later turn: wall time (p50), process CPU time (p50: all threads;
steadier than wall time on a shared CPU), time to first token, per decode step (p50), tokens
equal to DynamicCache's, L2 -> L1 bytes resumed and their
time at `--pcie-gbps`; for TpkvCache, the host time of each pass's step (`rt.run_step`: the
controller's plans, applied and confirmed; p50 over the later turns' passes) and how many steps
were planned ahead and then used or left unused. Goal: TpkvCache <= 1.05 x (DynamicCache + PCIe
time of its resume).

    python bench/hf.py --device cpu                      # bench/results/hf_cpu.json
    python bench/hf.py --device cuda --model 1b --context 8192 --gen 32 --user 64
    python bench/hf.py --device cpu --profile tpkv       # cProfile of TpkvCache's later turns
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

VARIANTS = ("dynamic", "tpkv", "offload")


def build(args: argparse.Namespace, device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model == "small":
        cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=
                          2 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=
                          args.heads, num_key_value_heads=args.kv_heads,
                          max_position_embeddings=1 << 16, bos_token_id=None, eos_token_id=None,
                          pad_token_id=None)
        dtype = torch.float32
    else:
        from tpkv.models.llama import ModelConfig

        c = ModelConfig.preset(args.model)
        cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                          intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                          num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                          head_dim=c.head_dim, rope_theta=c.rope_theta,
                          tie_word_embeddings=c.tie_embeddings, max_position_embeddings=1 << 17,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
        dtype = getattr(torch, args.dtype or c.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """A logits processor that notes the time after each forward pass (after a device sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.marks = device, []  # type: list[float]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.marks.append(time.perf_counter())
        return scores


def run_variant(name: str, model: Any, args: argparse.Namespace, device: torch.device,
                profiler: cProfile.Profile | None) -> dict[str, Any]:
    """The chat with one cache kind; timings of the later turns and the tokens generated."""
    from transformers import DynamicCache, LogitsProcessorList

    import tpkv
    from tpkv.config import HbmConfig, HostConfig, PolicyConfig
    from tpkv.models.hf_attach import cache_kwarg, model_geometry

    kw = cache_kwarg(model)
    total = args.context + args.turns * (args.user + args.gen) + 1
    g = model_geometry(model, block_tokens=args.block_tokens)
    per_session = -(-total // g.block_tokens)
    tiers = None
    if name == "tpkv":
        l2 = (args.sessions + 1) * per_session * g.block_bytes
        cfg = {"l1": HbmConfig(num_blocks=int(args.l1_sessions * per_session)),
               "l2": HostConfig(budget_bytes=l2, arena_bytes=l2),
               "policy": PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0)}
        tiers = tpkv.attach(model, cfg, block_tokens=args.block_tokens, controller="local",
                            device=device, model_fingerprint="bench-hf")
    caches: dict[int, Any] = {}
    step_s: list[float] = []  # host seconds of each rt.run_step in the later turns
    ahead = [0, 0]  # steps planned ahead, used and unused, in the later turns
    if tiers is not None:
        rt, run_step = tiers.rt, tiers.rt.run_step

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return run_step(*a, **kw)
            finally:
                if timing:
                    step_s.append(time.perf_counter() - t)

        rt.run_step = timed
    timing = False

    def cache(i: int) -> Any:
        if i not in caches:
            caches[i] = (tiers.cache(f"s{i}") if tiers is not None
                         else DynamicCache(offloading=name == "offload"))
        return caches[i]

    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    history: dict[int, torch.Tensor] = {}
    tokens: list[list[int]] = []
    turn_ms, cpu_ms, ttft_ms, step_ms, resumed_bytes = [], [], [], [], []
    try:
        with torch.inference_mode():
            for rnd in range(args.turns + 1):
                for i in range(args.sessions):
                    n = args.context if rnd == 0 else args.user
                    user = torch.as_tensor(rng.integers(0, vocab, (1, n)), device=device)
                    ids = user if rnd == 0 else torch.cat([history[i], user], dim=1)
                    clock = StepClock(device)
                    moved = tiers.stats.moves["l2_l1"] if tiers is not None else 0
                    if profiler is not None and rnd:
                        profiler.enable()
                    timing = rnd > 0
                    if tiers is not None and rnd == 1 and i == 0:
                        ahead = [-tiers.rt.num_ahead_used, -tiers.rt.num_ahead_unused]
                    gen_kw = {"do_sample": False, "max_new_tokens": 1 if rnd == 0 else args.gen,
                              "logits_processor": LogitsProcessorList([clock])}
                    sync(device)
                    c0, t0 = time.process_time(), time.perf_counter()
                    if tiers is not None:
                        out = tiers.generate(cache(i), ids, **gen_kw)
                    else:
                        out = model.generate(ids, **{kw: cache(i)}, **gen_kw)
                    sync(device)
                    c1, t1 = time.process_time(), time.perf_counter()
                    if profiler is not None and rnd:
                        profiler.disable()
                    history[i] = out
                    tokens.append(out[0, ids.shape[1]:].tolist())
                    if rnd:
                        turn_ms.append((t1 - t0) * 1e3)
                        cpu_ms.append((c1 - c0) * 1e3)
                        ttft_ms.append((clock.marks[0] - t0) * 1e3)
                        step_ms.extend(np.diff(clock.marks) * 1e3)
                        if tiers is not None:
                            blocks = tiers.stats.moves["l2_l1"] - moved
                            resumed_bytes.append(blocks * g.block_bytes)
        if tiers is not None:
            ahead = [ahead[0] + tiers.rt.num_ahead_used, ahead[1] + tiers.rt.num_ahead_unused]
    except Exception as exc:  # offloading=True needs CUDA streams on some versions
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        if tiers is not None:
            tiers.close()
    res: dict[str, Any] = {"turn_ms_p50": _p50(turn_ms), "turn_cpu_ms_p50": _p50(cpu_ms),
                           "ttft_ms_p50": _p50(ttft_ms),
                           "decode_step_ms_p50": _p50(step_ms), "turns_timed": len(turn_ms),
                           "tokens": tokens}
    if tiers is not None:
        mean_bytes = float(np.mean(resumed_bytes)) if resumed_bytes else 0.0
        res["resumed_bytes_per_turn"] = int(mean_bytes)
        res["turns_resumed_from_l2"] = sum(1 for b in resumed_bytes if b)
        res["pcie_ms_per_turn"] = round(mean_bytes / (args.pcie_gbps * 1e9) * 1e3, 3)
        res["step_ms_p50"] = _p50([t * 1e3 for t in step_s])
        res["step_ms_mean"] = round(float(np.mean(step_s)) * 1e3, 4) if step_s else None
        res["steps_timed"] = len(step_s)
        res["ahead_used"], res["ahead_unused"] = ahead
    return res


def _p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="small", help="small, or a ModelConfig preset (1b)")
    ap.add_argument("--dtype", default=None, help="for a preset (its own by default)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--l1-sessions", type=float, default=2.2, help="L1 size, in sessions")
    ap.add_argument("--pcie-gbps", type=float, default=50.0, help="L2 -> L1 GB/s (H200: ~50)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each variant (median)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--profile", default=None, help="a variant to cProfile (later turns)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    model = build(args, device)
    variants = [v for v in args.variants.split(",") if v]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for v in variants:
            prof = cProfile.Profile() if args.profile == v and rep == 0 else None
            r = run_variant(v, model, args, device, prof)
            runs[v].append(r)
            print(f"rep {rep} {v}: " + ", ".join(f"{k}={r[k]}" for k in r if k != "tokens"),
                  flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    out: dict[str, Any] = {"command": " ".join(sys.argv), "device": str(device),
                           "args": {k: v for k, v in vars(args).items() if k != "out"},
                           "torch": torch.__version__}
    ref = runs.get("dynamic", [{}])[0].get("tokens")
    for v, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out[v] = {"error": rs[0]["error"]}
            continue
        out[v] = {k: _p50([r[k] for r in ok]) for k in ok[0] if k != "tokens"}
        out[v]["runs"] = [{k: r[k] for k in r if k != "tokens"} for r in ok]
        if ref is not None:
            out[v]["tokens_equal_dynamic"] = all(r["tokens"] == ref for r in ok)
    if "dynamic" in out and "tpkv" in out and "error" not in out["tpkv"]:
        dyn, tp = out["dynamic"]["turn_ms_p50"], out["tpkv"]["turn_ms_p50"]
        budget = dyn + out["tpkv"]["pcie_ms_per_turn"]
        out["ratio_tpkv_over_dynamic"] = round(tp / dyn, 3)
        # each run's own ratio (the variants run one after the other in a run): their spread
        # is how noisy the machine was; and the same of CPU time
        out["ratio_runs"] = [round(t["turn_ms_p50"] / d["turn_ms_p50"], 3)
                             for t, d in zip(out["tpkv"]["runs"], out["dynamic"]["runs"])]
        out["ratio_cpu_tpkv_over_dynamic"] = round(out["tpkv"]["turn_cpu_ms_p50"]
                                                   / out["dynamic"]["turn_cpu_ms_p50"], 3)
        out["ratio_tpkv_over_dynamic_plus_pcie"] = round(tp / budget, 3)
        out["goal_met"] = tp <= 1.05 * budget
        print(f"per later turn p50: DynamicCache {dyn:.1f} ms, TpkvCache {tp:.1f} ms "
              f"(x{tp / dyn:.3f}; x{tp / budget:.3f} of DynamicCache + PCIe "
              f"{out['tpkv']['pcie_ms_per_turn']:.1f} ms); runs {out['ratio_runs']}; "
              f"CPU time x{out['ratio_cpu_tpkv_over_dynamic']:.3f}")
    path = Path(args.out or Path(__file__).parent / "results" / f"hf_{device.type}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(out: dict[str, Any], path: Path) -> None:
    """Per later turn and per decode step (p50) of each variant that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v for v in VARIANTS if v in out and "error" not in out[v]]
    labels = {"dynamic": "DynamicCache", "tpkv": "TpkvCache", "offload": "DynamicCache\n(offload)"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in ((axes[0], "turn_ms_p50", "per later turn (ms, p50)"),
                           (axes[1], "decode_step_ms_p50", "per decode step (ms, p50)")):
        vals = [out[v][key] for v in names]
        ax.bar([labels[v] for v in names], vals, color=["#888", "#2a7", "#48c"][:len(names)])
        for i, val in enumerate(vals):
            ax.text(i, val, f"{val:.1f}", ha="center", va="bottom")
        ax.set_title(title)
    if "tpkv" in names and "dynamic" in names:
        goal = 1.05 * (out["dynamic"]["turn_ms_p50"] + out["tpkv"]["pcie_ms_per_turn"])
        axes[0].axhline(goal, ls="--", c="k", lw=1, label="goal: 1.05 x (Dynamic + PCIe)")
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"generate, later turns on {out['device']} ({out['args']['model']}, "
                 f"{out['args']['context']} context tokens, {out['args']['gen']} generated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
