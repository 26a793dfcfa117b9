"""The vLLM connector's worker side alone: a step's saves and loads between a KV cache laid out as
vLLM's (one tensor a layer, the block index first) and the store's host slots, without vLLM.

Modes, each timed over `--reps` repetitions of `--blocks` blocks (the median kept):
- save: BlockCopier.save, vLLM's wait_for_save;
- load: a load in the step, whole (BlockCopier.load, no layer order);
- load by layer: the same, layer by layer, each layer waited for as the forward would;
- background: a background load until the copier names the request finished.
Each is held against the ceiling measured in the same run on the same bytes: one contiguous
copy between a pinned host buffer and the device, each way, on a GPU; one host memcpy on the
CPU. Every load is checked bit-exact against the blocks saved.

    python bench/vllm_copy.py [--layers 32] [--page-kib 64] [--blocks 128] [--reps 5]
        [--out bench/results/vllm_copy_cuda.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tpkv.integrations.prefix_index import chain_seed, extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.plan import LoadSpec, SaveSpec

BT = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of fn over reps (after one untimed run)."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(nbytes: int, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds of one contiguous copy of nbytes: D2H and H2D (pinned) on a GPU, memcpy on the
    CPU (both directions the same)."""
    if device.type != "cuda":
        a, b = np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        s = timed(lambda: np.copyto(a, b), device, reps)
        return {"d2h": s, "h2d": s}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    return {"d2h": timed(lambda: host.copy_(dev, non_blocking=True), device, reps),
            "h2d": timed(lambda: dev.copy_(host, non_blocking=True), device, reps)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu"
                          else "cpu")
    page = args.page_kib << 10
    num_blocks = 3 * args.blocks + 1  # saved from the first third, loaded into the others
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    g = torch.Generator().manual_seed(0)
    caches = {n: torch.randint(0, 256, (num_blocks, page), generator=g, dtype=torch.uint8)
              .to(device) for n in names}
    block_bytes = args.layers * page
    copier = BlockCopier(2 * args.blocks * block_bytes)
    copier.register(caches, num_blocks)
    store = copier.store
    assert store is not None
    seed = chain_seed("bench-vllm-copy", BT)
    tokens = list(range(args.blocks * BT))
    keys = extend_chain([], tokens, BT, seed)
    saves = [SaveSpec("w", i, key, keys[i - 1] if i else seed,
                      tuple(tokens[i * BT:(i + 1) * BT])) for i, key in enumerate(keys)]
    src = list(range(args.blocks))

    def save() -> None:
        copier.drop(keys)
        copier.save(saves)
        report = copier.take_report()
        assert report is not None and len(report.saved) == args.blocks, "a save failed"

    def dst(k: int) -> list[int]:
        return list(range(args.blocks * k, args.blocks * (k + 1)))

    def check(block_ids: list[int]) -> None:
        for n in (names[0], names[-1]):
            assert torch.equal(caches[n][block_ids], caches[n][src]), "a load is not exact"

    def load(layered: bool) -> None:
        copier.load([LoadSpec("r", 0, dst(1), keys)], names if layered else None)
        if layered:
            for n in names:
                copier.wait_layer(n)
        assert copier.finish_layer_loads() and not copier.take_failed_block_ids()

    def background() -> None:
        copier.load([LoadSpec("b", 0, dst(2), keys, background=True)])
        while not copier.take_finished():
            time.sleep(0.0002)
        assert not copier.take_failed_block_ids()

    nbytes = args.blocks * block_bytes
    ceiling = ceilings(nbytes, device, args.reps)
    out: dict[str, Any] = {}
    for mode, fn, way in (("save", save, "d2h"), ("load", lambda: load(False), "h2d"),
                          ("load by layer", lambda: load(True), "h2d"),
                          ("background", background, "h2d")):
        s = timed(fn, device, args.reps)
        out[mode] = {"ms": s * 1e3, "gb_s": nbytes / s / 1e9,
                     "ceiling_gb_s": nbytes / ceiling[way] / 1e9, "ratio": ceiling[way] / s}
        print(f"{mode:14s} {s * 1e3:8.2f} ms {nbytes / s / 1e9:7.2f} GB/s, ceiling "
              f"{nbytes / ceiling[way] / 1e9:7.2f} GB/s ({way}): {ceiling[way] / s:.2f}")
    check(dst(1))
    check(dst(2))
    pinned = store.slots.pinned_for(list(range(store.slots.num_slots)))
    copier.close()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "layers": args.layers, "page_bytes": page, "blocks": args.blocks,
            "block_bytes": block_bytes, "reps": args.reps, "slots_pinned": pinned,
            "by_address": copier.rows.batched if copier.rows else None, "modes": out,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python bench/vllm_copy.py " + " ".join(args.argv)}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    got = [result["modes"][m]["gb_s"] for m in modes]
    ceil = [result["modes"][m]["ceiling_gb_s"] for m in modes]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(modes))
    ax.bar(x - 0.2, got, 0.4, label="connector")
    ax.bar(x + 0.2, ceil, 0.4, label="one contiguous copy (ceiling)", color="tab:gray")
    ax.set_xticks(x, modes)
    ax.set_ylabel("GB/s")
    ax.set_title(f"vLLM connector copies, {result['blocks']} blocks of "
                 f"{result['block_bytes'] >> 20} MiB, {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64, help="KiB a layer of a block")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("auto", "cpu"), default="auto")
    ap.add_argument("--out", default=None, help="JSON here (and a PNG beside it)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, args.out.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()

