"""On a cold numba cache, compile tpkv's kernels in several short-lived processes at once.

Compiled one after another, tpkv's ~25 kernels take 11-15 s of one core on a fresh install (or
after a numba upgrade, which makes numba ignore its old cache). `ensure` (the first caller of a
process decides; later ones wait for it) looks at numba's index files first: when they are there
and current it returns at once and spawns nothing. Otherwise, given at least `MIN_PROCESSES`
cores, it starts up to `MAX_PROCESSES` interpreters (`subprocess`: a daemonic process such as a
Ray actor may start them too). Each imports the kernels, finds the argument types of every
kernel with a dry run of the very warm-ups the process runs next (workers.kernels.warm,
controller.warm's script) on the kernels' pure-Python bodies, then claims kernels one by one
(atomic file creation, longest code first) and compiles them into numba's cache directory. A
caller compiles (and saves) its callees too, and numba saves a function's overloads through one
index file (read, add, write back), so the pool's processes save under one lock
(`kernel_pool_child.lock_saves`).
The caller then loads everything from the cache. What fails here (no process can be started, a
child dies or times out) is logged; the in-process warm-up compiles whatever is still missing,
as without the pool. `report()` says how long each kernel took, for bench/startup.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpkv.config import TpkvConfig

log = logging.getLogger(__name__)

WORKER_MODULES = ("tpkv.workers.kernels",)
CONTROLLER_MODULES = ("tpkv.controller.kernels", "tpkv.controller.arena",
                      "tpkv.controller.stepkernels", "tpkv.controller.plankernels")
MAX_PROCESSES = 12
# Fewer cores than this: no pool. In CPU seconds on a 2-core VM, 23 kernels with their callees:
# 11-12 s compiled in the process; in 12 processes 2.7 s until the last is done but 26 s in all
# (each spends ~0.6 s before it compiles, and a callee compiles again in every process that
# compiles one of its callers). With 2 processes: 9 s (on a busy machine, slower than one).
MIN_PROCESSES = 3
TIMEOUT_S = 300.0

_LOCK = threading.Lock()
_DONE = threading.Event()
_STARTED = False
_REPORT: dict[str, Any] = {}


def report() -> dict[str, Any]:
    """What this process's pool did: {} when none ran, else processes, wall_s, the seconds
    (wall and CPU) each child took to be ready (imports and dry run) and per kernel: seconds
    (wall and CPU), signatures, child."""
    return dict(_REPORT)


def ensure(config: TpkvConfig | None) -> None:
    """Make sure numba's cache holds the worker's kernels (and the controller's for `config`,
    unless None) before they are loaded: see the module docstring. Never raises."""
    global _STARTED
    with _LOCK:
        first, _STARTED = not _STARTED, True
    if not first:  # bounded: the first one's lock and pool each give up after TIMEOUT_S
        _DONE.wait()
        return
    try:
        _run(config)
    except Exception:
        log.warning("compiling the kernels in parallel failed; they compile here",
                    exc_info=True)
    finally:
        _DONE.set()


def dispatchers(modules: tuple[str, ...]) -> dict[str, Any]:
    """'module:name' -> numba dispatcher for every kernel defined in `modules` (imported)."""
    import importlib

    from numba.core.registry import CPUDispatcher

    out: dict[str, Any] = {}
    for m in modules:
        for k, v in vars(importlib.import_module(m)).items():
            if isinstance(v, CPUDispatcher) and v.py_func.__module__ == m:
                out[f"{m}:{k}"] = v
    return out


def is_cached(d: Any) -> bool:
    """Whether numba's cache has a current index (this numba, this source) for dispatcher d."""
    return bool(d._cache._cache_file._load_index())


def cpus() -> int:
    """Cores this process may run on: at most this many pool processes."""
    return len(os.sched_getaffinity(0))


