"""`tpkv status` (the controller's snapshot as terminal tables) and `tpkv dashboard` (its URL)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

T = TypeVar("T")

_TIERS = ("L1", "L2", "L3")


def add_status_commands(subparsers: Any) -> None:
    """Register `status` and `dashboard` on the `tpkv` command's subparsers."""
    st = subparsers.add_parser("status", help="print the running controller's state as tables")
    st.add_argument("--sessions", type=int, default=20, help="session rows to print (default 20)")
    st.add_argument("--json", action="store_true", help="print the JSON of /api/snapshot instead")
    st.add_argument("--url", default=None,
                    help="read a dashboard's /api/snapshot at this URL (e.g. a vLLM instance's, "
                         "http://127.0.0.1:PORT) instead of finding the controller through Ray "
                         "(default: through Ray)")
    st.add_argument("--token", default=None,
                    help="bearer token for --url (default: TPKV_DASHBOARD_TOKEN)")
    st.set_defaults(func=status_command)
    db = subparsers.add_parser("dashboard", help="print the URL of the running controller's "
                                                 "dashboard")
    db.add_argument("--json", action="store_true", help="print url, host, port, token_required")
    db.set_defaults(func=dashboard_command)
    for p in (st, db):
        p.add_argument("--address", default=None,
                       help="Ray cluster to ask (default: the one running here, 'auto')")
        p.add_argument("--timeout-s", type=float, default=10.0, help="bound on finding it")


def _connect(args: argparse.Namespace, what: str) -> tuple[Any, bool] | None:
    from tpkv.controller import actor

    try:
        return actor.attach(args.address, args.timeout_s)
    except Exception as exc:  # no cluster, no controller: say so, exit 1
        print(f"tpkv {what}: no tpkv controller found ({type(exc).__name__}: {exc}). Is a tpkv "
              f"app running on this Ray cluster?", file=sys.stderr)
        return None


def _ask(args: argparse.Namespace, what: str, fn: Callable[[Any], T]) -> T | None:
    """fn(client) with the controller found through Ray (None, said on stderr, if there is
    none); leaves Ray again if this call joined it."""
    from tpkv.controller import actor

    found = _connect(args, what)
    if found is None:
        return None
    client, joined = found
    try:
        return fn(client)
    finally:
        actor.detach(joined)


def dashboard_command(args: argparse.Namespace) -> int:
    """Print the dashboard URL of the controller found through Ray by name."""
    info = _ask(args, "dashboard", lambda client: client.dashboard())
    if info is None:
        return 1
    if args.json:
        print(json.dumps(info))
        return 0 if info.get("url") else 1
    if not info.get("url"):
        print(f"tpkv dashboard: the controller has no dashboard: {info.get('error')}",
              file=sys.stderr)
        return 1
    print(info["url"])
    if info.get("token_required"):
        print("(needs the bearer token of TpkvConfig.dashboard_token / TPKV_DASHBOARD_TOKEN: "
              "open the URL with #token=<token>)", file=sys.stderr)
    return 0


def status_command(args: argparse.Namespace) -> int:
    """Print the controller's snapshot (with the dashboard's series) as tables; with --url,
    the snapshot a dashboard serves there (a controller's or a vLLM instance's)."""
    if args.url is not None:
        return _status_from_url(args)

    def ask(client: Any) -> tuple[dict[str, Any], str | None]:
        payload = client.dashboard_payload()
        try:
            return payload, client.dashboard().get("url")
        except Exception:
            return payload, None

    answer = _ask(args, "status", ask)
    if answer is None:
        return 1
    payload, url = answer
    if args.json:
        print(json.dumps(payload, indent=1))
        return 0
    render_status(payload, Console(), max_sessions=args.sessions, url=url)
    return 0


