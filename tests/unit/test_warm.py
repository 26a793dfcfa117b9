"""The kernel warm-up (tpkv.controller.warm) compiles every kernel signature the controller
uses: workloads run after it, with the same policy, compile nothing more. Each case runs in a
fresh interpreter (this one has compiled everything already) with numba's disk cache off, so
that what is compiled is seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import functools, json, sys, tempfile, pathlib
import numba
from numba.core.registry import CPUDispatcher
from tests.fakes import FakeClock
from tests.unit.conftest import make_config
from tests.unit.test_controller_properties import World, program
from tpkv.controller import (Controller, kernels, plankernels, rowkernels, stepkernels, arena,
                             batchtable)
from tpkv.controller.warm import warm_kernels

cfg = json.loads(sys.argv[1])
make = make_config.__wrapped__(pathlib.Path(tempfile.mkdtemp()))
mods = (kernels, plankernels, rowkernels, stepkernels, arena, batchtable)
def signatures():
    return {f"{m.__name__}.{k}": len(v.signatures) for m in mods for k, v in vars(m).items()
            if isinstance(v, CPUDispatcher)}
took = warm_kernels(make(**cfg), functools.partial(Controller, warm=False))
before = signatures()
for seed in range(6):
    w = World(cfg, make, FakeClock())
    for op in program(seed, 120):
        w.apply(op)
after = signatures()
print(json.dumps({"took": took, "missed": {k: after[k] - before.get(k, 0) for k in after
                                           if after[k] != before.get(k, 0)},
                  "kernels": len(after), "compiled": sum(1 for v in before.values() if v)}))
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cfg", [dict(l1=12, l2=10, l3=24), dict(l1=12, l2=48, l3=0),
                                 dict(l1=10, l2=16, l3=40, kind="lruk",
                                      max_moves_per_step=3)],
                         ids=["heat-l3", "heat-no-l3", "lruk"])
def test_workloads_after_the_warm_up_compile_nothing(cfg):
    env = {**os.environ, "NUMBA_DISABLE_CACHE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cfg)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["missed"] == {}, result
    assert result["compiled"] >= 10, result


WORKER_SCRIPT = r"""
import json
from numba.core.registry import CPUDispatcher
from tpkv.workers import kernels
from tests.unit.test_tiered_hints import _open, _resume_workload

rt, model = _open()  # the Worker warms its kernels when it starts
def signatures():
    return {k: len(v.signatures) for k, v in vars(kernels).items()
            if isinstance(v, CPUDispatcher)}
before = signatures()
_resume_workload(rt, model)
after = signatures()
rt.close()
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.timeout(600)
def test_a_rank_compiles_its_kernels_when_it_starts():
    """tpkv.workers.kernels.warm (Worker start): resumes after it compile nothing more (the
    plan check gets a plan's read-only arrays); the copy descriptors are compiled too, though
    only a GPU copies through them."""
    env = {**os.environ, "NUMBA_DISABLE_CACHE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", WORKER_SCRIPT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] == result["after"], result
    assert result["before"]["check_moves"] >= 1 and result["before"]["merged_copies"] >= 1
