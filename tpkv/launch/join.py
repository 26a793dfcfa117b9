"""tpkv.init: join the TP group (torchrun or `tpkv launch`), the controller, and the tiers."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from tpkv.config import TpkvConfig, from_env
from tpkv.launch.bootstrap import connect_ray, init_groups
from tpkv.launch.runtime import TpkvRuntime
from tpkv.workers.worker import Worker


def init(config: TpkvConfig, *, controller: Any = "ray",
         device: torch.device | str | None = None, env: bool = True) -> TpkvRuntime:
    """Join the TP group and tpkv: every rank calls this (under torchrun, or in `tpkv launch`).

    `controller`: "ray" (rank 0 starts or joins Ray and creates the named controller; the others
    find it by name), "local" (an in-process Controller on rank 0, no Ray), or a controller
    object used on rank 0. `env`: lay the TPKV_* variables over `config` (tpkv.settings; a bad
    one is a ConfigError naming it); False for a config that a launcher already built so (the
    demo's: every rank and the controller then use the very same values).
    """
    from tpkv.controller.controller import Controller

    if env:
        config = from_env(config)
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = init_groups(config, device)
    try:
        joined: bool | None = None
        ctl: Any = None
        next_epoch = 0
        if controller == "ray":
            ctl, joined, next_epoch = connect_ray(config, ctx)
        elif ctx.rank == 0:
            ctl = Controller(config) if controller == "local" else controller
            for r in range(ctx.world_size):
                answer = ctl.register_rank(rank=r, geometry=asdict(config.geometry), host="")
                next_epoch = int(answer["next_epoch"])
        worker = Worker(config, ctx.rank, device, ctx.confirm)
        rt = TpkvRuntime(config, ctx, worker, ctl, ray_joined=joined)
        worker.epoch = int(rt.from_rank0(lambda: next_epoch, "first epoch")) - 1
        return rt
    except BaseException as exc:
        if ctx.liveness is not None:
            ctx.liveness.fail(f"start-up failed: {type(exc).__name__}: {exc}")
        raise