def _status_from_url(args: argparse.Namespace) -> int:
    from tpkv.launch.status_url import fetch_snapshot, render_vllm_status

    try:
        payload = fetch_snapshot(args.url, args.token, args.timeout_s)
    except (OSError, ValueError) as exc:
        print(f"tpkv status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(payload, indent=1))
    elif payload.get("kind") == "vllm":
        render_vllm_status(payload, Console(), url=args.url)
    else:
        render_status(payload, Console(), max_sessions=args.sessions, url=args.url)
    return 0


def _num(x: Any, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x * scale:.{digits}f}"


def _bar(fraction: float, width: int = 12) -> str:
    n = max(0, min(width, round(fraction * width)))
    return "#" * n + "." * (width - n)


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold")
    for c in columns:
        t.add_column(c, justify="left" if c in ("session", "host", "kind", "details", "tier",
                                                 "direction", "resume", "occupancy") else "right")
    return t


def render_status(payload: Mapping[str, Any], console: Console, max_sessions: int = 20,
                  url: str | None = None) -> None:
    """The payload of /api/snapshot as tables; controller strings go in as plain Text."""
    d = payload
    epoch, lat = d.get("epoch", {}), d.get("plan_latency_us", {})
    rebuild = ", AWAITING REBUILD" if d.get("awaiting_rebuild") else ""
    console.print(Text(
        f"tpkv controller: epoch {epoch.get('committed')} committed ({epoch.get('next')} next, "
        f"{epoch.get('num_pending')} pending), tick {d.get('tick')}, "
        f"up {_num(d.get('uptime_s'), 0)} s, restarts {d.get('restarts')}{rebuild}, "
        f"{d.get('num_sessions')} sessions, plan latency p50 {_num(lat.get('p50'), 2, 1e-3)} / "
        f"p99 {_num(lat.get('p99'), 2, 1e-3)} ms" + (f"\ndashboard: {url}" if url else "")))
    tiers = _table("tiers (per rank; every rank holds its shard of the same blocks)", "tier",
                   "used", "slots", "occupancy", "%", "low", "high", "draining")
    for name in _TIERS:
        t = d.get("tiers", {}).get(name)
        if not t or not t.get("enabled"):
            tiers.add_row(name, "-", "-", "disabled", "-", "-", "-", "-")
            continue
        occ = t.get("occupancy") or 0.0
        tiers.add_row(name, str(t["used"]), str(t["slots"]), _bar(occ), _num(occ, 1, 100),
                      _num(t["low_watermark"]), _num(t["high_watermark"]),
                      "yes" if t.get("draining") else "")
    console.print(tiers)
    dash = d.get("dashboard") or {}
    cons = dash.get("consistency")
    if cons:
        ranks = _table(f"TP consistency: {cons['mismatches']} mismatches, {cons['resyncs']} "
                       f"resyncs", "rank", "host", "confirmed epoch", "mismatches")
        for r in cons["ranks"]:
            ranks.add_row(str(r["rank"]), Text(str(r["host"])), str(r["confirmed_epoch"]),
                          str(r["mismatches"]))
        console.print(ranks)
    traffic = dash.get("traffic")
    if traffic:
        moves = _table(f"moves ({traffic['totals']['plans']} plans committed)", "direction",
                       "moves/s now", "GB/s now", "moves total", "GB total")
        for k in traffic["directions"]:
            moves.add_row(k, _num(traffic["latest"]["moves_per_s"][k], 1),
                          _num(traffic["latest"]["bytes_per_s"][k], 3, 1e-9),
                          str(traffic["totals"]["moves"][k]),
                          _num(traffic["totals"]["bytes"][k], 2, 1e-9))
        console.print(moves)
    sessions = list(d.get("sessions", []))
    wide = console.width >= 110  # a narrow terminal drops the less telling columns
    st = _table(f"sessions ({min(len(sessions), max_sessions)} most recent of "
                f"{d.get('num_sessions')})", "session", "tokens", "blocks", *_TIERS,
                *(("none", "heat", "last run") if wide else ("heat",)), "idle", "pins", "resume")
    st.columns[0].no_wrap = True
    for s in sessions[:max_sessions]:
        tiers_of = s.get("tiers", {})
        extra = [str(tiers_of.get("none", 0))] if wide else []
        last = [str(s.get("last_run_tick"))] if wide else []
        st.add_row(Text(str(s["session"])), str(s["tokens"]), str(s["blocks"]),
                   *(str(tiers_of.get(k, 0)) for k in _TIERS), *extra, _num(s.get("heat"), 3),
                   *last, str(s.get("ticks_idle", "-")), str(s.get("pinned_blocks", 0)),
                   Text(str(s.get("cost", {}).get("choice"))))
    console.print(st)
    events = _table("recent events", "t (s)", "tick", "kind", "details")
    for e in list(d.get("events", []))[-8:][::-1]:
        rest = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in e.items() if k not in ("t_s", "tick", "kind"))
        events.add_row(_num(e.get("t_s"), 1), str(e.get("tick")), Text(str(e.get("kind"))),
                       Text(rest))
    console.print(events)
