"""The `tpkv` command: demo (tier round trip), launch (TP ranks on Ray), status, dashboard.

Only argparse and light tpkv modules load here (`tpkv --help` takes well under a second): each
command imports torch, numpy, Ray and rich itself. Ctrl-C or SIGTERM prints "stopping", ends what
the command started and exits 130 or 143 (tpkv.launch.stop).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import tpkv
from tpkv.errors import ConfigError
from tpkv.launch import stop
from tpkv.launch.status_cli import add_status_commands
from tpkv.settings import VARIABLES, read_env

ENV_HELP = "environment (every command reads and checks them):\n" + "\n".join(
    f"  {name:<22} {what}" for name, what in VARIABLES.items())
DEMO_HELP = """\
The dashboard takes --dashboard-host/--dashboard-port, else TPKV_DASHBOARD_HOST/PORT, else
127.0.0.1:8470; TPKV_DASHBOARD_TOKEN (environment only) makes its data need the bearer token.
A port asked for (flag or TPKV_DASHBOARD_PORT) that is taken stops the demo with an error
naming it; the default port taken (say, by a second demo) gives a free port and a notice.
TPKV_SSD_DIR holds the demo's temporary L3 directory; TPKV_L2_BYTES and TPKV_WAIT_TIMEOUT_S
replace the demo's own values.

It runs until the workload's turns are done or --seconds, whichever comes first. Ctrl-C or
SIGTERM prints "stopping", ends the controller and the Ray cluster it started and exits 130 or
143 (after the run, --keep-serving ends that way with 0)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs as written; each option's help ends with its default when it has a real one
    (not None, not a store_true flag) and does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and action.default is not None
                and action.default is not argparse.SUPPRESS and "default" not in text):
            text += " (default: %(default)s)"
        return text


def version() -> str:
    """The installed package's version, else tpkv.__version__ (a source checkout)."""
    from importlib import metadata

    try:
        return metadata.version("tpkv")
    except metadata.PackageNotFoundError:
        return tpkv.__version__


def demo(args: argparse.Namespace) -> int:
    """Move random blocks L1 -> L2 -> L3 -> L2 -> L1 on this machine and check every byte (L3 in
    a temporary directory inside TPKV_SSD_DIR when that is set)."""
    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    from tpkv.config import GiB, HostConfig, KvGeometry, SsdConfig
    from tpkv.ssd.store import SsdStore
    from tpkv.workers.copy_engine import CopyEngine
    from tpkv.workers.pools import HbmPool, HostPool

    console = Console()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geometry = KvGeometry(num_layers=args.layers, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                          tp_size=1)
    n = args.blocks
    size = f"{geometry.block_bytes / 1024:.0f} KiB ({n * geometry.block_bytes / GiB:.2f} GiB)"
    console.print(f"tpkv {tpkv.__version__} demo on {device}: {n} blocks of {size}")
    parent = read_env().ssd_dir
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="tpkv-demo-", dir=parent)
    try:
        hbm = HbmPool(geometry, n, device)
        host = HostPool(geometry, n, HostConfig(budget_bytes=max(n * geometry.block_bytes, 1)))
        engine = CopyEngine(hbm, host)
        store = SsdStore(SsdConfig(root=root), geometry, "demo-model", rank=0)
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(0, 256, (n, geometry.block_bytes), dtype=torch.uint8, generator=gen)
        hbm.tensor.view(n, -1).view(torch.uint8).copy_(data.to(device))
        slots = np.arange(n)
        rng = np.random.default_rng(0)
        host_slots = rng.permutation(n)
        timings: list[tuple[str, float]] = []

        def timed(label: str, fn) -> None:
            t0 = time.perf_counter()
            fn()
            timings.append((label, time.perf_counter() - t0))

        timed("L1 -> L2", lambda: engine.d2h(slots, host_slots).wait())
        views = [host.block_bytes_view(int(s)) for s in host_slots]
        timed("L2 -> L3", lambda: store.write_blocks("demo-session", slots, views))
        store.commit_manifest("demo-session")
        for v in views:
            v[:] = 0
        hbm.tensor.zero_()
        hits = np.zeros(0, dtype=bool)

        def load() -> None:
            nonlocal hits
            hits = store.read_blocks("demo-session", slots, views)

        timed("L3 -> L2", load)
        back = rng.permutation(n)
        timed("L2 -> L1", lambda: engine.h2d(host_slots, back).wait())
        got = hbm.tensor.view(n, -1).view(torch.uint8).cpu()
        exact = bool(hits.all()) and all(torch.equal(got[back[i]], data[i]) for i in range(n))
        table = Table(title="tier round trip")
        for col in ("move", "method", "GB/s", "ms"):
            table.add_column(col, justify="right")
        total = n * geometry.block_bytes
        for label, secs in timings:
            method = engine.choose_method("d2h") if "L1" in label else store.backend_name
            table.add_row(label, method, f"{total / secs / 1e9:.2f}", f"{secs * 1e3:.1f}")
        console.print(table)
        console.print(f"bit-exact after L1 -> L2 -> L3 -> L2 -> L1: {exact}")
        host.close()
        return 0 if exact else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tiered_demo(args: argparse.Namespace) -> int:
    import torch

    from tpkv.launch.demo import demo as run_demo

    tp = args.tp or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    return run_demo(tp, args.seconds, args.model, args.sessions, keep_serving=args.keep_serving,
                    dashboard_host=args.dashboard_host, dashboard_port=args.dashboard_port)


