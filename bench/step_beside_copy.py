"""Does a decode step of the e2e engine slow down while tier copies run beside it on the GPU?

The e2e's decode steps with tier traffic (L1 -> L2 demotions of 300-460 MB issued once the
step's forward is launched) took 1.06-1.12x the quiet steps' median. This separates the device
from the host: the same decode step (3 sessions of --context tokens, CUDA graphs), timed with
CUDA events on its stream, alone and with a batch of --blocks 512 KiB blocks copied beside it
by tpkv's CopyEngine (L1 -> L2, L2 -> L1, both), issued just before or just after the step's
launch, as the e2e does.

    python bench/step_beside_copy.py --out bench/results/step_beside_copy.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.resume_copy import GEOMETRY, runs_slots  # noqa: E402
from bench.step_profile import decode_fn  # noqa: E402
from tpkv.config import GiB, HostConfig  # noqa: E402
from tpkv.models.engine import PagedEngine  # noqa: E402
from tpkv.models.llama import build_model  # noqa: E402
from tpkv.models.paged import paged_attention_sdpa  # noqa: E402
from tpkv.workers.copy_engine import CopyEngine  # noqa: E402
from tpkv.workers.pools import HbmPool, HostPool  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--context", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=700, help="blocks each copy batch moves")
    ap.add_argument("--run", type=int, default=33, help="consecutive slots per run")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_beside_copy.py needs a GPU")
    model = build_model(args.model, seed=0, device="cuda")
    bt = 16
    per = -(-(args.context + 64) // bt)
    g = model.kv_geometry(block_tokens=bt)
    pool = torch.zeros((per * args.batch + 8, g.num_layers, 2, bt, g.num_kv_heads, g.head_dim),
                       dtype=model.config.torch_dtype, device="cuda")
    eng = PagedEngine(model, pool, attention=paged_attention_sdpa, cuda_graphs=True)
    rng = np.random.default_rng(0)
    tables = [np.arange(i * per, (i + 1) * per) for i in range(args.batch)]
    for i in range(args.batch):
        eng.prefill(f"s{i}", rng.integers(0, model.config.vocab_size, args.context).tolist(),
                    tables[i])
        eng.seqs[f"s{i}"].num_cached = args.context

    decode = decode_fn(eng, tables, args.context)

    # Tier pools of their own (the copies' bytes do not matter, their traffic does)
    assert g.block_bytes == GEOMETRY.block_bytes, (g.block_bytes, GEOMETRY.block_bytes)
    slots = 4 * args.blocks
    host = HostPool(GEOMETRY, slots, HostConfig(budget_bytes=slots * g.block_bytes,
                                                arena_bytes=GiB))
    host.wait_pinned()  # pinned in the background: time it whole
    hbm = HbmPool(GEOMETRY, slots, "cuda")
    copier = CopyEngine(hbm, host)
    half = slots // 2
    up = runs_slots(rng, args.blocks, args.run, half), runs_slots(rng, args.blocks, args.run, half)
    down = (runs_slots(rng, args.blocks, args.run, half) + half,
            runs_slots(rng, args.blocks, args.run, half) + half)

    def copies(kind: str, mark: torch.cuda.Event) -> None:
        """As the executor issues late demotions: after the compute before the step (`mark`),
        not after the step's forward; promotions unordered against the compute stream."""
        if kind in ("d2h", "both"):
            copier.d2h_pieces(*down, piece_blocks=args.blocks, after=mark)
        if kind in ("h2d", "both"):
            copier.h2d(*up, ordered=True)

    stream = torch.cuda.current_stream()

    def timed(kind: str, when: str) -> float:
        """Device ms of one decode step (events on its stream), copies beside it or none."""
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        mark = torch.cuda.Event()
        mark.record(stream)
        if kind != "none" and when == "before":
            copies(kind, mark)
        late = kind != "none" and when == "after"
        eng.launched = (lambda: copies(kind, mark)) if late else (lambda: None)
        decode()
        stop.record(stream)
        stop.synchronize()
        torch.cuda.synchronize()  # the copies too, before the next rep
        return start.elapsed_time(stop)

    for _ in range(3):
        timed("none", "before")
    # Round robin over the variants, so that the GPU's clock drifting between seconds (8%
    # between the first and the last of one variant run back to back) moves all of them alike
    variants = (("none", "-"), ("d2h", "after"), ("d2h", "before"), ("h2d", "after"),
                ("both", "after"))
    times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            times[v].append(timed(*v))
    base = float(np.median(times[("none", "-")]))
    rows = []
    for (kind, when), ms in times.items():
        med = float(np.median(ms))
        row = {"copies": kind, "issued": when, "step_ms": round(med, 3),
               "step_ms_p10_p90": [round(float(np.percentile(ms, q)), 3) for q in (10, 90)],
               "vs_quiet": round(med / base, 3)}
        rows.append(row)
        print(row, flush=True)
    host.close()
    out = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "setting": f"{args.model}, decode of {args.batch} sessions of {args.context} tokens "
                      f"(CUDA graphs); copies of {args.blocks} blocks of {g.block_bytes} bytes "
                      f"in runs of {args.run}; medians of {args.reps}, variants round robin",
           "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
