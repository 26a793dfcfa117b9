"""One rank's start-up: process groups, rendezvous store and heartbeats, and the Ray controller."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpkv.config import TpkvConfig
from tpkv.errors import ConfigError, LaunchError
from tpkv.settings import env_flag
from tpkv.workers.confirm import BoundedGroup
from tpkv.workers.liveness import Liveness

log = logging.getLogger(__name__)

# Set by launchers that host the rendezvous store themselves (tpkv launch, the test harness):
# every rank is then a store client, so any rank may die without taking the store with it.
EXTERNAL_STORE_ENV = "TPKV_EXTERNAL_STORE"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class RankContext:
    """What one rank knows about its TP group once the groups are up."""

    rank: int
    world_size: int
    local_rank: int
    ctl: BoundedGroup  # gloo: plans, resync maps, barriers (main thread)
    confirm: BoundedGroup  # the all-gather confirmations (async, beside compute)
    liveness: Liveness | None
    owns_default_group: bool

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an "
                          f"integer") from exc


def _external_store() -> bool:
    return (env_flag(EXTERNAL_STORE_ENV, False)
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def init_groups(config: TpkvConfig, device: torch.device) -> RankContext:
    """Join (or form, from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) the default process group,
    then make tpkv's own gloo groups; every rank of the TP group must call this."""
    timeout = timedelta(seconds=config.wait_timeout_s)
    store: Any = None
    host_rank: int | None = None
    owns = False
    if not dist.is_initialized():
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ and world > 1:
            raise LaunchError(f"rank {rank} of {world}: MASTER_PORT is not set; start with "
                              f"torchrun or `tpkv launch`, or set MASTER_ADDR/MASTER_PORT")
        port = _env_int("MASTER_PORT", 0) or free_port()
        master = rank == 0 and not _external_store()
        host_rank = None if _external_store() else 0
        try:
            store = dist.TCPStore(addr, port, world if master else None, master, timeout,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise LaunchError(f"rank {rank}: rendezvous store at {addr}:{port} not reachable "
                              f"within {config.wait_timeout_s:g} s: {exc}") from exc
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
        owns = True
    elif "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  None, False, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            log.warning("no store for heartbeats (%s): failures will not name ranks", exc)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = config.geometry.tp_size
    if world != tp:
        raise ConfigError(f"the process group has {world} ranks but geometry.tp_size is {tp}; "
                          f"tpkv runs one TP group per node (world size = tp_size)")
    ctl_pg = dist.new_group(backend="gloo", timeout=timeout)
    backend = config.confirm_backend
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("confirm_backend='nccl' needs CUDA; use 'gloo' or 'auto'")
    confirm_pg = dist.new_group(backend="nccl" if backend == "nccl" else "gloo",
                                timeout=timeout)
    ctl = BoundedGroup(ctl_pg, rank, world, config.wait_timeout_s, None, "ctl")
    run_id = ctl.broadcast_bytes(uuid.uuid4().hex.encode() if rank == 0 else None,
                                 what="run id").decode()
    liveness = None
    if store is not None and world > 1:
        interval = min(config.heartbeat_s, config.wait_timeout_s / 8)
        liveness = Liveness(store, rank, world, interval, f"tpkv/{run_id}", host_rank)
    ctl.liveness = liveness
    ctl.barrier("start-up barrier")  # every rank beats before anyone relies on it
    confirm_device = device if backend == "nccl" else torch.device("cpu")
    confirm = BoundedGroup(confirm_pg, rank, world, config.wait_timeout_s, liveness,
                           "confirm", confirm_device)
    return RankContext(rank, world, _env_int("LOCAL_RANK", rank), ctl, confirm, liveness, owns)


def connect_ray(config: TpkvConfig, ctx: RankContext) -> tuple[Any, bool, int]:
    """Rank 0 starts a local Ray head (or joins config.ray_address, or the Ray it runs in) and
    creates the named controller; the others join the same cluster and find it by name.
    Rank 0 prints the dashboard's URL when it created the controller (once per controller);
    a controller rank 0 created ends with its runtime (the client is `owned`).
    Returns (ControllerClient, whether this process called ray.init, the next epoch)."""
    import ray

    from tpkv.controller import actor
    from tpkv.ray_notice import quiet_token_notice

    joined = not ray.is_initialized()
    if joined:
        quiet_token_notice()
    created = False
    if ctx.rank == 0:
        if joined:
            ray.init(address=config.ray_address or "local", namespace=actor.NAMESPACE,
                     include_dashboard=False, log_to_driver=False)
        created = not _controller_exists(actor.NAME, actor.NAMESPACE)
        handle = actor.get_or_create(config)
        ray.get(handle.ping.remote(), timeout=config.wait_timeout_s)
        # A local head enables Ray's token auth for this process (RAY_AUTH_MODE, token file in
        # ~/.ray): ranks joining it on this node need the same mode.
        info = {"gcs": ray.get_runtime_context().gcs_address,
                "auth_mode": os.environ.get("RAY_AUTH_MODE")}
        ctx.ctl.broadcast_bytes(json.dumps(info).encode(), what="Ray address")
    else:
        info = json.loads(ctx.ctl.broadcast_bytes(None, what="Ray address"))
        if joined:
            if info["auth_mode"] and "RAY_AUTH_MODE" not in os.environ:
                _set_ray_auth_mode(info["auth_mode"])
            ray.init(address=info["gcs"], namespace=actor.NAMESPACE, log_to_driver=False)
        handle = actor.get_existing(timeout_s=config.wait_timeout_s)
    client = actor.ControllerClient(handle, timeout_s=config.wait_timeout_s)
    client.owned = ctx.rank == 0 and created
    if ctx.rank == 0 and created:
        print(f"tpkv: {dashboard_line(client)}", file=sys.stderr, flush=True)
    answer = client.register_rank(rank=ctx.rank, geometry=dataclasses.asdict(config.geometry),
                                  host=socket.gethostname())
    return client, joined, int(answer["next_epoch"])


def _controller_exists(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def dashboard_line(client: Any) -> str:
    """Where the controller's dashboard is (or why there is none), for the console."""
    try:
        info = client.dashboard()
    except Exception as exc:  # the app runs on without it
        return f"dashboard unknown ({type(exc).__name__}: {exc})"
    if not info.get("url"):
        return f"no dashboard: {info.get('error')}"
    token = " (needs the bearer token: open it with #token=<token>)" \
        if info.get("token_required") else ""
    return f"dashboard at {info['url']}{token}; `tpkv status` shows it in the terminal"


def _set_ray_auth_mode(mode: str) -> None:
    """RAY_AUTH_MODE for this process; Ray reads it into its config once, so refresh that."""
    os.environ["RAY_AUTH_MODE"] = mode
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    except (ImportError, AttributeError) as exc:  # older Ray: no token auth to set up
        log.debug("Ray config not refreshed: %s", exc)


def shutdown_ray(ctx: RankContext, joined: bool) -> None:
    """Ranks that joined leave first; rank 0 (which may have started a local head) last."""
    import ray

    ctx.ctl.barrier("Ray shutdown")
    if ctx.rank != 0 and joined and ray.is_initialized():
        ray.shutdown()
    ctx.ctl.barrier("Ray shutdown (joined ranks gone)")
    if ctx.rank == 0 and joined and ray.is_initialized():
        ray.shutdown()
