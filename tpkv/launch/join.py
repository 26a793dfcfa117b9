"""tpkv.init: join the TP group (torchrun or `tpkv launch`), the controller, and the tiers."""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from tpkv import kernel_pool, startup
from tpkv.config import TpkvConfig, from_env
from tpkv.launch.bootstrap import connect_ray, init_groups
from tpkv.launch.runtime import TpkvRuntime
from tpkv.workers import kernels
from tpkv.workers.worker import Worker

log = logging.getLogger(__name__)


def init(config: TpkvConfig, *, controller: Any = "ray",
         device: torch.device | str | None = None, env: bool = True) -> TpkvRuntime:
    """Join the TP group and tpkv: every rank calls this (under torchrun, or in `tpkv launch`).

    `controller`: "ray" (rank 0 starts or joins Ray and creates the named controller; the others
    find it by name), "local" (an in-process Controller on rank 0, no Ray), or a controller
    object used on rank 0. `env`: lay the TPKV_* variables over `config` (tpkv.settings; a bad
    one is a ConfigError naming it); False for a config that a launcher already built so (the
    demo's: every rank and the controller then use the very same values). Where its time goes:
    `tpkv.startup.times()`.
    """
    with startup.gc_paused():
        return _init(config, controller, device, env)


def _init(config: TpkvConfig, controller: Any, device: torch.device | str | None,
          env: bool) -> TpkvRuntime:
    from tpkv.controller.controller import Controller

    startup.reset()
    if env:
        config = from_env(config)
    _warm_in_background(config, controller == "local" and _rank_hint() == 0)
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    with startup.phase("cuda_context"):
        if device.type == "cuda" and device.index is None:  # "cuda": the current device
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.empty(1, device=device)  # the context now, not in the first allocation
    with startup.phase("process_groups"):
        ctx = init_groups(config, device)
    worker: Worker | None = None
    try:
        joined: bool | None = None
        ctl: Any = None
        next_epoch = 0
        if controller == "ray":  # Ray starts (forks) before L2 is pinned
            with startup.phase("controller"):
                ctl, joined, next_epoch = connect_ray(config, ctx)
        with startup.phase("worker"):
            worker = Worker(config, ctx.rank, device, ctx.confirm)
        if controller != "ray" and ctx.rank == 0:
            with startup.phase("controller"):
                ctl = Controller(config) if controller == "local" else controller
                for r in range(ctx.world_size):
                    answer = ctl.register_rank(rank=r, geometry=asdict(config.geometry),
                                               host="")
                    next_epoch = int(answer["next_epoch"])
        with startup.phase("runtime"):
            rt = TpkvRuntime(config, ctx, worker, ctl, ray_joined=joined)
            worker.epoch = int(rt.from_rank0(lambda: next_epoch, "first epoch")) - 1
        return rt
    except BaseException as exc:
        if ctx.liveness is not None:
            ctx.liveness.fail(f"start-up failed: {type(exc).__name__}: {exc}")
        if worker is not None:  # built before the controller refused: give its tiers back
            try:
                worker.close()
            except Exception:
                log.warning("closing the worker of a failed start-up failed", exc_info=True)
        raise


def _warm_in_background(config: TpkvConfig, local_controller: bool) -> threading.Thread:
    """Load numba's kernels (from its disk cache, or compile them) on a thread while init sets
    up CUDA, the groups and the tiers, which mostly wait in C with the GIL released: the
    worker's, then those of a local controller. The Worker and the Controller wait for them
    (workers.kernels.warm, controller.warm.warm_kernels) only if they are not loaded yet; what
    fails here is logged and done again there."""
    from tpkv.controller.controller import Controller
    from tpkv.controller.warm import warm_kernels

    def run() -> None:
        try:
            kernel_pool.ensure(config if local_controller else None)  # cold cache: in parallel
            try:
                kernels.warm()
            except Exception:
                log.warning("loading the worker's kernels failed", exc_info=True)
            if local_controller:
                warm_kernels(config, functools.partial(Controller, warm=False))
        finally:
            startup.end_quiet()

    startup.hold_quiet()  # L2's background pinning waits for the kernels (startup.wait_quiet)
    t = threading.Thread(target=run, name="tpkv-warm", daemon=True)
    t.start()
    return t


def _rank_hint() -> int:
    """This process's rank as far as known before the groups are up (0 when unknown)."""
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0
