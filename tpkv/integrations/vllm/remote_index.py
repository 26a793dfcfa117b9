"""The scheduler side's view of a prefix index that lives elsewhere (an IndexService actor).

RemoteIndex answers the Planner as PrefixIndex does. It keeps a mirror of the service's key
sets (stored, pending) and answers `match` and `holds` from it, without a call. The mirror
stays equal to the service's sets because this scheduler is the service's only caller (each
vLLM instance has a service of its own, which answers no other caller: ray_index) and
applies every change the same way: the changes it decides alone (a report's confirms and
forgets, a reset's clear) at once here, queued for the service; the changes only the service
can decide (which keys to write and which to drop for room, by its LRU order) from the answer
to `reserve_all`, the one call of a step, which carries the queued changes first. A step that
stores nothing makes no call. At start it waits for the service's index (START_TIMEOUT_S at
least: the actor's process may be starting).

When the service is dead or does not answer within `timeout_s`, the index is `down`: one
warning, the mirror emptied (nothing matches: vLLM computes the prompt), reserves answered with
nothing to write, no call waited on. Every `retry_s` it finds the service again (a restarted or
new one) and asks, without waiting, for its whole index; once that comes, the mirror takes it
(a new service rebuilt its index from the disk tier) and the index is up again. Blocks the
ranks still hold in memory that the rebuilt index lacks are never matched; the ranks' stores
push them out as they make room. A load planned before the failure still runs: the ranks hold
its blocks, since only this scheduler's plans drop blocks. `close` (the instance's shutdown)
ends the service; nothing is called after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from tpkv.errors import IndexUnavailableError, TpkvError
from tpkv.integrations.index_service import stats_from_wire
from tpkv.integrations.prefix_index import IndexStats, KeySets
from tpkv.protocol.wire import decode, encode

log = logging.getLogger(__name__)

DEFAULT_RETRY_S = 1.0
# The first call waits this long at least: it may wait for the actor's process to start.
START_TIMEOUT_S = 60.0
# Queued changes sent even in a step with nothing to reserve, past this many keys.
MAX_QUEUED_KEYS = 4096


class Transport(Protocol):
    """How a RemoteIndex reaches its service (ray_index.RayTransport; tests use fakes)."""

    def send(self, payload: bytes) -> Any:
        """Send one request; a handle for `ready` and `result`."""

    def ready(self, handle: Any) -> bool:
        """Whether the answer is here (result() then does not wait)."""

    def result(self, handle: Any, timeout_s: float) -> bytes:
        """The answer; IndexUnavailableError when the service is dead or slower than
        timeout_s."""

    def reconnect(self) -> None:
        """Find the service again (by name), making it when there is none;
        IndexUnavailableError when it cannot."""

    def close(self) -> None:
        """End the service (its caller is done with it); never raises."""


class RemoteIndex(KeySets):
    """A PrefixIndex's calls on a service reached through `transport` (module docstring)."""

    def __init__(self, transport: Transport, capacity_blocks: int, timeout_s: float,
                 retry_s: float = DEFAULT_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.capacity_blocks = capacity_blocks
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self.stats = IndexStats()
        self.down = True  # until the first sync answers
        self.outages = 0
        self._inc: str | None = None
        self._stored: set[bytes] = set()
        self._pending: set[bytes] = set()
        self._ops: list[list[Any]] = []
        self._queued_keys = 0
        self._probe: Any = None
        self._probe_sent = 0.0
        self._next_try = 0.0
        self._connect()

    # ---- what the Planner calls ----------------------------------------------------------

    @property
    def incarnation(self) -> str | None:
        """The service's incarnation the mirror follows (a new one after each rebuild)."""
        return self._inc

    def match(self, keys: Sequence[bytes]) -> int:
        """Leading keys stored, by the mirror (0 while the index is down)."""
        if self.down:
            self._poll()
        return super().match(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        self._queue("touch", [k for k in keys if k in self._stored])

    def confirm(self, keys: Iterable[bytes]) -> None:
        done = [k for k in keys if k in self._pending]
        self._pending.difference_update(done)
        self._stored.update(done)
        self._queue("confirm", done)

    def forget(self, keys: Iterable[bytes]) -> None:
        gone = [k for k in keys if k in self._pending or k in self._stored]
        self._pending.difference_update(gone)
        self._stored.difference_update(gone)
        self._queue("forget", gone)

    def clear(self) -> list[bytes]:
        keys = super().clear()
        if not self.down:
            self._ops.append(["clear"])
        return keys

    def reserve_all(self, batches: Sequence[Sequence[bytes]], keep: Iterable[bytes] = ()
                    ) -> list[tuple[list[bytes], list[bytes]]]:
        """Each batch's (keys to write, keys to drop), from one call that carries the queued
        changes first; nothing to write while the index is down."""
        if self.down:
            self._poll()
        nothing: list[tuple[list[bytes], list[bytes]]] = [([], []) for _ in batches]
        wanted = [list(keys) for keys in batches if keys]
        if self.down or (not wanted and self._queued_keys < MAX_QUEUED_KEYS):
            return nothing
        ops = self._ops + [["reserve", keys] for keys in wanted]
        self._ops, self._queued_keys = [], 0
        request = {"inc": self._inc, "keep": list(keep), "ops": ops}
        try:
            answer = self._answer(self.transport.result(self.transport.send(encode(request)),
                                                        self.timeout_s))
            if "reserved" not in answer:  # a new service: take its index, store nothing now
                self._take(answer)
                return nothing
            reserved = _reserved(answer["reserved"], len(wanted))
            self.stats = stats_from_wire(answer.get("stats"))
        except TpkvError as exc:
            self._fail(exc)
            return nothing
        out = iter(reserved)
        result: list[tuple[list[bytes], list[bytes]]] = []
        for keys in batches:
            if not keys:
                result.append(([], []))
                continue
            write, drop = next(out)
            self._stored.difference_update(drop)
            self._pending.update(write)
            result.append((write, drop))
        return result

    def close(self) -> None:
        """End the service (at the instance's shutdown): nothing is called after this."""
        self.transport.close()
        self.down = True
        self._stored.clear()
        self._pending.clear()
        self._ops, self._queued_keys, self._probe = [], 0, None
        self._next_try = float("inf")

    # ---- the service's state ---------------------------------------------------------------

    def _queue(self, name: str, keys: list[bytes]) -> None:
        if keys and not self.down:
            self._ops.append([name, keys])
            self._queued_keys += len(keys)

    def _answer(self, raw: bytes) -> dict[str, Any]:
        answer = decode(raw)
        if not isinstance(answer, dict) or not isinstance(answer.get("inc"), str):
            raise IndexUnavailableError("index service answered something that is not an "
                                        "index answer")
        return answer

    def _take(self, answer: dict[str, Any]) -> None:
        """The service's whole index into the mirror; up again."""
        stored, pending = answer.get("stored"), answer.get("pending")
        if not isinstance(stored, list) or not isinstance(pending, list) or not all(
                isinstance(k, bytes) for k in stored + pending):
            raise IndexUnavailableError("index service sent no index")
        stats = stats_from_wire(answer.get("stats"))
        was_down = self.down and self.outages > 0
        self._inc = answer["inc"]
        self._stored, self._pending = set(stored), set(pending)
        self._ops, self._queued_keys = [], 0
        self.stats = stats
        self.down = False
        if was_down:
            log.info("tpkv prefix index is back: %d blocks from the disk tier match again",
                     len(self._stored))

    def _fail(self, exc: Exception) -> None:
        if not self.down:
            self.outages += 1
            log.warning("tpkv prefix index unavailable (%s): vLLM computes every prompt and "
                        "nothing new is stored until it is back", exc)
        self.down = True
        self._stored.clear()
        self._pending.clear()
        self._ops, self._queued_keys = [], 0
        self._probe = None
        self._next_try = self.clock() + self.retry_s

    def _connect(self) -> None:
        """At start: the service's whole index, waited for (START_TIMEOUT_S at least)."""
        try:
            handle = self.transport.send(encode({"inc": None, "sync": True}))
            self._take(self._answer(self.transport.result(
                handle, max(self.timeout_s, START_TIMEOUT_S))))
        except TpkvError as exc:
            self._fail(exc)

    def _poll(self) -> None:
        """While down: every retry_s, find the service and ask for its index; take the answer
        once it is here. Never waits on the service."""
        now = self.clock()
        if self._probe is None:
            if now < self._next_try:
                return
            try:
                self.transport.reconnect()
                self._probe = self.transport.send(encode({"inc": self._inc, "sync": True}))
                self._probe_sent = now
            except TpkvError:
                self._next_try = now + self.retry_s
                return
        try:
            if self.transport.ready(self._probe):
                self._take(self._answer(self.transport.result(self._probe, self.timeout_s)))
                self._probe = None
            elif now - self._probe_sent > self.timeout_s:
                self._probe, self._next_try = None, now + self.retry_s
        except TpkvError:
            self._probe, self._next_try = None, now + self.retry_s


def _reserved(value: Any, count: int) -> list[tuple[list[bytes], list[bytes]]]:
    """The answer's reserves, checked: `count` pairs of key lists."""
    if not isinstance(value, list) or len(value) != count or not all(
            isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(keys, list) and all(isinstance(k, bytes) for k in keys)
                for keys in pair) for pair in value):
        raise IndexUnavailableError(f"index service answered {count} reserves with "
                                    f"something else")
    return [(pair[0], pair[1]) for pair in value]
