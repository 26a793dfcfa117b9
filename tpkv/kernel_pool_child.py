"""The kernel pool's processes (see tpkv.kernel_pool). One interpreter imports the kernels and
forks the others from itself, so that they neither import nor set up numba's compiler again:
process 0 right after the imports, to dry-run the warm-ups (the argument types of each kernel),
which it leaves in the work directory; the rest once numba's compiler is warm. Each then claims
and compiles kernels into numba's cache. Started by the pool by module name only, so the pool
imports nothing above it."""

from __future__ import annotations

import functools
import gc
import inspect
import json
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpkv import kernel_pool
from tpkv.kernel_pool import dispatchers, lock_saves, order

if TYPE_CHECKING:
    from tpkv.config import TpkvConfig

__all__ = ["lock_saves", "signatures", "start", "warm_compiler"]

SIGNATURES_WAIT_S = 60.0  # then a process dry-runs the warm-ups itself


def start(work_dir: str, n: int) -> None:
    """The pool's first process: imports, forks process 0 (the dry run), warms numba's
    compiler, forks processes 1..n-1, compiles nothing itself and waits for all of them; exits
    with 1 if one failed (its traceback in work/err<i>)."""
    started = time.perf_counter()
    from tpkv.startup import gc_paused

    kernel_pool._STARTED = True  # the warm-ups it runs never start a pool of their own
    kernel_pool._DONE.set()
    work = Path(work_dir)
    with gc_paused():
        config, modules = pickle.loads((work / "job").read_bytes())
        disps = dispatchers(modules)
    parts = {"imported_s": time.perf_counter() - started}
    gc.freeze()  # what exists now stays shared with the forks (no collection touches it)
    parts["start_cpu_s"] = time.process_time()  # of this process, before the fork
    pids = [_fork(work, 0, functools.partial(_compile, work, 0, config, disps, started,
                                             dict(parts)))]
    t = time.perf_counter()
    with gc_paused():
        warm_compiler()
    parts["warm_compiler_s"] = time.perf_counter() - t
    parts["start_cpu_s"] = time.process_time()
    gc.freeze()
    pids += [_fork(work, i, functools.partial(_compile, work, i, config, disps, started, parts))
             for i in range(1, n)]
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    sys.exit(1 if failed else 0)


