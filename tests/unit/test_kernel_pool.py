"""A cold numba cache compiled in parallel processes (tpkv.kernel_pool): the first start loads
every kernel its warm-ups need from what the pool stored, while the pool runs, and compiles none
of them itself; a second start compiles nothing and starts no pool; where no process can be
started, or the pool's processes die, the kernels compile in the process as before, with no
error; the pool's processes save into numba's cache under a lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from numba.core import event

compiled = []

class Compiles(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Compiles())
spawned = []
try:
    from tpkv import kernel_pool
except ImportError:  # the code before the pool: it compiles everything here
    kernel_pool = None
else:
    kernel_pool.cpus = lambda: 2  # a pool of 2, also where fewer cores would start none
    kernel_pool.MIN_PROCESSES = 2
    popen = kernel_pool.subprocess.Popen

    def counted(*a, **kw):
        spawned.append(1)
        if sys.argv[1] == "no-processes":
            raise PermissionError("simulated: no processes here")
        if sys.argv[1] == "children-die":
            a = ([sys.executable, "-c", "raise SystemExit(3)"],)
        return popen(*a, **kw)

    kernel_pool.subprocess.Popen = counted

from tpkv import startup

at_pool_end = []  # kernels this process had loaded when the pool ended
add = startup.add

def hooked(name, seconds):
    if name == "kernel_pool":
        disps = kernel_pool.dispatchers(kernel_pool.WORKER_MODULES
                                        + kernel_pool.CONTROLLER_MODULES)
        at_pool_end.extend(n.split(":")[1] for n, d in disps.items() if d.overloads)
    add(name, seconds)

startup.add = hooked
import tpkv
from tpkv.config import HbmConfig, HostConfig, KvGeometry, TpkvConfig

g = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
cfg = TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=8),
                 l2=HostConfig(budget_bytes=16 * g.block_bytes))
rt = tpkv.init(cfg, controller="local", device="cpu")
in_init = list(compiled)
for i in range(4):
    rt.open_session(f"s{i}", num_tokens=9)
for step in range(12):  # outgrows L1: demotions to L2 and promotions back
    rt.run_step([f"s{step % 4}"], [1], lambda step: None)
rt.close()
report = kernel_pool.report() if kernel_pool else {}
print(json.dumps({"in_init": in_init, "compiled": compiled, "spawned": len(spawned),
                  "pool": report, "at_pool_end": at_pool_end}))
"""

# Kernels of the start-up's warm-ups (tpkv's own; numba's library helpers have other names)
WARMED = {"merged_copies", "check_moves", "batch_slots", "alloc_blocks", "coldest_candidates",
          "plan_arrays", "move_rows", "walk_prepared", "record_choices", "demand_rows"}


def _start(cache: Path, mode: str = "pool") -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
           "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(1200)
