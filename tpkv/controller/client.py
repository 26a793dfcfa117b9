"""ControllerClient: typed calls on the controller actor, sent at once and answered in order.

Every call of one client carries (client id, sequence number); the actor runs a client's calls
in that order (ControllerActor.call), so a caller may send several before it reads any answer
(a commit, then the next step's schedule) and they act on the controller as if made one by one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from tpkv import errors
from tpkv.protocol.messages import (
    CommitOutcome,
    StepResult,
    move_result_to_dict,
)
from tpkv.protocol.plan import MoveResult
from tpkv.protocol.wire import decode, encode

log = logging.getLogger(__name__)

# The Controller methods the actor serves through `call`.
METHODS = ("register_rank", "open_session", "extend_session", "close_session", "pin",
           "unpin", "schedule", "report_attention", "report_prefill", "commit", "resync",
           "rebuild", "snapshot", "session_blocks", "slot_map", "check_integrity",
           "mark_lost", "set_l2_online")


def _floats(mass: Any) -> Any:
    """Attention mass as float64 for the wire; as given when it is not numbers (the actor
    refuses it with a typed error)."""
    try:
        return np.asarray(mass, dtype=np.float64)
    except (TypeError, ValueError):
        return mass


def _schedule_args(session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                   upcoming: Mapping[str, int] | Sequence[str] | None = None,
                   rewrite: Sequence[int] | np.ndarray | None = None,
                   resume: Mapping[str, str] | None = None) -> dict[str, Any]:
    out = {"session_ids": list(session_ids),
           "num_new_tokens": np.asarray(num_new_tokens, dtype=np.int64),
           "upcoming": dict(upcoming) if isinstance(upcoming, Mapping)
           else list(upcoming or ())}
    if rewrite is not None:
        out["rewrite"] = np.asarray(rewrite, dtype=np.int64)
    if resume:
        out["resume"] = dict(resume)
    return out


def _commit_args(results: Sequence[MoveResult]) -> dict[str, Any]:
    return {"results": [move_result_to_dict(r) for r in results]}


def _attention_args(updates: Sequence[tuple[str, int, np.ndarray]]) -> dict[str, Any]:
    return {"updates": [[s, i, _floats(m)] for s, i, m in updates]}


# Typed arguments into their wire form, and wire answers into their types, per method.
_ARGS: dict[str, Callable[..., dict[str, Any]]] = {
    "schedule": _schedule_args, "commit": _commit_args, "report_attention": _attention_args}
_ANSWERS: dict[str, Callable[[Any], Any]] = {
    "schedule": StepResult.from_dict, "commit": CommitOutcome.from_dict}


class Sent:
    """Calls sent together in one actor call (ControllerActor.call_many for more than one):
    each Part's `result()` waits (bounded) for the answers, once for all of them, or raises its
    typed error. While the actor restarts (it was killed; max_restarts=-1) the calls are sent
    again until the client's timeout: the restarted controller then answers, if only with
    ControllerRecoveringError (the runtime rebuilds it from the ranks)."""

    def __init__(self, client: ControllerClient, calls: list[tuple[str, bytes]]) -> None:
        self.client, self.calls = client, calls
        self.method = calls[0][0] if len(calls) == 1 else "+".join(m for m, _ in calls)
        self.seq = client.next_seq()
        self.ref: Any = client.send_ref(calls, self.seq)
        self._answers: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()  # (the parts may be read on several threads)

    def done(self) -> bool:
        """Whether the answers are here (result() then returns without waiting)."""
        if self._answers is not None:
            return True
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def answers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if self._answers is None:
                self._answers = self._fetch(self.client.timeout_s if timeout is None
                                            else timeout)
            return self._answers

    def _fetch(self, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = decode(ray.get(self.ref, timeout=max(deadline - time.monotonic(),
                                                              0.001)))
            except ray.exceptions.GetTimeoutError as exc:
                raise errors.WaitTimeoutError(
                    f"controller did not answer {self.method} within {timeout:g} s") from exc
            except ray.exceptions.RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                self.ref = self.client.send_ref(self.calls, self.seq)
                continue
            if isinstance(answer, dict):  # one call's answer, or one error for them all
                return [answer] * len(self.calls)
            if not (isinstance(answer, list) and len(answer) == len(self.calls)
                    and all(isinstance(a, dict) for a in answer)):
                raise errors.WireFormatError(
                    f"controller answered {self.method} with {type(answer).__name__}, not "
                    f"{len(self.calls)} maps")
            return answer


class Part:
    """One call of a Sent: its answer, typed, or its typed error."""

    def __init__(self, sent: Sent, index: int) -> None:
        self.sent, self.index = sent, index
        self.method = sent.calls[index][0]

    def done(self) -> bool:
        return self.sent.done()

    def result(self, timeout: float | None = None) -> Any:
        answer = self.sent.answers(timeout)[self.index]
        if "error" in answer:
            cls = getattr(errors, str(answer["error"]), None)
            if not (isinstance(cls, type) and issubclass(cls, errors.TpkvError)):
                cls = errors.TpkvError
            raise cls(answer["message"])
        convert = _ANSWERS.get(self.method)
        return convert(answer["ok"]) if convert is not None else answer["ok"]


def payload(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A call's arguments in their wire form."""
    if method not in METHODS:
        raise errors.BadRequestError(f"controller has no method {method!r}")
    to_wire = _ARGS.get(method)
    if to_wire is not None and args:
        kwargs = to_wire(*args, **kwargs)
    elif args:
        raise errors.ArgumentTypeError(f"controller.{method} takes keyword arguments only, "
                                       f"got {len(args)} positional")
    return encode(kwargs)


