"""The prefix index as a named Ray actor (IndexService), and the transport RemoteIndex uses.

One actor per vLLM instance: its name is made of the chain seed (model fingerprint and block
size), the disk tier's directory and the instance (IndexSpec.instance: vLLM's engine_id), so two
instances in one Ray cluster, on one model and one disk directory, each have an index of their
own: each index holds the blocks of its own instance's host tier, which no other instance can
load. The disk tier is found by any instance: an actor builds its index from the records in
the directory when it starts. The actor runs in the Ray cluster this process is in, or joins
(address "auto"), or else starts a local one; it restarts under the same name when it dies
(max_restarts=-1) and then rebuilds its index from the disk tier; killed for good, the
scheduler makes it anew by the same name (RayTransport.reconnect). It is not detached: Ray ends
it with the process that made it (the instance's scheduler), and the connector's shutdown
kills it (RayTransport.close), so a gone instance leaves no actor behind. Requests and answers
are msgpack bytes (tpkv.protocol.wire); the spec it is made from too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import xxhash

from tpkv.controller.actor import NAMESPACE
from tpkv.errors import IndexUnavailableError
from tpkv.integrations.index_service import IndexService, IndexSpec
from tpkv.protocol.wire import encode
from tpkv.ray_notice import quiet_token_notice

log = logging.getLogger(__name__)

NAME_PREFIX = "tpkv-vllm-index-"


def actor_name(spec: IndexSpec) -> str:
    """The actor's name for this index: model, block size, disk tier directory and instance."""
    disk = os.path.realpath(spec.disk_dir) if spec.disk_dir is not None else ""
    return NAME_PREFIX + xxhash.xxh3_128_hexdigest(encode([spec.seed, disk, spec.instance]))


def join_ray() -> bool:
    """Join the Ray cluster of this machine (address "auto", as RAY_ADDRESS or a running
    `ray start` names it) or start a local one on 127.0.0.1, unless this process is in one
    already; whether it called ray.init."""
    if ray.is_initialized():
        return False
    quiet_token_notice()
    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    except ConnectionError:
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING,
                 _node_ip_address="127.0.0.1")
    return True


def get_or_create(spec: IndexSpec) -> Any:
    """The index's actor, made on first use (it builds its index from the disk tier)."""
    cls: Any = ray.remote(num_cpus=0, max_restarts=-1)(IndexService)
    return cls.options(name=actor_name(spec), namespace=NAMESPACE,
                       get_if_exists=True).remote(spec.to_bytes())


class RayTransport:
    """RemoteIndex's calls on the actor; every Ray failure is an IndexUnavailableError."""

    def __init__(self, spec: IndexSpec) -> None:
        self.spec = spec
        self.joined = join_ray()
        self.handle: Any = get_or_create(spec)

    def send(self, payload: bytes) -> Any:
        try:
            return self.handle.call.remote(payload)
        except Exception as exc:  # Ray raises many kinds here: all mean "not now"
            raise IndexUnavailableError(f"index actor not reached: {exc}") from exc

    def ready(self, handle: Any) -> bool:
        try:
            done, _ = ray.wait([handle], timeout=0)
        except Exception as exc:
            raise IndexUnavailableError(f"index actor not reached: {exc}") from exc
        return bool(done)

    def result(self, handle: Any, timeout_s: float) -> bytes:
        try:
            answer = ray.get(handle, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise IndexUnavailableError(f"index actor did not answer within {timeout_s:g} s"
                                        ) from exc
        except ray.exceptions.RayError as exc:
            raise IndexUnavailableError(f"index actor failed: {type(exc).__name__}") from exc
        if not isinstance(answer, bytes):
            raise IndexUnavailableError(f"index actor answered {type(answer).__name__}")
        return answer

    def reconnect(self) -> None:
        try:
            self.handle = get_or_create(self.spec)
        except Exception as exc:  # Ray raises many kinds here: all mean "not now"
            raise IndexUnavailableError(f"index actor not found or made: {exc}") from exc

    def close(self) -> None:
        """Kill the actor for good (the instance is shutting down); never raises."""
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception as exc:  # already dead, or Ray shut down: nothing is left to end
            log.debug("tpkv index actor not killed at close: %s", exc)