def test_a_cold_cache_compiles_in_the_pool_and_a_second_start_compiles_nothing(
        tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    first = _start(cache)
    pool = first["pool"]
    assert isinstance(pool, dict) and pool.get("processes") == 2, first
    done = {k["kernel"].split(":")[1] for k in pool["kernels"]}
    assert WARMED <= done, pool
    assert not WARMED & set(first["in_init"]), first  # type: ignore[arg-type]
    assert len(first["in_init"]) <= 2, first  # type: ignore[arg-type]
    second = _start(cache)
    assert second["compiled"] == [] and second["spawned"] == 0 and second["pool"] == {}, second


@pytest.mark.timeout(1200)
def test_the_kernels_are_loaded_as_the_pool_compiles_them(tmp_path: Path) -> None:
    """The caller loads each kernel from numba's cache as soon as a pool process reports it
    compiled: when the pool ends, every kernel of the warm-ups is loaded already (before, all
    of them were loaded after it, adding 0.4-1 s to a cold start on the GPU machine)."""
    first = _start(tmp_path / "numba")
    pool = first["pool"]
    assert isinstance(pool, dict) and pool.get("processes") == 2, first
    assert WARMED <= set(first["at_pool_end"]), first  # type: ignore[arg-type]
    assert not WARMED & set(first["in_init"]), first  # type: ignore[arg-type]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", ["no-processes", "children-die"])
def test_without_a_pool_the_kernels_compile_here(tmp_path: Path, mode: str) -> None:
    first = _start(tmp_path / "numba", mode)
    assert first["spawned"], first
    assert WARMED <= set(first["in_init"]), first  # type: ignore[arg-type]


def test_the_pools_saves_lose_no_overload(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of the pool save overloads of one function (a callee two callers compile)
    at the same moment: numba reads the index, picks the first free data file and writes both
    back, so unlocked both would take data file 1 and one entry would be lost or point at the
    other's code. Forced here with two threads that both read the index before either writes:
    under the pool's lock each key keeps its own entry and data."""
    import threading
    import time

    from numba.core.caching import IndexDataCacheFile

    from tpkv import kernel_pool_child

    monkeypatch.setattr(IndexDataCacheFile, "save", IndexDataCacheFile.save)  # undone after
    load = IndexDataCacheFile._load_index

    def slow_load(self: IndexDataCacheFile) -> dict[object, str]:
        got: dict[object, str] = load(self)
        time.sleep(0.3)  # the other thread reads the same index meanwhile, if it may
        return got

    monkeypatch.setattr(IndexDataCacheFile, "_load_index", slow_load)
    kernel_pool_child.lock_saves(tmp_path / "save.lock")

    def one(key: str) -> None:
        IndexDataCacheFile(str(tmp_path), "f", ("stamp", 1)).save(key, f"code of {key}")

    threads = [threading.Thread(target=one, args=(k,)) for k in ("sig-a", "sig-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    cache = IndexDataCacheFile(str(tmp_path), "f", ("stamp", 1))
    assert {k: cache.load(k) for k in ("sig-a", "sig-b")} == {"sig-a": "code of sig-a",
                                                             "sig-b": "code of sig-b"}


class _Done:
    """A pool process that has finished at once, compiling nothing."""

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def poll(self) -> int:
        return 0


@pytest.mark.parametrize(("cached", "cores", "can_start", "processes"),
                         [(True, 16, True, None), (False, 2, True, None), (False, 16, True, 2),
                          (False, 16, False, 0)])
def test_a_pool_only_for_a_cold_cache_and_enough_cores(
        monkeypatch: pytest.MonkeyPatch, cached: bool, cores: int, can_start: bool,
        processes: int | None) -> None:
    """A warm cache spawns nothing (a start as fast as without the pool), nor do fewer cores
    than MIN_PROCESSES (3); otherwise one interpreter, which forks one process per uncached
    kernel, at most one per core (here the worker's two kernels). A process that cannot start:
    no pool, no error."""
    import contextlib

    from tpkv import kernel_pool

    started: list[tuple[object, ...]] = []

    def popen(*args: object, **kwargs: object) -> _Done:
        started.append(args)
        if not can_start:
            raise PermissionError("simulated: no processes here")
        return _Done()

    monkeypatch.setattr(kernel_pool, "is_cached", lambda d: cached)
    monkeypatch.setattr(kernel_pool, "cpus", lambda: cores)
    monkeypatch.setattr(kernel_pool, "_cache_lock", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(kernel_pool.subprocess, "Popen", popen)
    monkeypatch.setattr(kernel_pool, "_REPORT", {})
    kernel_pool._run(None)
    assert len(started) == (0 if processes is None else 1)
    if started:  # python -c CODE WORK N: N processes
        assert started[0][0][-1] == "2", started  # type: ignore[index]
    assert kernel_pool.report().get("processes") == processes, kernel_pool.report()


def test_a_pool_out_of_time_leaves_no_process(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's interpreter forks the processes that compile: when the pool runs out of time,
    they end with it (its process group is killed), so none saves into numba's cache after
    the caller went on to compile there itself."""
    import contextlib
    import subprocess as sp
    import time

    import numba

    from tpkv import kernel_pool

    groups: list[int] = []
    popen = sp.Popen

    def tracked(*args: object, **kwargs: object) -> sp.Popen[bytes]:
        p: sp.Popen[bytes] = popen(*args, **kwargs)  # type: ignore[call-overload]
        groups.append(p.pid)
        return p

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba"), raising=False)
    monkeypatch.setattr(kernel_pool, "is_cached", lambda d: False)
    monkeypatch.setattr(kernel_pool, "cpus", lambda: 16)
    monkeypatch.setattr(kernel_pool, "_cache_lock", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(kernel_pool, "TIMEOUT_S", 2.0)  # they are still importing or compiling
    monkeypatch.setattr(kernel_pool.subprocess, "Popen", tracked)
    monkeypatch.setattr(kernel_pool, "_REPORT", {})
    kernel_pool._run(None)
    assert len(groups) == 1
    time.sleep(0.2)
    assert _running_in_group(groups[0]) == []


def _running_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` that have not ended (zombies have: where no init
    reaps orphans, the killed ones stay as such)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except OSError:  # not a process, or gone
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(d.name))
    return found


def test_a_kernel_with_a_numpy_sort_is_taken_early() -> None:
    """The pool takes the kernels that compile longest first: merged_copies, short but with
    np.argsort (~1.1 s to compile), took 1.5-1.7 s of CPU, walk_prepared (2.5x its bytecode)
    0.9-1.3 s; by bytecode alone it came ninth."""
    from tpkv import kernel_pool

    disps = kernel_pool.dispatchers(kernel_pool.WORKER_MODULES + kernel_pool.CONTROLLER_MODULES)
    taken = kernel_pool.order(disps)
    assert taken.index("tpkv.workers.kernels:merged_copies") < taken.index(
        "tpkv.controller.plankernels:walk_prepared"), taken
    assert taken[0] == "tpkv.controller.plankernels:coldest_candidates", taken
