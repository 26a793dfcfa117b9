"""`tpkv status` tables and `tpkv dashboard` without a cluster (Ray cannot start in unit tests)."""

from __future__ import annotations

import argparse
import io
import re
from typing import Any

import pytest
from rich.console import Console

from tpkv.controller.dashboard import view
from tpkv.controller.dashboard.demo import build_demo
from tpkv.launch.status_cli import add_status_commands, render_status

pytestmark = pytest.mark.timeout(60)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tpkv")
    add_status_commands(ap.add_subparsers(dest="command", required=True))
    return ap


def test_status_prints_the_snapshot_as_tables(tmp_path: Any) -> None:
    demo = build_demo(str(tmp_path / "ssd"), num_sessions=12, num_steps=40)
    payload = view.payload(demo.ctl.snapshot(), demo.recorder, None, {})
    payload["ranks"]["1"] = "[bold red]not markup[/]"  # strings are printed as they are
    payload["dashboard"]["consistency"]["ranks"][1]["host"] = "[bold red]not markup[/]"
    out = io.StringIO()
    render_status(payload, Console(file=out, width=200, color_system=None), max_sessions=5,
                  url="http://127.0.0.1:8470/")
    text = out.getvalue()
    snap = demo.ctl.snapshot()
    assert f"epoch {snap['epoch']['committed']} committed" in text
    assert "http://127.0.0.1:8470/" in text and "[bold red]not markup[/]" in text
    for tier in ("L1", "L2", "L3"):
        t = snap["tiers"][tier]
        assert re.search(rf"{tier}\s+\S\s+{t['used']}\s+\S\s+{t['slots']}\s", text), tier
    for s in snap["sessions"][:5]:
        row = rf"{re.escape(s['session'])}\s+\S\s+{s['tokens']}\s+\S\s+{s['blocks']}\s"
        assert re.search(row, text), s["session"]
    assert snap["sessions"][5]["session"] not in text  # only --sessions rows
    for d, n in payload["dashboard"]["traffic"]["totals"]["moves"].items():
        assert re.search(rf"{re.escape(d)}\s.*\s{n}\s", text), d


def test_commands_are_registered() -> None:
    args = parser().parse_args(["status", "--sessions", "3", "--address", "auto"])
    assert args.sessions == 3 and args.address == "auto" and callable(args.func)
    args = parser().parse_args(["dashboard", "--json", "--timeout-s", "2"])
    assert args.json and args.timeout_s == 2.0 and args.func.__name__ == "dashboard_command"


def test_no_cluster_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tpkv.controller import actor

    def no_cluster(address: str | None, timeout_s: float) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(actor, "attach", no_cluster)
    for argv in (["status"], ["dashboard"]):
        args = parser().parse_args([*argv, "--timeout-s", "1"])
        assert args.func(args) == 1
        err = capsys.readouterr().err
        assert "no tpkv controller found" in err and "running Ray instance" in err