def _fork(work: Path, i: int, body: Callable[[], None]) -> int:
    """Run body in a forked process with stdout and stderr in work/out<i>, work/err<i>."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        for fd, name in ((1, f"out{i}"), (2, f"err{i}")):
            f = os.open(work / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        body()
        rc = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # not the parent's exit path


def _compile(work: Path, index: int, config: TpkvConfig | None, disps: dict[str, Any],
             started: float, parts: dict[str, float]) -> None:
    """A forked pool process: process 0 runs the dry run (and then warms the compiler), the
    others wait for its signatures; then each claims and compiles kernels until none is left."""
    if index == 0:
        sigs = _dry_run(config, disps, work)
        parts = {**parts, "dry_run_s": time.perf_counter() - started}
        warm_compiler()
    else:
        sigs = _wait_for_signatures(config, disps, work)
    print(json.dumps({"ready_s": time.perf_counter() - started,  # from the pool's start
                      "ready_cpu_s": parts["start_cpu_s"] + time.process_time(), **parts}),
          flush=True)
    lock_saves(work / "save.lock")
    for name in order(disps):
        if not sigs.get(name):
            continue
        try:
            os.close(os.open(work / "claims" / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        t, cpu = time.perf_counter(), time.process_time()
        for sig in sigs[name]:
            disps[name].compile(sig)
        print(json.dumps({"kernel": name, "signatures": len(sigs[name]),
                          "s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu,
                          "end_s": time.perf_counter() - started}), flush=True)
    print(json.dumps({"exit_s": time.perf_counter() - started}), flush=True)


def _dry_run(config: TpkvConfig | None, disps: dict[str, Any],
             work: Path) -> dict[str, list[tuple]]:
    """signatures(), written to work/sigs for the others (an empty dict if the dry run
    fails: they then compile nothing, and the caller's warm-ups compile in its process)."""
    sigs: dict[str, list[tuple]] = {}
    try:
        sigs = signatures(config, disps)
    finally:
        tmp = work / "sigs.tmp"
        tmp.write_bytes(pickle.dumps(sigs))
        os.replace(tmp, work / "sigs")  # whole or absent to a reader
    return sigs


def _wait_for_signatures(config: TpkvConfig | None, disps: dict[str, Any],
                         work: Path) -> dict[str, list[tuple]]:
    """Process 0's signatures once written; its own dry run if none came in
    SIGNATURES_WAIT_S (process 0 was killed, or never started)."""
    deadline = time.monotonic() + SIGNATURES_WAIT_S
    while time.monotonic() < deadline:
        try:
            found: dict[str, list[tuple]] = pickle.loads((work / "sigs").read_bytes())
            return found
        except FileNotFoundError:
            time.sleep(0.005)
    return signatures(config, disps)


def warm_compiler() -> None:
    """Compile (not cached) a small function of the features the kernels use (arrays made,
    indexed, sliced and copied, loops, floats, a tuple returned), so that numba's compiler has
    set itself up (~0.5 s of CPU on the 2-core VM, 1-1.5 s of a pool process's first compile
    on the GPU host) once, in the pool's first process, before it forks the others: their
    first kernel then compiles about as fast as a later one."""
    import numpy as np
    from numba import njit

    @njit(nogil=True, boundscheck=False)
    def sample(a: np.ndarray, n: int) -> tuple[np.ndarray, bool]:
        out = np.empty(n, dtype=np.int64)
        k = 0
        for i in range(min(n, len(a))):
            if a[i] > 0.5 or a[i] != a[i]:
                out[k] = i
                k += 1
        return out[:k].copy(), k > 0

    sample(np.zeros(3), 3)


def signatures(config: TpkvConfig | None, disps: dict[str, Any]) -> dict[str, list[tuple]]:
    """The argument types each kernel in `disps` is called with from Python by the warm-ups
    (the worker's, and the controller's for `config`), found by running the warm-ups on the
    kernels' Python bodies (nothing is compiled). Patches every tpkv module for the run: only
    for a pool process."""

    from numba import types
    from numba.extending import _Intrinsic

    from tpkv.controller import warm
    from tpkv.controller.controller import Controller
    from tpkv.errors import TpkvError
    from tpkv.workers import kernels

    found: dict[str, list[tuple]] = {}
    depth = [0]

    def recorder(name: str, d: Any) -> Any:
        params = list(inspect.signature(d.py_func).parameters.values())

        def call(*args: Any, **kws: Any) -> Any:
            if depth[0] == 0:
                bound = inspect.signature(d.py_func).bind(*args, **kws).arguments
                sig = tuple(d.typeof_pyval(bound[p.name]) if p.name in bound
                            else types.Omitted(p.default) for p in params)
                if sig not in found.setdefault(name, []):
                    found[name].append(sig)
            depth[0] += 1
            try:
                return d.py_func(*args, **kws)
            finally:
                depth[0] -= 1
        return call

    def nothing(*args: Any) -> None:
        return None

    wrappers = {id(d): recorder(n, d) for n, d in disps.items()}
    undo: list[tuple[Any, str, Any]] = []
    for mod in [m for k, m in sys.modules.items() if k.startswith("tpkv.")]:
        for k, v in list(vars(mod).items()):
            if id(v) in wrappers or isinstance(v, _Intrinsic):  # prefetch: no Python body
                undo.append((mod, k, v))
                setattr(mod, k, wrappers.get(id(v), nothing))
    try:
        kernels.warm()
        if config is not None:
            try:
                warm._script(config, functools.partial(Controller, warm=False))
            except TpkvError:  # as warm_kernels: the tiny tiers refused a step; what ran is typed
                pass
    finally:  # numba compiles a kernel against its module's globals: the dispatchers again
        for mod, k, v in undo:
            setattr(mod, k, v)
    return found