def launch_command(args: argparse.Namespace) -> int:
    """Run `app` on --tp ranks as Ray actors (a placement group, one bundle per GPU or CPU rank)."""
    from tpkv.errors import TpkvError
    from tpkv.launch.ray_launch import launch_ray

    try:
        results = launch_ray(args.app, args.tp, args=args.args, ray_address=args.ray_address,
                         num_cpus=args.num_cpus, timeout_s=args.timeout_s)
    except TpkvError as exc:
        print(f"tpkv launch: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for rank, value in enumerate(results):
        print(f"rank {rank}: {json.dumps(value, default=str)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `tpkv` command's parser (every subcommand, each flag with its help and default)."""
    ap = argparse.ArgumentParser(prog="tpkv", description=tpkv.__doc__, epilog=ENV_HELP,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"tpkv {version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="multi-turn sessions through tpkv's engine on TP ranks, "
                                    "tiered L1/L2/L3, on a local Ray cluster",
                       epilog=DEMO_HELP)
    d.add_argument("--tp", type=int, default=None, help="TP ranks (default: GPUs, or 2 on CPU)")
    d.add_argument("--seconds", type=float, default=60.0,
                   help="cap on the run's time; it ends sooner when the workload's turns are done")
    d.add_argument("--model", default="small", choices=["tiny", "small", "1b"],
                   help="model size (random weights)")
    d.add_argument("--sessions", type=int, default=64,
                   help="chat sessions of the workload (3 to 6 turns each)")
    d.add_argument("--keep-serving", action="store_true",
                   help="leave the controller and its dashboard up after the run (Ctrl-C ends)")
    d.add_argument("--dashboard-host", default=None,
                   help="address of the dashboard (default: TPKV_DASHBOARD_HOST, or 127.0.0.1)")
    d.add_argument("--dashboard-port", type=int, default=None,
                   help="port of the dashboard, 0 for any free one (default: "
                        "TPKV_DASHBOARD_PORT, or 8470; an asked-for port that is taken is an "
                        "error, the default one taken gives a free port and a notice)")
    d.set_defaults(func=tiered_demo)
    r = sub.add_parser("demo-tiers", help="round-trip random KV blocks through the three tiers")
    r.add_argument("--blocks", type=int, default=256, help="KV blocks to move")
    r.add_argument("--layers", type=int, default=16,
                   help="layers of the KV geometry (block size: layers x 8 heads x 64 x bf16)")
    r.set_defaults(func=demo)
    la = sub.add_parser("launch", help="run an app on N TP ranks as Ray actors (one per GPU, "
                                       "or per CPU rank)")
    la.add_argument("--tp", type=int, required=True, help="TP ranks (one bundle each)")
    la.add_argument("--ray-address", default=None, help="join this cluster (default: local)")
    la.add_argument("--num-cpus", type=int, default=None,
                    help="CPUs of a local cluster (default: this machine's, at least --tp)")
    la.add_argument("--timeout-s", type=float, default=30.0,
                    help="bound on placement, start-up, and on ending after a rank fails")
    la.add_argument("app", help="module:function or file.py:function; runs on every rank")
    la.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the app")
    la.set_defaults(func=launch_command)
    add_status_commands(sub)
    v = sub.add_parser("version", help="print the version")
    v.set_defaults(func=lambda a: print(version()) or 0)
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop.install()
    try:
        if args.command != "version":  # a bad TPKV_* variable is refused, named, up front
            read_env()
        return int(args.func(args))
    except ConfigError as exc:
        print(f"tpkv {args.command}: {exc}", file=sys.stderr)
        return 2
    except stop.Stop as exc:  # the handler said "stopping"; the command's cleanup has run
        return exc.exit_code
    except SystemExit as exc:  # SIGTERM inside ray.init: Ray's own handler is sys.exit(15)
        if exc.code != stop.SIGTERM:
            raise
        print(f"tpkv {args.command}: SIGTERM, stopping", file=sys.stderr)
        return 128 + stop.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
