"""The connector's settings (vLLM's kv_connector_extra_config) and the model's identity."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.models.fingerprint import check_fingerprint, checkpoint_digest
from tpkv.settings import check_host, check_token, parse_bytes

GiB = 1 << 30
DEFAULT_HOST_BYTES = 4 * GiB
DEFAULT_DISK_BYTES = 64 * GiB
MAX_DEFAULT_QUEUE_BYTES = GiB
DEFAULT_ASYNC_LOAD_BYTES = 64 << 20
ASYNC_LOAD_MODES = ("auto", "always", "never")
CONTROLLERS = ("local", "ray")
DEFAULT_CONTROLLER_TIMEOUT_S = 2.0
KNOWN_KEYS = ("host_bytes", "model_fingerprint", "disk_dir", "disk_bytes", "disk_queue_bytes",
              "dashboard_port", "dashboard_host", "dashboard_token", "async_loads",
              "async_load_bytes", "controller", "controller_timeout_s")


def _size(name: str, raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ConfigError(f"{name} must be an int or a size like '8GiB', got {raw!r}")
    value = parse_bytes(raw)
    check_int(name, value)
    return value


@dataclass(frozen=True)
class ConnectorOptions:
    """host_bytes: each rank's budget for blocks in host memory (an int or a size like "8GiB");
    disk_dir: a directory for the disk tier (none when not set): blocks the host budget no
    longer holds go there, and a later process with the same directory, model and block size
    loads them; disk_bytes: each rank's budget of record files in it; disk_queue_bytes: the
    part of host_bytes for blocks on their way to disk, written by a background thread (default
    a quarter of host_bytes, at most 1 GiB; 0: written on the step's path); model_fingerprint:
    what identifies the weights in the block keys (derived from the model's name, revision, dtypes,
    parallelism and checkpoint files when not set); dashboard_port: serve tpkv's dashboard of
    this vLLM instance from its scheduler process on that port (0: any free port, logged; not
    set: no dashboard), on dashboard_host (127.0.0.1 unless set), its data behind the bearer
    token dashboard_token (default: TPKV_DASHBOARD_TOKEN when set, else none);
    async_loads: which loads run in the background while vLLM's steps go on, the request
    waiting for them (load_policy.LoadPolicy): "auto" (default) those that read a block from
    the disk tier or load at least async_load_bytes (each rank's bytes, default 64 MiB),
    "always", "never" (every load in the step, copied as the forward's layers ask);
    controller: where the prefix index lives, "local" (default: in the scheduler process) or
    "ray" (in a named Ray actor of this vLLM instance, ray_index.py, in the Ray cluster the
    process is in, finds with address "auto", or starts; the scheduler asks it once a step,
    remote_index.py);
    controller_timeout_s: with "ray", how long a step waits for the actor (default 2 s) before
    it goes on without the index (nothing matches, nothing new is stored) until the actor is
    back."""

    host_bytes: int = DEFAULT_HOST_BYTES
    model_fingerprint: str | None = None
    disk_dir: str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    disk_queue_bytes: int | None = None
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"
    dashboard_token: str | None = None
    async_loads: str = "auto"
    async_load_bytes: int = DEFAULT_ASYNC_LOAD_BYTES
    controller: str = "local"
    controller_timeout_s: float = DEFAULT_CONTROLLER_TIMEOUT_S

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has keys tpkv does not know: {unknown}; "
                              f"known: {list(KNOWN_KEYS)}")
        host_bytes = _size("host_bytes", extra.get("host_bytes", DEFAULT_HOST_BYTES))
        disk_bytes = _size("disk_bytes", extra.get("disk_bytes", DEFAULT_DISK_BYTES))
        disk_dir = extra.get("disk_dir")
        if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir.strip()
                                     or "\0" in disk_dir):
            raise ConfigError(f"disk_dir must be a directory path, got {disk_dir!r}")
        if disk_dir is None and "disk_bytes" in extra:
            raise ConfigError(f"disk_bytes is {extra['disk_bytes']!r} but disk_dir is not set; "
                              f"set disk_dir to turn the disk tier on")
        queue = extra.get("disk_queue_bytes")
        if queue is not None:
            if disk_dir is None:
                raise ConfigError(f"disk_queue_bytes is {queue!r} but disk_dir is not set; "
                                  f"set disk_dir to turn the disk tier on")
            queue = 0 if queue == 0 and type(queue) is int else _size("disk_queue_bytes", queue)
            if queue >= host_bytes:
                raise ConfigError(f"disk_queue_bytes {queue} must be below host_bytes "
                                  f"{host_bytes}: it is the part of it for blocks on their "
                                  f"way to disk")
        fp = extra.get("model_fingerprint")
        port, host, token = _dashboard(extra)
        mode = extra.get("async_loads", "auto")
        if mode not in ASYNC_LOAD_MODES:
            raise ConfigError(f"async_loads must be one of {list(ASYNC_LOAD_MODES)}, got {mode!r}")
        raw = extra.get("async_load_bytes", DEFAULT_ASYNC_LOAD_BYTES)
        min_bytes = 0 if raw == 0 and type(raw) is int else _size("async_load_bytes", raw)
        controller, timeout_s = _controller(extra)
        return cls(host_bytes, None if fp is None else check_fingerprint(fp), disk_dir,
                   disk_bytes, queue, port, host, token, mode, min_bytes, controller, timeout_s)


def _controller(extra: Mapping[str, Any]) -> tuple[str, float]:
    """controller and controller_timeout_s, checked (see ConnectorOptions)."""
    controller = extra.get("controller", "local")
    if controller not in CONTROLLERS:
        raise ConfigError(f"controller must be one of {list(CONTROLLERS)}, got {controller!r}")
    timeout_s = extra.get("controller_timeout_s", DEFAULT_CONTROLLER_TIMEOUT_S)
    if "controller_timeout_s" in extra and controller != "ray":
        raise ConfigError(f"controller_timeout_s is {timeout_s!r} but controller is "
                          f"{controller!r}; it is the bound on calls to the 'ray' controller")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            0 < timeout_s <= 3600):
        raise ConfigError(f"controller_timeout_s must be seconds in (0, 3600], "
                          f"got {timeout_s!r}")
    return controller, float(timeout_s)


def _dashboard(extra: Mapping[str, Any]) -> tuple[int | None, str, str | None]:
    """dashboard_port, dashboard_host, dashboard_token, checked (see ConnectorOptions)."""
    port = extra.get("dashboard_port")
    if port is None:
        given = [k for k in ("dashboard_host", "dashboard_token") if k in extra]
        if given:
            raise ConfigError(f"{given[0]} is set but dashboard_port is not; set dashboard_port "
                              f"(0: any free port) to serve the dashboard")
        return None, "127.0.0.1", None
    if type(port) is not int or not 0 <= port <= 65535:
        raise ConfigError(f"dashboard_port must be an int in 0..65535 (0: any free port), "
                          f"got {port!r}")
    host = check_host("dashboard_host", extra.get("dashboard_host", "127.0.0.1"))
    token = extra.get("dashboard_token", os.environ.get("TPKV_DASHBOARD_TOKEN") or None)
    return port, host, None if token is None else check_token("dashboard_token", token)


def queue_bytes_in_effect(host_bytes: int, queue_bytes: int | None) -> int:
    """disk_queue_bytes as set, or its default: a quarter of host_bytes, at most 1 GiB."""
    return min(host_bytes // 4, MAX_DEFAULT_QUEUE_BYTES) if queue_bytes is None else queue_bytes


def write_queue_blocks(host_bytes: int, queue_bytes: int | None, block_bytes: int) -> int:
    """Blocks of the host budget kept for blocks on their way to disk (0: none, the moves to
    disk are written on the step's path); ConfigError when they leave no block for memory."""
    queue_bytes = queue_bytes_in_effect(host_bytes, queue_bytes)
    blocks = queue_bytes // block_bytes
    if blocks and blocks >= host_bytes // block_bytes:
        raise ConfigError(f"disk_queue_bytes {queue_bytes} ({blocks} blocks of {block_bytes} "
                          f"bytes) leaves no room in host_bytes {host_bytes} "
                          f"({host_bytes // block_bytes} blocks)")
    return blocks


def instance_id(engine_id: Any) -> str:
    """Which vLLM instance this is, for its own prefix index (ray_index.actor_name): vLLM's
    kv_transfer_config.engine_id (a new uuid per instance unless set, with "_dp<rank>" added
    per data parallel rank), or a new random id when it is not set. Made once, in the
    scheduler's connector, and kept for the instance's life."""
    if isinstance(engine_id, str) and engine_id:
        return engine_id
    return f"tpkv-{uuid.uuid4().hex}"


def vllm_fingerprint(vllm_config: Any, options: ConnectorOptions) -> str:
    """The set fingerprint, else one made of what decides the KV a model writes: model path or
    name, revision, dtype, KV cache dtype, tensor and pipeline parallel sizes, and the digest of
    the checkpoint files when the model is a local directory."""
    if options.model_fingerprint is not None:
        return options.model_fingerprint
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    model = str(mc.model)
    files = checkpoint_digest(model) if os.path.isdir(model) else None
    return (f"vllm|model={model}|rev={getattr(mc, 'revision', None)}|dtype={mc.dtype}"
            f"|kv={vllm_config.cache_config.cache_dtype}|tp={pc.tensor_parallel_size}"
            f"|pp={pc.pipeline_parallel_size}|files={files}")


@dataclass(frozen=True)
class DiskSpec:
    """The disk tier a rank opens once it knows its block shape: directory, byte cap, the
    model's chain seed and fingerprint, tokens per block, and the part of the host budget for
    blocks queued for the background writer (None: the default, 0: written on the step's
    path)."""

    root: str
    capacity_bytes: int
    seed: bytes
    block_tokens: int
    model_fingerprint: str = ""
    queue_bytes: int | None = None  # host bytes for blocks on their way to disk (options.py)
