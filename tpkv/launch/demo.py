"""`tpkv demo`: the multi-turn workload through tpkv's engine on TP ranks, tiered, on Ray."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from tpkv.config import PolicyConfig

if TYPE_CHECKING:
    from rich.console import Console


def rank_main(model_name: str, seconds: float, ssd_root: str, sessions: int) -> dict[str, Any]:
    """Every rank: join tpkv (Ray controller), run the workload on small tiers, summarise."""
    import torch

    from tpkv.launch.join import init
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import run_tiered_demo, tiered_config
    from tpkv.models.tp import apply_tp
    from tpkv.models.workload import WorkloadConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    model = build_model(model_name, seed=0, device=device)
    # Sessions reach 12 blocks; L1 fits a full batch plus a little, L2 about a quarter of all
    # sessions: the rest must spill to L3 between turns.
    max_batch = 4
    cfg = tiered_config(model, world, block_tokens=16, l1_blocks=12 * max_batch + 8,
                        l2_blocks=2 * sessions, ssd_root=os.path.join(ssd_root, "l3"),
                        l3_blocks=64 * sessions, wait_timeout_s=60.0,
                        policy=PolicyConfig(cooldown_s=0.0))
    wl = WorkloadConfig(num_sessions=sessions, num_users=max(2, sessions // 2), turns=(3, 6),
                        system_prompt_tokens=32, doc_tokens=(32, 96), user_tokens=(8, 24),
                        gen_tokens=(8, 16), think_s=(0.05, 0.5), ramp_s=0.0,
                        max_session_tokens=180, vocab_size=model.config.vocab_size)
    with init(cfg, device=device) as rt:
        if world > 1:
            apply_tp(model, rank, world)
        url = None
        ctl = rt.controller
        if rank == 0 and ctl is not None and hasattr(ctl, "dashboard"):
            url = ctl.dashboard().get("url")
            print(f"tpkv demo: dashboard at {url} while it runs", flush=True)
        out = run_tiered_demo(rt, model, wl, seconds=seconds, max_batch=max_batch)
    out["rank"], out["world"], out["device"], out["dashboard"] = rank, world, str(device), url
    return out


def print_summary(out: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    t = Table(title=f"tpkv demo: TP {out['world']} on {out['device']}, "
                    f"{out['wall_s']:.0f} s, {out['turns']} turns")
    t.add_column("what")
    t.add_column("value", justify="right")
    if any(out["tiers"]["blocks"].values()):  # sessions still open when the run stopped
        for tier, n in out["tiers"]["sessions"].items():
            t.add_row(f"open sessions reaching {tier.upper()} at the end", str(n))
        for tier, n in out["tiers"]["blocks"].items():
            t.add_row(f"blocks in {tier.upper()} at the end", str(n))
    for d, n in out["moves"].items():
        t.add_row(f"moves {d.replace('_', ' -> ').upper()}",
                  f"{n} ({out['bytes'][d] / 2**20:.1f} MiB per rank)")
    for tier, r in out["resume_latency"].items():
        if r["count"]:
            t.add_row(f"resume from {tier.upper()} (mean / p99 ms)",
                      f"{r['mean_ms']:.1f} / {r['p99_ms']:.1f} over {r['count']}")
    t.add_row("tokens recomputed after a drop or miss", str(out["recompute_tokens"]))
    t.add_row("decode tokens/s", f"{out['decode_tokens_per_s']:.0f}")
    console.print(t)


def demo(tp: int, seconds: float, model: str, sessions: int) -> int:
    from rich.console import Console

    from tpkv.launch.ray_launch import launch_ray

    console = Console()
    console.print(f"starting a local Ray cluster, the controller and {tp} TP ranks; "
                  f"model '{model}', {sessions} sessions, about {seconds:.0f} s ...")
    with tempfile.TemporaryDirectory(prefix="tpkv-demo-") as root:
        results = launch_ray(rank_main, tp, args=(model, seconds, root, sessions),
                             timeout_s=120.0)
    out = results[0]
    print_summary(out, console)
    same = all(r["turns"] == out["turns"] and r["moves"] == out["moves"] for r in results)
    console.print(f"all {tp} ranks agree on every turn and move: {same}")
    if out.get("dashboard"):
        console.print(f"the dashboard was at {out['dashboard']} (it stops with the controller)")
    return 0 if same else 1
