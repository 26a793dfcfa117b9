"""`tpkv demo`: the multi-turn workload through tpkv's engine on TP ranks, tiered, on Ray."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import TYPE_CHECKING, Any

from tpkv.config import PolicyConfig, TpkvConfig

if TYPE_CHECKING:
    from rich.console import Console

    from tpkv.models.workload import WorkloadConfig


MAX_BATCH = 4


def demo_config(model_name: str, world: int, ssd_root: str, sessions: int) -> TpkvConfig:
    """The demo's tiers: sessions reach 12 blocks; L1 fits a full batch plus a little, L2 one
    block a session (an eighth or less of their blocks): the rest must spill to L3 between
    turns (with twice that L2, the engine's batch bound left L3 unused in some runs).
    The weights are `build_model(model_name, seed=0)`'s: the fingerprint names them."""
    from tpkv.models.llama import ModelConfig
    from tpkv.models.tiered import tiered_config

    return tiered_config(ModelConfig.preset(model_name), world, block_tokens=16,
                         l1_blocks=12 * MAX_BATCH + 8, l2_blocks=sessions,
                         ssd_root=os.path.join(ssd_root, "l3"), l3_blocks=64 * sessions,
                         wait_timeout_s=60.0, policy=PolicyConfig(cooldown_s=0.0),
                         model_fingerprint=f"tpkv-{model_name}-seed0")


def demo_workload(sessions: int, vocab_size: int) -> WorkloadConfig:
    """The demo's multi-turn workload: short sessions, short think times (virtual clock)."""
    from tpkv.models.workload import WorkloadConfig

    return WorkloadConfig(num_sessions=sessions, num_users=max(2, sessions // 2), turns=(3, 6),
                          system_prompt_tokens=32, doc_tokens=(32, 96), user_tokens=(8, 24),
                          gen_tokens=(8, 16), think_s=(0.05, 0.5), ramp_s=0.0,
                          max_session_tokens=180, vocab_size=vocab_size)


def total_turns(sessions: int) -> int:
    """Turns of the whole demo workload (the plan of a session does not depend on the model)."""
    from tpkv.models.workload import plan_session

    wl = demo_workload(sessions, vocab_size=2)
    return sum(len(plan_session(wl, i)) for i in range(sessions))


def rank_main(cfg: TpkvConfig, model_name: str, seconds: float, sessions: int,
              progress_path: str | None = None) -> dict[str, Any]:
    """Every rank: join tpkv (Ray controller) with the driver's `cfg` (the environment already
    laid over it, as the controller has it), run the workload on small tiers, summarise.
    Rank 0 writes its progress to `progress_path` (tpkv.launch.demo_progress)."""
    import time

    import torch

    from tpkv.launch.join import init
    from tpkv.models.llama import build_model
    from tpkv.models.tiered_demo import run_tiered_demo
    from tpkv.models.tp import apply_tp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    model = build_model(model_name, seed=0, device=device)
    wl = demo_workload(sessions, model.config.vocab_size)
    report = None
    if rank == 0 and progress_path is not None:
        from tpkv.launch import demo_progress

        path, started = progress_path, [0.0]

        def report(turns: int, stats: Any) -> None:
            if turns == 0:  # the workload starts: the time cap counts from here
                started[0] = time.time()
            demo_progress.write(path, turns, started[0], stats.moves)

    with init(cfg, device=device, env=False) as rt:
        if world > 1:
            apply_tp(model, rank, world)
        out = run_tiered_demo(rt, model, wl, seconds=seconds, progress=report,
                              max_batch=MAX_BATCH)
    out["rank"], out["world"], out["device"] = rank, world, str(device)
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
    t.add_row("moves L1 -> L2 into the copy L2 kept (nothing copied)", str(out["kept_moves"]))
    t.add_row("moves L2 -> L3 onto the record L3 kept (nothing written)",
              str(out["kept_spills"]))
    for tier, r in out["resume_latency"].items():
        if r["count"]:
            t.add_row(f"resume from {tier.upper()} (mean / p99 ms)",
                      f"{r['mean_ms']:.1f} / {r['p99_ms']:.1f} over {r['count']}")
    if "returns" in out:
        t.add_row("turns back from L3 read ahead outside the batch / sent in to recompute",
                  f"{out['returns']['read_ahead']} / {out['returns']['recomputed']}")
    t.add_row("tokens recomputed after a drop or miss", str(out["recompute_tokens"]))
    t.add_row("decode tokens/s", f"{out['decode_tokens_per_s']:.0f}")
    console.print(t)


def demo(tp: int, seconds: float, model: str, sessions: int, keep_serving: bool = False,
         serve_s: float | None = None, dashboard_host: str | None = None,
         dashboard_port: int | None = None) -> int:
    """Start Ray (unless running) and the controller here, so that its dashboard is up from the
    start (and, with keep_serving, after the run); run the ranks with a progress bar (until the
    workload's turns are done, or `seconds` at most: tpkv.launch.demo_progress).

    The TPKV_* variables apply as everywhere (tpkv.settings): TPKV_SSD_DIR holds the demo's
    temporary L3 directory, TPKV_L2_BYTES / TPKV_WAIT_TIMEOUT_S replace the demo's values, the
    dashboard takes TPKV_DASHBOARD_HOST/PORT/TOKEN (the flags `dashboard_host/port` first).
    A port asked for that is taken is a ConfigError; the default one taken, a free port and a
    notice (tpkv.launch.demo_settings). Every bad value stops the demo before Ray starts.
    """
    import ray
    from rich.console import Console

    from tpkv.controller import actor
    from tpkv.launch import stop
    from tpkv.launch.demo_settings import demo_settings, token_note
    from tpkv.ray_notice import quiet_token_notice
    from tpkv.settings import read_env

    console = Console()
    parent = read_env().ssd_dir
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpkv-demo-", dir=parent) as root:
        cfg, notice = demo_settings(demo_config(model, tp, root, sessions), dashboard_host,
                                    dashboard_port)
        cfg = dataclasses.replace(cfg, l3=dataclasses.replace(
            cfg.l3, root=os.path.join(root, "l3")))  # TPKV_SSD_DIR holds `root`
        console.print(f"starting a local Ray cluster, the controller and {tp} TP ranks; "
                      f"model '{model}', {sessions} sessions: {total_turns(sessions)} turns, "
                      f"for up to {seconds:.0f} s ...")
        if notice:
            console.print(notice)
        started = not ray.is_initialized()
        if started:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            quiet_token_notice()
            ray.init(address="local", namespace=actor.NAMESPACE, include_dashboard=False,
                     log_to_driver=False, num_cpus=max(tp, os.cpu_count() or 1))
            stop.install()  # ray.init put its own SIGTERM handler (sys.exit) in place
        handle = None
        try:
            handle = actor.get_or_create(cfg)
            client = actor.ControllerClient(handle, timeout_s=60.0)
            info = client.dashboard()
            url = info.get("url")
            if url:
                console.print(f"dashboard: {url} (while the demo runs"
                              f"{' and after it' if keep_serving else ''}){token_note(cfg)}")
            else:
                console.print(f"dashboard not started: {info.get('error')}")
            results = _run_with_progress(console, client, tp, seconds, cfg, model, sessions,
                                         os.path.join(root, "progress.json"))
            out = results[0]
            out["dashboard"] = url
            print_summary(out, console)
            same = all(r["turns"] == out["turns"] and r["moves"] == out["moves"]
                       for r in results)
            console.print(f"all {tp} ranks agree on every turn and move: {same}")
            if keep_serving and url:
                _serve(console, url, serve_s)
            return 0 if same else 1
        finally:
            if handle is not None:
                ray.kill(handle)
            if started:
                ray.shutdown()


def _run_with_progress(console: Console, client: Any, tp: int, seconds: float, cfg: TpkvConfig,
                       model: str, sessions: int, progress_path: str) -> list[Any]:
    """launch_ray on a thread; here, the progress (turns of the workload's, time of the cap)
    with the controller's figures."""
    import threading

    from tpkv.launch import demo_progress
    from tpkv.launch.ray_launch import launch_ray

    box: dict[str, Any] = {}

    def ranks() -> None:
        try:
            box["results"] = launch_ray(rank_main, tp,
                                        args=(cfg, model, seconds, sessions, progress_path),
                                        timeout_s=120.0)
        except BaseException as exc:  # re-raised on the main thread
            box["error"] = exc

    worker = threading.Thread(target=ranks, name="tpkv-demo-ranks", daemon=True)
    worker.start()
    with demo_progress.DemoProgress(console, total_turns(sessions), seconds) as bar:
        while worker.is_alive():
            worker.join(1.0)
            done = demo_progress.read(progress_path)
            bar.update(done, _figures(client, done), final=not worker.is_alive())
    if "error" in box:
        raise box["error"]
    results: list[Any] = box["results"]
    return results


def _figures(client: Any, done: dict[str, Any] | None = None) -> str:
    """One line from the controller's snapshot; empty while it is busy or not ready."""
    from tpkv.launch.demo_progress import tier_figures

    try:
        snap = client.snapshot()
    except Exception:  # noqa: BLE001 - the bar goes on without figures
        return ""
    moved = None if done is None else done.get("moves", {}).get("l2_l3")
    return tier_figures(snap, moved)


def _serve(console: Console, url: str, serve_s: float | None) -> None:
    """Keep the controller and its dashboard up until Ctrl-C (or serve_s seconds, for tests)."""
    import time

    from tpkv.launch.stop import Stop

    console.print(f"--keep-serving: the dashboard stays at {url}; Ctrl-C to stop")
    deadline = None if serve_s is None else time.monotonic() + serve_s
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping")
    except Stop:  # the way to end --keep-serving: the signal handler said "stopping"
        pass
