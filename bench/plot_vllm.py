"""Plot bench/results/vllm.json as a PNG and print its BENCHMARKS.md table.

    python bench/plot_vllm.py [bench/results/vllm.json] [bench/results/vllm.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "vllm": "vLLM alone",
    "vllm_all_fit": "vLLM, cache holds all",
    "null_connector": "vLLM + no-op connector",
    "tpkv": "vLLM + tpkv (host)",
    "tpkv_disk": "vLLM + tpkv (host+disk)",
    "vllm_offload": "vLLM offloading",
    "vllm_simple_offload": "vLLM simple offloading",
}


def table(result: dict[str, Any]) -> str:
    rows = ["| variant | KV blocks | prefill computed | vLLM prefix-cache hits "
            "| connector loaded (blocks from disk) | returning TTFT p50 / p99 ms "
            "| decode ms/token | gen tok/s | tokens equal |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in result["results"].items():
        label = LABELS.get(name, name)
        if "error" in r:
            rows.append(f"| {label} | - | did not start: `{r['error']}` | | | | | | |")
            continue
        loaded = f"{r['connector_loaded_tokens']:g}"
        if r.get("disk_loaded_blocks"):
            loaded += f" ({r['disk_loaded_blocks']:g} from disk)"
        rows.append(
            f"| {label} | {r['kv_blocks']:g} | {r['prefill_computed_tokens']:g} of "
            f"{r['prompt_tokens']:g} | {r['prefix_cache_hit_tokens']:g} | {loaded} | "
            f"{_num(r['ttft_ms_p50'])} / {_num(r['ttft_ms_p99'])} | "
            f"{_num(r.get('decode_ms_per_token_p50'))} | {_num(r['gen_tokens_per_s'])} | "
            f"{r.get('tokens_equal', '-')} |")
    return "\n".join(rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def plot(result: dict[str, Any], out: Path) -> None:
    ran = {k: v for k, v in result["results"].items() if "error" not in v}
    names = [LABELS.get(k, k) for k in ran]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
    ax = axes[0]
    parts = (("prefill_computed_tokens", "computed", "tab:red"),
             ("prefix_cache_hit_tokens", "vLLM prefix-cache hit", "tab:blue"),
             ("connector_loaded_tokens", "loaded by the connector", "tab:green"))
    bottom = [0] * len(ran)
    for key, label, color in parts:
        vals = [r[key] for r in ran.values()]
        ax.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("prompt tokens by source (every turn)")
    ax.legend(fontsize=8)
    ax = axes[1]
    width = 0.38
    xs = range(len(ran))
    ax.bar([x - width / 2 for x in xs], [r["ttft_ms_p50"] or 0 for r in ran.values()], width,
           label="p50", color="tab:purple")
    ax.bar([x + width / 2 for x in xs], [r["ttft_ms_p99"] or 0 for r in ran.values()], width,
           label="p99", color="tab:gray")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms")
    ax.set_title("TTFT of returning turns")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(names, [r["gen_tokens_per_s"] or 0 for r in ran.values()], color="tab:olive")
    ax.set_title("generated tokens/s over the run")
    ax = axes[3]
    ax.bar(names, [r.get("decode_ms_per_token_p50") or 0 for r in ran.values()],
           color="tab:brown")
    ax.set_ylabel("ms")
    ax.set_title("decode ms per token, returning turns (p50)")
    for a in axes:
        a.tick_params(axis="x", labelsize=7, rotation=15)
    cfg = result["config"]
    failed = ", ".join(LABELS.get(k, k) for k in result["results"] if k not in ran)
    fig.suptitle(f"vLLM (CPU) multi-turn, {cfg['sessions']} sessions x {cfg['turns']} turns, "
                 f"Llama {cfg['layers']}x{cfg['hidden']} random, medians of "
                 f"{cfg.get('reps', 1)} runs ({result['date']})"
                 + (f"; did not start: {failed}" if failed else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    here = Path(__file__).resolve().parent / "results"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default=str(here / "vllm.json"))
    ap.add_argument("out", nargs="?", default=str(here / "vllm.png"))
    args = ap.parse_args()
    result = json.loads(Path(args.src).read_text())
    plot(result, Path(args.out))
    print(table(result))


if __name__ == "__main__":
    main()