def _cold(disps: dict[str, Any]) -> bool:
    """Most kernels have no current cache entry (a few never run in the warm-ups: they compile
    when first used, and may stay uncached in a warm cache)."""
    return 2 * sum(not is_cached(d) for d in disps.values()) > len(disps)


def callees(disps: dict[str, Any], name: str) -> list[str]:
    """The kernels of `disps` that kernel `name` calls (compiled, and cached, with it)."""
    by_id = {id(d): n for n, d in disps.items()}
    f = disps[name].py_func
    return [c for c in (by_id.get(id(f.__globals__.get(g))) for g in f.__code__.co_names) if c]


def order(disps: dict[str, Any]) -> list[str]:
    """The kernels, longest code first (with their callees'): the order the pool takes them."""
    def size(n: str) -> int:
        return sum(len(disps[c].py_func.__code__.co_code) for c in [n, *callees(disps, n)])

    return sorted(disps, key=size, reverse=True)


def _run(config: TpkvConfig | None) -> None:
    started = time.perf_counter()
    modules = WORKER_MODULES + (CONTROLLER_MODULES if config is not None else ())
    disps = dispatchers(modules)
    if not _cold(disps):
        return  # warm: spawn nothing
    cache_dir = Path(next(iter(disps.values()))._cache._cache_path)
    with _cache_lock(cache_dir):  # other ranks of this host: one pool, the rest load its work
        if not _cold(disps):  # another process of this host filled it meanwhile
            return
        n = min(sum(not is_cached(d) for d in disps.values()), MAX_PROCESSES, cpus())
        if cpus() < MIN_PROCESSES or n < 2:
            return
        work = Path(tempfile.mkdtemp(prefix="tpkv-kernel-pool-"))
        try:
            _spawn_and_wait(config, modules, n, work, started)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _spawn_and_wait(config: TpkvConfig | None, modules: tuple[str, ...], n: int, work: Path,
                    started: float) -> None:
    import numba

    (work / "job").write_bytes(pickle.dumps((config, modules)))
    (work / "claims").mkdir()
    env = dict(os.environ)
    chosen = getattr(numba.config, "CACHE_DIR", "")  # also one tpkv.numba_cache set at run time
    if chosen:
        env["NUMBA_CACHE_DIR"] = str(chosen)
    root = str(Path(__file__).resolve().parents[1])  # the same tpkv as this process's
    code = (f"import sys; sys.path.insert(0, {root!r}); "
            "from tpkv.kernel_pool_child import child; child(sys.argv[1])")
    procs = []
    try:
        for i in range(n):
            with open(work / f"out{i}", "wb") as out, open(work / f"err{i}", "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", code, str(work)], env=env,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=err))
    except OSError as exc:  # no processes here (a sandbox, limits): those started still help
        log.info("kernel pool: started %d of %d processes (%s)", len(procs), n, exc)
    deadline = time.monotonic() + TIMEOUT_S
    tasks: list[dict[str, Any]] = []
    ready: list[float] = []
    ready_cpu: list[float] = []
    try:
        for i, p in enumerate(procs):
            try:
                rc = p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            for line in (work / f"out{i}").read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # cut short by a kill
                    continue
                if "ready_s" in rec:
                    ready.append(rec["ready_s"])
                    ready_cpu.append(rec["ready_cpu_s"])
                else:
                    tasks.append({**rec, "child": i})
            if rc != 0:
                log.warning("kernel pool process %d exited with %s: %s", i, rc,
                            (work / f"err{i}").read_text()[-2000:])
    finally:  # none outlives this call: what compiles after it must not race their saves
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _REPORT.update(processes=len(procs), wall_s=time.perf_counter() - started,
                   ready_s=ready, ready_cpu_s=ready_cpu, kernels=tasks)
    from tpkv import startup

    startup.add("kernel_pool", time.perf_counter() - started)


class _cache_lock:
    """flock on a file in numba's cache directory, waited for at most TIMEOUT_S."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "tpkv-kernel-pool.lock"
        self.fd = -1

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return  # go on unlocked: at worst both compile
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock
