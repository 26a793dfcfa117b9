"""On a cold numba cache, compile tpkv's kernels in several short-lived processes at once.

Compiled one after another, tpkv's ~25 kernels take 11-15 s of one core on a fresh install (or
after a numba upgrade, which makes numba ignore its old cache). `ensure` (the first caller of a
process decides; later ones wait for it) looks at numba's index files first: when they are there
and current it returns at once and spawns nothing. Otherwise, given at least `MIN_PROCESSES`
cores, it starts one interpreter (`subprocess`: a daemonic process such as a Ray actor may start
it too; tpkv.kernel_pool_child), which imports the kernels and forks up to `MAX_PROCESSES`
processes from itself, so that the imports and the set-up of numba's compiler (~1 s of CPU each)
are paid once, not once per process: process 0 right after the imports, to find the argument
types of every kernel with a dry run of the very warm-ups the caller runs next
(workers.kernels.warm, controller.warm's script) on the kernels' pure-Python bodies; the others
once the compiler is warm. They claim kernels one by one (atomic file creation, longest code
first) and compile them into numba's cache directory. A caller compiles (and saves) its callees
too, and numba saves a function's overloads through one index file (read, add, write back), so
the pool's processes save under one lock (`lock_saves`). Meanwhile the caller loads each kernel
from the cache as soon as a process reports it compiled, so that almost nothing is left to load
when the last one ends. What fails here (no process can be started, one dies or times out) is
logged; the in-process warm-up compiles whatever is still missing, as without the pool.
`report()` says how long each kernel took, for bench/startup.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpkv.config import TpkvConfig

log = logging.getLogger(__name__)

WORKER_MODULES = ("tpkv.workers.kernels",)
CONTROLLER_MODULES = ("tpkv.controller.kernels", "tpkv.controller.arena",
                      "tpkv.controller.stepkernels", "tpkv.controller.plankernels",
                      "tpkv.controller.rowkernels")
MAX_PROCESSES = 12
# Fewer cores than this: no pool. In CPU seconds on a 2-core VM, 23 kernels with their callees:
# 11-12 s compiled in the process; in 12 processes 2.7 s until the last is done but 26 s in all
# (each spent ~0.6 s before it compiled, before they were forked from one interpreter: now
# ~19 s in all; and a callee compiles again in every process that compiles one of its
# callers). With 2 processes: 9 s (on a busy machine, slower than one).
MIN_PROCESSES = 3
TIMEOUT_S = 300.0
# numba compiles its sort for each caller: ~1.1 s of CPU, what ~1500 bytes of a kernel's own
# code take (merged_copies, 918 bytes with its argsort, compiled in 1.5-1.7 s, longer than
# walk_prepared's 2326 bytes in 0.9-1.3 s)
SORT_BYTES = 1500
_SORTS = frozenset({"sort", "argsort", "lexsort"})

_LOCK = threading.Lock()
_DONE = threading.Event()
_STARTED = False
_REPORT: dict[str, Any] = {}


def report() -> dict[str, Any]:
    """What this process's pool did: {} when none ran, else processes, wall_s, the seconds
    (wall from the pool's start, and CPU) until each process could compile (ready_s,
    ready_cpu_s; ready_parts_s: until imported, dry run, compiler warmed), per kernel: seconds
    (wall and CPU), signatures, child and end_s (from the pool's start), each process's end
    (ends_s, from the caller's start of ensure), when the caller read the signatures and how
    many overloads it loaded while the pool ran (loaded_during, load_during_s)."""
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
    """The kernels, longest code first (with their callees'; a numpy sort counts as
    SORT_BYTES more): the order the pool takes them."""
    def size(n: str) -> int:
        codes = [disps[c].py_func.__code__ for c in [n, *callees(disps, n)]]
        return sum(len(c.co_code) + SORT_BYTES * len(_SORTS & set(c.co_names)) for c in codes)

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
            _spawn_and_wait(config, modules, n, work, started, disps)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _spawn_and_wait(config: TpkvConfig | None, modules: tuple[str, ...], n: int, work: Path,
                    started: float, disps: dict[str, Any]) -> None:
    import numba

    (work / "job").write_bytes(pickle.dumps((config, modules)))
    (work / "claims").mkdir()
    env = dict(os.environ)
    chosen = getattr(numba.config, "CACHE_DIR", "")  # also one tpkv.numba_cache set at run time
    if chosen:
        env["NUMBA_CACHE_DIR"] = str(chosen)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # no BLAS
    root = str(Path(__file__).resolve().parents[1])  # the same tpkv as this process's
    code = (f"import sys; sys.path.insert(0, {root!r}); "
            "from tpkv.kernel_pool_child import start; start(sys.argv[1], int(sys.argv[2]))")
    proc = None
    try:  # its own process group: what it forks ends with it (os.killpg)
        with open(work / "out", "wb") as out, open(work / "err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(work), str(n)], env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
    except OSError as exc:  # no processes here (a sandbox, limits)
        log.info("kernel pool: no process started (%s)", exc)
    undo = lock_saves(work / "save.lock")  # what this process compiles meanwhile: as theirs
    pool = _Watch(work, n, started, disps)
    try:
        if proc is not None:
            pool.run(proc, time.monotonic() + TIMEOUT_S)
    finally:  # none outlives this call: what compiles after it must not race their saves
        if proc is not None and proc.poll() != 0:  # killed, failed or running: its children too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        undo()
    _REPORT.update(processes=n if proc is not None else 0, wall_s=time.perf_counter() - started,
                   **pool.report())
    from tpkv import startup

    startup.add("kernel_pool", time.perf_counter() - started)


class _Watch:
    """Follows the pool until its first process has ended (it waits for those it forked):
    reads the line each process prints per kernel it compiled and loads that kernel here from
    numba's cache at once (with the signatures the dry run left in the work directory), so
    that little is left to load when the last one ends. Only kernels a process reported: their
    cache entries are written."""

    def __init__(self, work: Path, n: int, started: float, disps: dict[str, Any]) -> None:
        self.work, self.n, self.started, self.disps = work, n, started, disps
        self.seen = [0] * n  # bytes of each one's output read
        self.ready: dict[int, dict[str, float]] = {}
        self.tasks: list[dict[str, Any]] = []
        self.ends: dict[int, float] = {}
        self.sigs: dict[str, list[tuple]] | None = None
        self.sigs_s: float | None = None
        self.waiting: list[str] = []  # reported before the signatures were read
        self.loaded = 0
        self.load_s = 0.0

    def run(self, p: Any, deadline: float) -> None:
        while True:
            rc = p.poll()
            if rc is None and time.monotonic() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            for i in range(self.n):
                self._read(i, final=rc is not None)
            if rc is not None:
                break
            time.sleep(0.01)
        if rc != 0:
            errs = [self.work / f for f in ["err", *(f"err{i}" for i in range(self.n))]]
            log.warning("kernel pool exited with %s: %s", rc, "\n".join(
                f.read_text()[-2000:] for f in errs if f.exists() and f.stat().st_size))

    def _read(self, i: int, final: bool) -> None:
        try:
            with open(self.work / f"out{i}", "rb") as f:
                f.seek(self.seen[i])
                chunk = f.read()
        except OSError:
            return
        end = len(chunk) if final else chunk.rfind(b"\n") + 1  # whole lines only
        self.seen[i] += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # cut short by a kill
                continue
            if "kernel" in rec:
                self.tasks.append({**rec, "child": i})
                self._load(rec["kernel"])
            elif "ready_s" in rec:
                self.ready[i] = rec
            elif "exit_s" in rec:
                self.ends[i] = time.perf_counter() - self.started

    def _load(self, name: str) -> None:
        if self.sigs is None:
            try:
                self.sigs = pickle.loads((self.work / "sigs").read_bytes())
                self.sigs_s = time.perf_counter() - self.started
            except (OSError, ValueError, EOFError, pickle.UnpicklingError):
                self.waiting.append(name)
                return
        t = time.perf_counter()
        for n in [*self.waiting, name]:
            for sig in self.sigs.get(n, []):
                try:
                    self.disps[n].compile(sig)  # numba's cache holds it: a load
                    self.loaded += 1
                except Exception:  # the warm-ups compile it later, as without the pool
                    log.debug("loading %s%s after the pool compiled it failed", n, sig,
                              exc_info=True)
        self.waiting.clear()
        self.load_s += time.perf_counter() - t

    def report(self) -> dict[str, Any]:
        order = sorted(self.ready)
        return {"ready_s": [self.ready[i]["ready_s"] for i in order],
                "ready_cpu_s": [self.ready[i]["ready_cpu_s"] for i in order],
                "ready_parts_s": [{k: v for k, v in self.ready[i].items()
                                   if k not in ("ready_s", "ready_cpu_s")} for i in order],
                "kernels": self.tasks, "ends_s": [self.ends.get(i) for i in range(self.n)],
                "signatures_read_s": self.sigs_s,
                "loaded_during": self.loaded, "load_during_s": self.load_s}


def lock_saves(path: Path) -> Callable[[], None]:
    """Make this process's numba save cache entries under an flock of `path`, which all the
    pool's processes share; returns what undoes it. numba saves an overload by reading the
    function's index, picking the first free data file name, and writing both back: two
    processes saving overloads of one function at once (a callee that two callers compile)
    would both pick the same name and one index would lose the other's entry, or point at the
    other's code."""
    from numba.core.caching import IndexDataCacheFile

    unlocked = IndexDataCacheFile.save

    def save(self: Any, key: Any, data: Any) -> None:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            unlocked(self, key, data)

    setattr(IndexDataCacheFile, "save", save)  # noqa: B010 (mypy: no method assignment)
    return lambda: setattr(IndexDataCacheFile, "save", unlocked)  # noqa: B010


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