class ControllerClient:
    """Typed calls on the actor. `send` returns at once (a Sent); `call` and the typed methods
    wait for the answer. The calls of one client reach the controller in the order sent.
    `owned`: this process made the actor for its runtime (rank 0's tpkv.init), whose close
    then ends it (launch.link.RayLink.close), as an in-process controller ends with it."""

    def __init__(self, handle: ray.actor.ActorHandle, timeout_s: float = 30.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.owned = False
        self.client_id = uuid.uuid4().hex
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send_ref(self, calls: list[tuple[str, bytes]], seq: int) -> Any:
        order = [self.client_id, seq]
        if len(calls) == 1:
            return self.handle.call.remote(calls[0][0], calls[0][1], order)
        return self.handle.call_many.remote([list(c) for c in calls], order)

    def send(self, method: str, *args: Any, **kwargs: Any) -> Part:
        """Send one controller call now; its answer comes with Part.result(). Positional
        arguments are typed ones, as Controller takes them (schedule, commit, report_attention
        as a list of updates), put into their wire form here; keyword arguments go as given
        (the actor checks them: a typed error names what is missing or unknown)."""
        return Part(Sent(self, [(method, payload(method, args, kwargs))]), 0)

    def send_many(self, calls: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]
                  ) -> list[Part | BaseException]:
        """Send calls (method, args, kwargs, as `send` takes them) in one actor call: they run
        in this order, one after another, before any call this client sends later. A call
        whose arguments cannot go on the wire is its error here and is not sent."""
        wire: list[tuple[str, bytes] | BaseException] = []
        for method, args, kwargs in calls:
            try:
                wire.append((method, payload(method, args, kwargs)))
            except Exception as exc:
                wire.append(exc)
        good = [w for w in wire if not isinstance(w, BaseException)]
        sent = Sent(self, good) if good else None
        parts = iter([Part(sent, k) for k in range(len(good))] if sent is not None else [])
        return [w if isinstance(w, BaseException) else next(parts) for w in wire]

    def call(self, method: str, **args: Any) -> Any:
        """One controller call, waiting for its answer."""
        return self.send(method, **args).result()

    def schedule(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                 upcoming: Mapping[str, int] | Sequence[str] | None = None) -> StepResult:
        """Controller.schedule; `upcoming` as it takes it: names to steps ahead, or names
        soonest first."""
        result: StepResult = self.send("schedule", session_ids, num_new_tokens,
                                       upcoming).result()
        return result

    def commit(self, results: Sequence[MoveResult]) -> CommitOutcome:
        outcome: CommitOutcome = self.send("commit", results).result()
        return outcome

    def report_attention(self, updates: Sequence[tuple[str, int, np.ndarray]]) -> None:
        self.send("report_attention", updates).result()

    def snapshot(self) -> dict[str, Any]:
        return dict(self.call("snapshot"))

    def dashboard(self) -> dict[str, Any]:
        """URL of the controller's dashboard (None, with `error`, when it could not listen)."""
        ref: Any = self.handle.dashboard.remote()
        return dict(ray.get(ref, timeout=self.timeout_s))

    def dashboard_payload(self) -> dict[str, Any]:
        """The snapshot with the dashboard's series (traffic, TP consistency)."""
        ref: Any = self.handle.dashboard_payload.remote()
        return dict(json.loads(ray.get(ref, timeout=self.timeout_s)))

    def __getattr__(self, method: str) -> Any:
        if method not in METHODS:
            raise AttributeError(method)
        return lambda **args: self.call(method, **args)


class Turns:
    """The actor's side of the ordering: a call whose client sent an earlier one that has not
    run yet waits for it (on the actor's event loop). A client first seen mid-sequence (this
    actor restarted) starts from the number it sends. A call waits at most `timeout_s` for a
    turn (a sent call lost before it reached the actor), then runs with a warning."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.next: dict[str, int] = {}
        self._changed: Any = None  # asyncio.Condition, made on the loop
        self._waiting = 0  # calls waiting for their turn (done() wakes them only then)

    async def wait(self, order: Any) -> tuple[str, int] | None:
        if order is None:
            return None
        if not (isinstance(order, (list, tuple)) and len(order) == 2
                and isinstance(order[0], str) and isinstance(order[1], int)):
            raise errors.WireFormatError("call order must be [client id, sequence number]")
        client, seq = order[0], order[1]
        expected = self.next.setdefault(client, seq)
        if seq <= expected:
            return client, seq
        if self._changed is None:
            self._changed = asyncio.Condition()
        self._waiting += 1
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: self.next.get(client, seq) >= seq), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "controller call %d of client %s ran without call %d before it (lost?)",
                seq, client[:8], self.next.get(client, seq))
        finally:
            self._waiting -= 1
        return client, seq

    def done(self, turn: tuple[str, int] | None) -> None:
        if turn is None:
            return
        client, seq = turn
        self.next[client] = max(self.next.get(client, seq + 1), seq + 1)
        if self._waiting:
            changed = self._changed

            async def wake() -> None:
                async with changed:
                    changed.notify_all()

            asyncio.get_running_loop().create_task(wake())
