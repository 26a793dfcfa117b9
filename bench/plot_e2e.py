"""Plot bench/results/e2e.json as a PNG and print its BENCHMARKS.md table.

    python bench/plot_e2e.py [bench/results/e2e.json] [bench/results/e2e.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("a", "b", "b2", "c", "c2", "c3", "d")
SOURCES = ("l2", "l3", "recompute")


def plot(result: dict, out: Path) -> None:
    cfgs = {k: v for k, v in result["configs"].items() if k in ORDER}
    keys = [k for k in ORDER if k in cfgs]
    names = [f"({k}) {cfgs[k]['label']}" for k in keys]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    ax.bar(names, [cfgs[k]["sessions_held"] for k in keys], color="tab:blue")
    ax.set_title(f"sessions held (of {cfgs[keys[0]]['sessions']}), same L1")
    ax = axes[1]
    ax.bar(names, [cfgs[k]["decode_tokens_per_s"] or 0 for k in keys], color="tab:green")
    ax.set_title("generated tokens/s over the turn rounds")
    ax = axes[2]
    width = 0.25
    for i, src in enumerate(SOURCES):
        vals = [cfgs[k].get(f"resume_ms_p50_{src}") or 0 for k in keys if k != "d"]
        ax.bar([j + i * width for j in range(len(vals))], vals, width, label=f"from {src}")
    for i, src in enumerate(("l2", "l3")):  # the ceiling of the first config with such resumes
        at = next((k for k in ("e", *keys) if result["configs"].get(k, {}).get(
            f"ceiling_ms_p50_{src}")), None)
        if at is not None:
            ax.axhline(result["configs"][at][f"ceiling_ms_p50_{src}"], ls="--", lw=1,
                       color=f"C{i}", label=f"ceiling {src} ({'c' if at == 'e' else at})")
    ax.set_xticks([j + width for j in range(len([k for k in keys if k != "d"]))],
                  [n for k, n in zip(keys, names) if k != "d"])
    ax.set_ylabel("ms")
    ax.set_title("resume p50 by source tier")
    ax.legend(fontsize=8)
    for a in axes:
        a.tick_params(axis="x", labelsize=7, rotation=12)
    fig.suptitle(f"tpkv end to end on {result['device']} ({result['date']}): "
                 f"{result['command']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _order(cfgs: dict) -> list[str]:
    """The configurations in ORDER, each followed by its emulated-L3 runs ('c2-em14')."""
    out = []
    for k in ORDER:
        out += [k] if k in cfgs else []
        out += sorted((e for e in cfgs if e.startswith(f"{k}-em")),
                      key=lambda e: float(e.split("-em")[1]))
    return out


def _f(x: object, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(result: dict) -> str:
    cfgs, ratios = result["configs"], result["ratios"]
    lines = ["| config | sessions held | failures | gen tok/s | step p50 / p99 ms | "
             "resume p50 / p99 ms by source | resume / ceiling (p50) | "
             "returning TTFT p50 / p99 ms | vs bound (limited by) |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = _order(cfgs)
    for k in order:
        c = cfgs[k]
        res = ", ".join(f"{s}: {_f(c.get(f'resume_ms_p50_{s}'))} / "
                        f"{_f(c.get(f'resume_ms_p99_{s}'))}"
                        for s in SOURCES if c.get(f"resume_ms_p50_{s}") is not None)
        if k == "d":
            res = f"turn TTFT: {_f(c.get('resume_ms_p50'))} / {_f(c.get('resume_ms_p99'))}"
        vs = ", ".join(f"{s}: {v:.2f}" for s, v in c.get("resume_vs_ceiling", {}).items())
        b = c.get("bound") or {}
        bound = (f"{_f(b.get('throughput_vs_bound'), 2)} ({b['limited_by'].removesuffix('_s')})"
                 if b else "-")
        lines.append(f"| ({k}) {c['label']} | {c['sessions_held']} of {c['sessions']} | "
                     f"{c['oom_or_failures']} | {_f(c['decode_tokens_per_s'])} | "
                     f"{_f(c['step_ms_p50'])} / {_f(c['step_ms_p99'])} | {res} | {vs or '-'} | "
                     f"{_f(c.get('returning_ttft_ms_p50'))} / "
                     f"{_f(c.get('returning_ttft_ms_p99'))} | {bound} |")
    lines.append("")
    cols = [k for k in order if k in ratios]
    lines.append("| ratio | " + " | ".join(f"({k})" for k in cols) + " | goal |")
    lines.append("|---|" + "---|" * (len(cols) + 1))
    for name, goal in (("sessions_held_vs_a", ">= 16"), ("decode_tokens_per_s_vs_a", ">= 2.5"),
                       ("throughput_vs_bound", ">= 0.85"),
                       ("returning_ttft_p50_vs_a", "-"), ("returning_ttft_p99_vs_a", "-"),
                       ("step_p99_traffic_vs_quiet_p50", "<= 1.10"),
                       ("step_traffic_vs_quiet_p50", "-"),
                       ("step_traffic_vs_matched_quiet_p50", "<= 1.05"),
                       ("resume_l2_vs_ceiling_p50", "<= 1.15"),
                       ("resume_l3_vs_ceiling_p50", "<= 1.15")):
        vals = [_f(ratios[k].get(name), 2) for k in cols]
        lines.append(f"| {name} | " + " | ".join(vals) + f" | {goal} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", nargs="?", default="bench/results/e2e.json", type=Path,
                    help="an e2e result (default: %(default)s)")
    ap.add_argument("out", nargs="?", type=Path, help="the PNG (default: src with .png)")
    args = ap.parse_args()
    try:
        result = json.loads(args.src.read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"cannot read an e2e result from {args.src}: {exc}")
    if "configs" not in result:
        ap.error(f"{args.src} has no 'configs': not a bench/e2e.py result")
    plot(result, args.out or args.src.with_suffix(".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
