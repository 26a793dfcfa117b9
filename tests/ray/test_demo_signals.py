"""`tpkv demo` as a user runs it, stopped by SIGTERM mid-run: "stopping", exit 143, no
traceback, and the Ray cluster it started is gone; its output (not a terminal) keeps progress."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    seen, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _sigterm_mid_run(tmp_path, argv: list[str], ready: str, env: dict[str, str]
                     ) -> tuple[int, str, set[int]]:
    """Start `python -m tpkv.launch.cli ARGV` (output to a file), wait for `ready` (a regex) in
    its output, SIGTERM it; -> (exit code, output, the processes it had started)."""
    log_path = tmp_path / "run.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tpkv.launch.cli", *argv],
                            env={**os.environ, "PYTHONPATH": ROOT, "RAY_USAGE_STATS_ENABLED": "0",
                                 **env}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 150
        while not re.search(ready, log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        time.sleep(1)  # at work
        started = _descendants(proc.pid)
        assert started, "the command started no Ray processes"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, log_path.read_text(), started


def _ended(started: set[int]) -> bool:
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not [p for p in started if _alive(p)]


@pytest.mark.timeout(240)
def test_sigterm_mid_demo_stops_cleanly_and_ends_its_ray_cluster(tmp_path) -> None:
    rc, text, started = _sigterm_mid_run(
        tmp_path, ["demo", "--model", "tiny", "--sessions", "64", "--seconds", "120",
                   "--dashboard-port", "0"], r"\d+/\d+ turns", {"TPKV_SSD_DIR": str(tmp_path)})
    assert rc == 143, text
    assert "stopping" in text and "Traceback" not in text, text
    assert "Token authentication is enabled" not in text
    assert text.count("\ndemo ") >= 2  # plain progress lines, not one live bar's last frame
    assert _ended(started), "Ray processes outlived the demo"


@pytest.mark.timeout(240)
def test_sigterm_mid_launch_stops_cleanly_and_ends_its_ray_cluster(tmp_path) -> None:
    """`tpkv launch` while its rank runs: SIGTERM arrives after ray.init (which sets its own
    handler): "stopping", exit 143, no traceback, no token notice, and Ray's processes end."""
    rc, text, started = _sigterm_mid_run(
        tmp_path, ["launch", "--tp", "1", "--num-cpus", "2", "tests.e2e.app:main", "100000"],
        "dashboard at", {"TPKV_TEST_SSD_DIR": str(tmp_path / "l3")})
    assert rc == 143, text
    assert "stopping" in text and "Traceback" not in text, text
    assert "Token authentication is enabled" not in text, text
    assert _ended(started), "Ray processes outlived the launch"
