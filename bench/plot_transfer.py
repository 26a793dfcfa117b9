"""Plot bench/results/transfer.json as a PNG: GB/s per copy method beside the same run's ceiling.

    python bench/plot_transfer.py [bench/results/transfer.json] [bench/results/transfer.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(result: dict, out: Path) -> None:
    rows = [r for r in result["copies"] if r.get("placement", "random") == "random"]
    geoms = sorted({r["geometry"] for r in rows})
    fig, axes = plt.subplots(1, len(geoms) + 1, figsize=(5 * (len(geoms) + 1), 4.2))
    for ax, geom in zip(axes, geoms):
        sub = [r for r in rows if r["geometry"] == geom]
        dirs = ["h2d", "d2h", "both"]
        methods = [m for m in ("auto", "dma", "kernel", "torch")
                   if any(r["method"] == m for r in sub)]
        width = 0.8 / (len(methods) + 1)
        for i, m in enumerate(methods):
            vals = [next((r["gbps"] for r in sub if r["method"] == m and r["direction"] == d), 0)
                    for d in dirs]
            ax.bar([j + i * width for j in range(3)], vals, width, label=m)
        ceil = [next(r["ceiling_gbps"] for r in sub if r["direction"] == d) for d in dirs]
        ax.bar([j + len(methods) * width for j in range(3)], ceil, width, label="ceiling",
               color="lightgray", edgecolor="black")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(3)], dirs)
        ax.set_title(f"{geom}: {sub[0]['block_bytes'] // 1024} KiB blocks")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    ax = axes[-1]
    ssd = result.get("ssd")
    if ssd:
        ax.bar([0, 1], [ssd["ssd_write_gbps"], ssd["ssd_read_gbps"]], 0.35,
               label=f"SsdStore ({ssd['backend']})")
        ax.bar([0.35, 1.35], [ssd["raw_write_gbps"], ssd["raw_read_gbps"]], 0.35,
               label="raw O_DIRECT", color="lightgray", edgecolor="black")
        ax.set_xticks([0.175, 1.175], ["write", "read"])
        ax.set_title("L2 <-> L3")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"tpkv transfers on {result['device']} ({result['date'][:10]})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def markdown(result: dict) -> str:
    """The README's table: the auto method per geometry and direction, then L2 <-> L3."""
    lines = ["| blocks | direction | method | GB/s | ceiling GB/s | ratio |",
             "|---|---|---|---|---|---|"]
    for r in result["copies"]:
        if r["method"] == "auto":
            lines.append(f"| {r['block_bytes'] // 1024} KiB ({r['geometry']}), "
                         f"{r.get('placement', 'random')} "
                         f"| {r['direction']} | {r['method_used']} | {r['gbps']} "
                         f"| {r['ceiling_gbps']} | {r['ratio']} |")
    ssd = result.get("ssd")
    if ssd:
        for op in ("write", "read"):
            lines.append(f"| L2 <-> L3, 2 MiB | {op} | {ssd['backend']} | {ssd[f'ssd_{op}_gbps']} "
                         f"| {ssd[f'raw_{op}_gbps']} (raw O_DIRECT) | {ssd[f'{op}_ratio']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/transfer.json")
    dst = Path(sys.argv[2] if len(sys.argv) > 2 else src.with_suffix(".png"))
    result = json.loads(src.read_text())
    plot(result, dst)
    print(f"wrote {dst}")
    print(markdown(result))
