"""The prefix index as a named Ray actor (IndexService), and the transport RemoteIndex uses.

One actor per vLLM instance: its name is made of the chain seed (model fingerprint and block
size), the disk tier's directory and the instance (IndexSpec.instance: vLLM's engine_id), so two
instances in one Ray cluster, on one model and one disk directory, each have an index of their
own: each index holds the blocks of its own instance's host tier, which no other instance can
load. Each scheduler's transport makes an owner token (uuid4) once and gives it to the actor it
makes, in the constructor's arguments, so an actor Ray restarts keeps it; the actor answers no
call with another token (IndexOwnerError). Two instances given one engine_id by hand therefore
never share an actor: the one that finds a name taken by another live scheduler's actor (asked
at start; a call refused later, after a reconnect) warns and takes a name of its own, the same
name with its token added. The disk tier is found by any instance: an actor builds its index
from the records in the directory when it starts. The actor runs in the Ray cluster this process
is in, or joins (address "auto"), or else starts a local one; it restarts under the same name
when it dies (max_restarts=-1) and then rebuilds its index from the disk tier; killed for good,
the scheduler makes it anew by its name (RayTransport.reconnect). It is not detached: Ray ends
it with the process that made it (the instance's scheduler), and the connector's shutdown kills
it (RayTransport.close: only an actor this transport owns), so a gone instance leaves no actor
behind. Requests and answers are msgpack bytes (tpkv.protocol.wire); the spec it is made from
too, and the owner token is a str beside them.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import ray
import xxhash

from tpkv.controller.actor import NAMESPACE
from tpkv.errors import IndexOwnerError, IndexUnavailableError
from tpkv.integrations.index_service import IndexService, IndexSpec
from tpkv.integrations.vllm.remote_index import START_TIMEOUT_S
from tpkv.protocol.wire import encode
from tpkv.ray_notice import quiet_token_notice

log = logging.getLogger(__name__)

NAME_PREFIX = "tpkv-vllm-index-"
# How long close() asks an actor whose owner it has not seen yet.
CLOSE_ASK_S = 2.0


def actor_name(spec: IndexSpec, owner: str = "") -> str:
    """The actor's name for this index: model, block size, disk tier directory and instance;
    with `owner`, the name of that scheduler's own (its engine_id's name was taken)."""
    disk = os.path.realpath(spec.disk_dir) if spec.disk_dir is not None else ""
    parts: list[Any] = [spec.seed, disk, spec.instance] + ([owner] if owner else [])
    return NAME_PREFIX + xxhash.xxh3_128_hexdigest(encode(parts))


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


def get_or_create(spec: IndexSpec, name: str, owner: str) -> Any:
    """The actor named `name`, made on first use for `owner` (it builds its index from the
    disk tier); one that exists is returned whoever owns it."""
    cls: Any = ray.remote(num_cpus=0, max_restarts=-1)(IndexService)
    return cls.options(name=name, namespace=NAMESPACE,
                       get_if_exists=True).remote(spec.to_bytes(), owner)


class RayTransport:
    """RemoteIndex's calls on the actor; every Ray failure is an IndexUnavailableError.

    An actor under the instance's name that another live scheduler owns is never shared: this
    transport makes one under its own name and warns, rather than fail the start, since a
    restarted instance must come up while Ray has yet to end its predecessor's actor."""

    def __init__(self, spec: IndexSpec) -> None:
        self.spec = spec
        self.owner = uuid.uuid4().hex  # this scheduler's, for the life of the transport
        self.name = actor_name(spec)
        self.joined = join_ray()
        self.mine: bool | None = None  # whether the actor held is known to be this owner's
        self.handle: Any = get_or_create(spec, self.name, self.owner)
        seen = self._ask_owner(START_TIMEOUT_S)  # not seen: a refused call tells later
        self.mine = None if seen is None else seen == self.owner
        if self.mine is False:
            self._foreign(seen)
            self.reconnect()

    def send(self, payload: bytes) -> Any:
        try:
            return self.handle.call.remote(payload, self.owner)
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
            cause = getattr(exc, "cause", None)
            if isinstance(cause, IndexOwnerError):  # the name was taken while ours was gone
                self.mine = False
                self._foreign(None)
                raise IndexOwnerError(str(cause)) from exc
            raise IndexUnavailableError(f"index actor failed: {type(exc).__name__}") from exc
        if not isinstance(answer, bytes):
            raise IndexUnavailableError(f"index actor answered {type(answer).__name__}")
        self.mine = True  # the actor answers its owner only
        return answer

    def reconnect(self) -> None:
        try:
            found = get_or_create(self.spec, self.name, self.owner)
        except Exception as exc:  # Ray raises many kinds here: all mean "not now"
            raise IndexUnavailableError(f"index actor not found or made: {exc}") from exc
        # the actor held, restarted by Ray: keep the handle that made it, since Ray ends a
        # non-detached actor once its maker's handle is gone, whatever handles found it later
        if found._actor_id != self.handle._actor_id:
            self.handle = found  # under our own name ours; else a call or close tells
            self.mine = True if self.name == actor_name(self.spec, self.owner) else None

    def close(self) -> None:
        """Kill the actor for good (the instance is shutting down) if it is this transport's;
        never raises. One not known to be ours is left: another instance's lives on, and ours
        ends with this process."""
        if self.mine is None:
            self.mine = self._ask_owner(CLOSE_ASK_S) == self.owner
        if not self.mine:
            log.debug("tpkv index actor %s not killed at close: not this scheduler's", self.name)
            return
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception as exc:  # already dead, or Ray shut down: nothing is left to end
            log.debug("tpkv index actor not killed at close: %s", exc)

    def _ask_owner(self, timeout_s: float) -> str | None:
        """The owner token of the actor held; None when it does not answer in time."""
        try:
            owner = ray.get(self.handle.owner.remote(), timeout=timeout_s)
        except Exception as exc:  # dead, restarting, slow or Ray shut down: not known
            log.debug("tpkv index actor %s did not tell its owner: %s", self.name, exc)
            return None
        return owner if isinstance(owner, str) else None

    def _foreign(self, owner: str | None) -> None:
        """The actor under the instance's name is another scheduler's: use our own name."""
        own = actor_name(self.spec, self.owner)
        if self.name == own:
            return
        log.warning("tpkv prefix index: the actor of engine_id %r is another running "
                    "scheduler's%s; this one (owner token %s) makes an index actor of its own. "
                    "Give each vLLM instance its own engine_id.", self.spec.instance,
                    f" (owner token {owner})" if owner else "", self.owner)
        self.name = own
