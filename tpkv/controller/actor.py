"""The controller as a named, restartable Ray actor, and a client that speaks msgpack to it.

The only module in tpkv that imports ray. One actor call per step (`schedule`), never one per
block. Arguments and answers cross as msgpack bytes (tpkv.types.encode/decode, strict limits);
typed errors come back as the same tpkv.errors class.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from tpkv import errors
from tpkv.config import TpkvConfig
from tpkv.controller.controller import Controller
from tpkv.controller.messages import (
    CommitOutcome,
    StepResult,
    move_result_from_dict,
    move_result_to_dict,
)
from tpkv.types import MoveResult, decode, encode

NAME = "tpkv-controller"
NAMESPACE = "tpkv"
_KV_PREFIX = b"tpkv-controller-inits:"


def _count_inits() -> int:
    """How many times this actor's constructor ran (1 + restarts), kept in the GCS KV store."""
    try:
        from ray.experimental import internal_kv

        key = _KV_PREFIX + str(ray.get_runtime_context().get_actor_id()).encode()
        n = int(internal_kv._internal_kv_get(key) or b"0") + 1
        internal_kv._internal_kv_put(key, str(n).encode(), overwrite=True)
        return n
    except Exception:  # the KV store is an internal API: fall back to Ray's own flag
        return 2 if ray.get_runtime_context().was_current_actor_reconstructed else 1


class ControllerActor:
    """Holds one Controller; each method decodes its request and encodes its answer."""

    _METHODS = ("register_rank", "open_session", "extend_session", "close_session", "pin",
                "unpin", "schedule", "report_attention", "report_prefill", "commit", "resync",
                "rebuild", "snapshot", "session_blocks", "check_integrity")

    def __init__(self, config: TpkvConfig) -> None:
        restarts = _count_inits() - 1
        reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        self.ctl = Controller(config, time.monotonic, restarts=max(restarts, int(reconstructed)),
                              awaiting_rebuild=reconstructed or restarts > 0)

    async def call(self, method: str, payload: bytes) -> bytes:
        try:
            if method not in self._METHODS:
                raise errors.BadRequestError(f"controller has no method {method!r}")
            args = decode(payload)
            if not isinstance(args, dict):
                raise errors.WireFormatError("request must be a map of arguments")
            return encode({"ok": self._dispatch(method, args)})
        except errors.TpkvError as exc:
            message = str(exc.args[0]) if exc.args else str(exc)  # KeyError's str() quotes
            return encode({"error": type(exc).__name__, "message": message})

    async def ping(self) -> int:
        return self.ctl.restarts

    def _dispatch(self, method: str, a: dict[str, Any]) -> Any:
        c = self.ctl
        if method == "schedule":
            return c.schedule(a["session_ids"], a["num_new_tokens"], a.get("upcoming")).to_dict()
        if method == "commit":
            return c.commit([move_result_from_dict(r) for r in a["results"]]).to_dict()
        if method == "report_attention":
            for session_id, start, mass in a["updates"]:
                c.report_attention(session_id, mass, start)
            return None
        if method == "check_integrity":
            c.check_integrity()
            return True
        return getattr(c, method)(**a)


def get_or_create(config: TpkvConfig, detached: bool = False) -> ray.actor.ActorHandle:
    """The controller of this Ray cluster, created on first use (name tpkv-controller)."""
    cls = ray.remote(num_cpus=0, max_restarts=-1)(ControllerActor)
    opts: dict[str, Any] = {"name": NAME, "namespace": NAMESPACE, "get_if_exists": True}
    if detached:
        opts["lifetime"] = "detached"
    handle: Any = cls.options(**opts).remote(config)  # type: ignore[attr-defined]
    return handle


def get_existing(timeout_s: float = 30.0) -> ray.actor.ActorHandle:
    """Find the controller another process created (waits for it up to timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class ControllerClient:
    """Typed calls on the actor; one Ray round trip each."""

    def __init__(self, handle: ray.actor.ActorHandle, timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def call(self, method: str, **args: Any) -> Any:
        ref: Any = self.handle.call.remote(method, encode(args))
        answer = decode(ray.get(ref, timeout=self.timeout_s))
        if "error" in answer:
            cls = getattr(errors, str(answer["error"]), None)
            if not (isinstance(cls, type) and issubclass(cls, errors.TpkvError)):
                cls = errors.TpkvError
            raise cls(answer["message"])
        return answer["ok"]

    def schedule(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                 upcoming: Mapping[str, int] | None = None) -> StepResult:
        d = self.call("schedule", session_ids=list(session_ids),
                      num_new_tokens=np.asarray(num_new_tokens, dtype=np.int64),
                      upcoming=dict(upcoming or {}))
        return StepResult.from_dict(d)

    def commit(self, results: Sequence[MoveResult]) -> CommitOutcome:
        return CommitOutcome.from_dict(self.call(
            "commit", results=[move_result_to_dict(r) for r in results]))

    def report_attention(self, updates: Sequence[tuple[str, int, np.ndarray]]) -> None:
        self.call("report_attention", updates=[[s, int(i), np.asarray(m, dtype=np.float64)]
                                               for s, i, m in updates])

    def snapshot(self) -> dict[str, Any]:
        return dict(self.call("snapshot"))

    def __getattr__(self, method: str) -> Any:
        if method not in ControllerActor._METHODS:
            raise AttributeError(method)
        return lambda **args: self.call(method, **args)
