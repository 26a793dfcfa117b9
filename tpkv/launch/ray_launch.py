"""`tpkv launch`: a Ray placement group of one bundle per TP rank, an actor per bundle, the app."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from tpkv.errors import ConfigError, LaunchError
from tpkv.launch import stop
from tpkv.launch.bootstrap import EXTERNAL_STORE_ENV
from tpkv.ray_notice import quiet_token_notice
from tpkv.settings import tpkv_env

log = logging.getLogger(__name__)
AppSpec = str | Callable[..., Any]


def resolve_app(spec: AppSpec) -> Callable[..., Any]:
    """"package.module:function", "path/to/app.py:function", or a callable."""
    if callable(spec):
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"app {spec!r} must look like module:function or file.py:function")
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        loader_spec = importlib.util.spec_from_file_location(f"tpkv_app_{uuid.uuid4().hex}",
                                                             path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError(f"cannot load app file {path!r}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"app {spec!r}: {module_name} has no function {attr!r}")
    return fn


class RankActor:
    """One TP rank: joins the torch.distributed group (the launcher hosts the store), runs the
    app, leaves the group. LOCAL_RANK is 0 on a GPU: Ray shows each actor only its own GPU."""

    def run(self, app: AppSpec, rank: int, world: int, addr: str, port: int,
            sys_path: Sequence[str], args: Sequence[Any], env: Mapping[str, str],
            use_gpu: bool, timeout_s: float) -> Any:
        import torch.distributed as dist

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr,
                          MASTER_PORT=str(port), LOCAL_RANK="0" if use_gpu else str(rank),
                          **{EXTERNAL_STORE_ENV: "1"}, **dict(env))
        sys.path[:0] = [p for p in sys_path if p not in sys.path]
        store = dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        backend = "cpu:gloo,cuda:nccl" if use_gpu else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            return resolve_app(app)(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def launch_ray(app: AppSpec, tp: int, *, args: Sequence[Any] = (), ray_address: str | None = None,
           num_cpus: int | None = None, use_gpu: bool | None = None,
           env: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> list[Any]:
    """Run `app(*args)` on `tp` ranks as Ray actors of one placement group (one bundle per GPU,
    or per CPU rank where there are no GPUs, packed on one node); returns each rank's value.

    The ranks get this process's TPKV_* variables (checked first: a bad one is a ConfigError
    naming it, before Ray starts), then `env`, so that they read the settings this process
    reads even on another node. Starts a local Ray cluster unless Ray is initialized or
    `ray_address` is given. `timeout_s`
    bounds placement, start-up, and how long the other ranks may take to end once one failed
    (the ranks' own collectives are bounded by TpkvConfig.wait_timeout_s).
    """
    import ray
    import torch.distributed as dist
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
    rank_env = {**tpkv_env(), **dict(env or {})}
    started = False
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        quiet_token_notice()
        local = ray_address in (None, "local")
        cpus = num_cpus if num_cpus is not None else max(tp, os.cpu_count() or 1)
        on_term = signal.getsignal(signal.SIGTERM)
        ray.init(address=ray_address or "local", include_dashboard=False,
                 num_cpus=cpus if local else None)
        started = True
        if threading.current_thread() is threading.main_thread() and on_term is not None:
            signal.signal(signal.SIGTERM, on_term)  # ray.init set its own (sys.exit(15))
    gpus = int(ray.cluster_resources().get("GPU", 0))
    gpu = gpus >= tp if use_gpu is None else use_gpu
    bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
    pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK")
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"placement group of {tp} bundles {bundle} not ready after "
                              f"{timeout_s:g} s; the cluster has {ray.cluster_resources()}"
                              ) from None
        addr = ray.util.get_node_ip_address()
        store = dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        remote_cls: Any = ray.remote(RankActor)
        actors = [remote_cls.options(
            num_cpus=1, num_gpus=1 if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i)).remote() for i in range(tp)]
        path = [os.getcwd() if p == "" else p for p in sys.path]
        refs = [a.run.remote(app, i, tp, addr, store.port, path, list(args), rank_env,
                             gpu, timeout_s) for i, a in enumerate(actors)]
        return _collect(ray, refs, timeout_s)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        if started:
            ray.shutdown()


def _collect(ray: Any, refs: list[Any], timeout_s: float) -> list[Any]:
    """Every rank's value; after the first failure the others get `timeout_s` to end."""
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    failures: dict[int, str] = {}
    pending, deadline = list(refs), None
    while pending:
        # Poll, and sleep in Python between polls: a signal (SIGTERM, Ctrl-C) that arrives
        # inside ray.wait is mishandled there (it hangs, or raises SystemError), while its
        # handler raises Stop cleanly out of time.sleep.
        with stop.deferred():
            done, pending = ray.wait(pending, num_returns=1, timeout=0)
        if not done and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)
            continue
        if not done:
            failures.update({index[r]: f"still running {timeout_s:g} s after a rank failed"
                             for r in pending})
            break
        i = index[done[0]]
        try:
            results[i] = ray.get(done[0])
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc  # a RayTaskError wraps the app's error
            failures[i] = f"{type(cause).__name__}: {str(cause).strip()[:600]}"
            deadline = deadline or time.monotonic() + timeout_s
    if failures:
        lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        raise LaunchError(f"{len(failures)} of {len(refs)} ranks failed: {lines}")
    return results
