"""A kernel pool process (see tpkv.kernel_pool): dry-runs the warm-ups to learn each kernel's
argument types, then claims and compiles kernels into numba's cache. Started by the pool by
module name only, so the pool imports nothing above it."""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpkv import kernel_pool
from tpkv.kernel_pool import dispatchers, order

if TYPE_CHECKING:
    from tpkv.config import TpkvConfig


def child(work_dir: str) -> None:
    """A pool process: dry run, then claim and compile kernels until none is left."""
    started = time.perf_counter()
    from tpkv.startup import gc_paused

    kernel_pool._STARTED = True  # the warm-ups it runs never start a pool of their own
    kernel_pool._DONE.set()
    work = Path(work_dir)
    with gc_paused():
        config, modules = pickle.loads((work / "job").read_bytes())
        disps = dispatchers(modules)
        sigs = signatures(config, disps)
    print(json.dumps({"ready_s": time.perf_counter() - started,  # from its start
                      "ready_cpu_s": time.process_time()}), flush=True)
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
                          "s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}),
              flush=True)


def lock_saves(path: Path) -> None:
    """Make this process's numba save cache entries under an flock of `path`, which all the
    pool's processes share. numba saves an overload by reading the function's index, picking
    the first free data file name, and writing both back: two processes saving overloads of
    one function at once (a callee that two callers compile) would both pick the same name
    and one index would lose the other's entry, or point at the other's code."""
    from numba.core.caching import IndexDataCacheFile

    unlocked = IndexDataCacheFile.save

    def save(self: Any, key: Any, data: Any) -> None:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            unlocked(self, key, data)

    setattr(IndexDataCacheFile, "save", save)  # noqa: B010 (mypy: no method assignment)


def signatures(config: TpkvConfig | None, disps: dict[str, Any]) -> dict[str, list[tuple]]:
    """The argument types each kernel in `disps` is called with from Python by the warm-ups
    (the worker's, and the controller's for `config`), found by running the warm-ups on the
    kernels' Python bodies (nothing is compiled). Patches every tpkv module for the run: only
    for a pool process."""
    import functools

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
