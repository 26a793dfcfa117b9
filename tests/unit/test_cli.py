"""The `tpkv` command: --version, fast --help, every flag's help and default, SIGTERM, and the
demo's progress on a terminal-less output (a log)."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from tpkv.launch import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.split()
    assert out[0] == "tpkv" and out[1] == cli.version() and out[1][0].isdigit()


def test_help_loads_no_torch_ray_or_numpy() -> None:
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        from tpkv.launch import cli
        for argv in (["--help"], ["demo", "--help"], ["demo-tiers", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    cli.main(argv)
                except SystemExit:
                    pass
        print(json.dumps(sorted(m for m in ("torch", "ray", "numpy") if m in sys.modules)))
    """)
    got = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                         timeout=60, check=True)
    assert json.loads(got.stdout.strip().splitlines()[-1]) == []


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_has_help_and_shows_its_default() -> None:
    parsers = _subparsers(cli.build_parser())
    assert {"demo", "demo-tiers", "launch", "status", "dashboard"} <= set(parsers)
    checked = 0
    for name, p in parsers.items():
        fmt = p._get_formatter()
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"tpkv {name} {action.option_strings[0]} has no help"
            if action.nargs != 0 and not action.required:  # takes a value: default shown
                shown = fmt._get_help_string(action) or ""
                assert "default" in shown, f"tpkv {name} {action.option_strings[0]}: {shown!r}"
                checked += 1
    assert checked >= 12
    demo_help = parsers["demo"].format_help()
    assert "(default: 60.0)" in demo_help and "(default: 64)" in demo_help
    assert "(default: 256)" in parsers["demo-tiers"].format_help()


def test_sigterm_prints_stopping_runs_cleanup_and_exits_143() -> None:
    """A command that is running (its work replaced by a wait) gets SIGTERM."""
    code = textwrap.dedent("""
        import sys, time
        from tpkv.launch import cli
        def work(args):
            try:
                print("ready", flush=True)
                time.sleep(60)
            finally:
                print("cleanup ran", flush=True)
            return 0
        cli.demo = work
        sys.exit(cli.main(["demo-tiers", "--blocks", "4"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, out, err)
    assert "stopping" in err and "cleanup ran" in out
    assert "Traceback" not in out + err


def test_progress_without_a_terminal_prints_a_line_every_few_seconds() -> None:
    """A log gets a plain line every 5 s; the percentage follows turns (the workload ends at a
    third of the time cap) and never jumps; L3 shows blocks and moves, not only its share."""
    from tpkv.launch import demo_progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    now = [1000.0]
    bar = demo_progress.DemoProgress(console, total_turns=60, seconds=60.0, every_s=5.0,
                                     clock=lambda: now[0])
    snap = {"tick": 7, "num_sessions": 3,
            "tiers": {"L1": {"used": 40, "occupancy": 0.7}, "L3": {"used": 90,
                                                                   "occupancy": 0.02}}}
    with bar:
        bar.update(None, "")
        for t in range(1, 21):  # 3 turns a second: all 60 done after 20 s
            now[0] += 1.0
            done = {"turns": 3 * t, "started_unix": 1000.0, "moves": {"l2_l3": 10 * t}}
            bar.update(done, demo_progress.tier_figures(snap, 10 * t), final=t == 20)
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 5 and lines[0].startswith("demo   0%  starting ranks")
    pcts = [int(line.split()[1].rstrip("%")) for line in lines]
    assert pcts == sorted(pcts) and pcts[-1] == 100
    assert max(b - a for a, b in zip(pcts, pcts[1:])) <= 30
    assert "60/60 turns, 20 s of up to 60 s" in lines[-1]
    assert "L3 90 blocks (2%)" in lines[-1] and "200 moved to L3 so far" in lines[-1]


def test_progress_file_round_trip(tmp_path: os.PathLike[str]) -> None:
    from tpkv.launch import demo_progress

    path = os.path.join(tmp_path, "progress.json")
    assert demo_progress.read(path) is None
    demo_progress.write(path, 5, 123.5, {"l2_l3": 4})
    assert demo_progress.read(path) == {"turns": 5, "started_unix": 123.5,
                                        "moves": {"l2_l3": 4}}
