"""Both launchers run the example app end to end on CPU: torchrun, and `tpkv launch` (Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def run(cmd: list[str], tmp_path: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run a launcher in its own process group; on timeout end that group (ours) and fail."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TPKV_TEST_SSD_DIR": str(tmp_path / "ssd"),
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{cmd} still running after {timeout_s} s\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check(results: list[dict]) -> None:
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert results[0]["plans"] == results[1]["plans"] > 0
    assert all(r["world"] == 2 and r["l1"] > 0 for r in results)


def test_torchrun_runs_the_app(tmp_path):
    proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "tests/e2e/app.py"], tmp_path)
    prefix = "TPKV_APP_RESULT "
    check([json.loads(line[len(prefix):]) for line in proc.stdout.splitlines()
           if line.startswith(prefix)])


def test_tpkv_launch_runs_the_app(tmp_path):
    proc = run([sys.executable, "-m", "tpkv.launch.cli", "launch", "--tp", "2", "--num-cpus",
                "2", "tests.e2e.app:main", "25"], tmp_path)
    check([json.loads(line.split(": ", 1)[1]) for line in proc.stdout.splitlines()
           if line.startswith("rank ")])
