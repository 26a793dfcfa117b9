"""Rank 0's link to the controller: the same calls in process or through the Ray actor.

`send` returns at once with a reply to read later; `call` waits for its answer. Either way the
calls reach the controller one at a time, in the order this rank made them, so a rank may send
a commit and the next step's schedule and read their answers only when it needs them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from tpkv.errors import WaitTimeoutError

log = logging.getLogger(__name__)


class Reply(Protocol):
    """A call's answer on its way."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class Link(Protocol):
    """What the runtime needs of a controller."""

    target: Any  # the Controller, or the actor's ControllerClient

    def send(self, method: str, *args: Any, **kwargs: Any) -> Reply: ...

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def post(self, method: str, *args: Any, **kwargs: Any) -> Reply: ...

    def flush(self) -> None: ...

    hold_posts: bool

    def close(self) -> None: ...


class _Waiting:
    """A Future's answer, with the link's bound on waiting as a typed error."""

    def __init__(self, future: Future[Any], method: str, timeout_s: float) -> None:
        self.future, self.method, self.timeout_s = future, method, timeout_s

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Any:
        bound = self.timeout_s if timeout is None else timeout
        try:
            return self.future.result(timeout=bound)
        except FutureTimeout as exc:
            raise WaitTimeoutError(f"controller busy for {bound:g} s ({self.method})") from exc


class _Held(_Waiting):
    """A post held until the link's next flush: waiting for its answer flushes first."""

    def __init__(self, future: Future[Any], method: str, timeout_s: float,
                 flush: Any) -> None:
        super().__init__(future, method, timeout_s)
        self.flush = flush

    def result(self, timeout: float | None = None) -> Any:
        self.flush()
        return super().result(timeout)


class LocalLink:
    """An in-process Controller. Sent calls run on one thread of their own, in order, while
    the caller goes on (a step's forward); `call` runs on the caller's thread once every
    call sent before it is done. After a schedule the thread also makes the next step's
    eviction orders (Controller.prepare), as the actor does after replying."""

    def __init__(self, controller: Any, timeout_s: float = 30.0) -> None:
        self.target = controller
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[Any] | None = None
        self._lock = threading.Lock()  # one call at a time on the controller

    def send(self, method: str, *args: Any, **kwargs: Any) -> Reply:
        fut = self._thread().submit(self._run, method, args, kwargs)
        self._last = fut
        self._after(method)
        return _Waiting(fut, method, self.timeout_s)

    def post(self, method: str, *args: Any, **kwargs: Any) -> Reply:
        """A commit or a report (attention mass, prefill speed): sent as any call."""
        return self.send(method, *args, **kwargs)

    def flush(self) -> None:
        """Nothing is held: a post is sent at once."""

    hold_posts = False

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        last = self._last
        if last is not None and not last.done():  # calls sent earlier go first
            _Waiting(last, "earlier calls", self.timeout_s).result()
        self._last = None
        answer = self._run(method, args, kwargs)
        self._after(method)
        return answer

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpkv-controller")
        return self._pool

    def _after(self, method: str) -> None:
        """After a schedule: the next step's eviction orders, on the link's thread (a call
        made meanwhile need not wait for them)."""
        if method == "schedule":
            self._thread().submit(self._prepare)

    def _run(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._lock.acquire(timeout=self.timeout_s):
            raise WaitTimeoutError(f"controller busy for {self.timeout_s:g} s ({method})")
        try:
            if method == "report_attention":  # the batch form the actor takes
                return self.target.report_attentions(*args, **kwargs)
            return getattr(self.target, method)(*args, **kwargs)
        finally:
            self._lock.release()

    def _prepare(self) -> None:
        """Optional work: a failure is logged (the next schedule scans as before)."""
        prepare = getattr(self.target, "prepare", None)
        if prepare is None:
            return
        try:
            self._run("prepare", (), {})
        except Exception:
            log.exception("Controller.prepare failed")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class RayLink:
    """The controller actor through its ControllerClient. Calls are encoded and submitted on
    one sending thread, in the order made, and the actor runs them in that order
    (controller.client). A schedule's answer is fetched and decoded on a thread as soon as it
    is in, so the step that reads it finds it ready. Commits and reports (`post`) do not wait:
    with `hold_posts` they are held, and the next call sent takes them along, ahead of it, in
    the same actor call (a step's commit rides with the next step's schedule: one round trip
    a step); a flush, or waiting for a held post's answer, sends them alone. (The controller
    takes a step's schedule before or after the commits of earlier plans alike; a caller that
    needs them in first waits for their answers.) `close` ends the actor when this process
    made it for its runtime (ControllerClient.owned): the next tpkv.init in the same Ray
    cluster gets a fresh controller from its own config, as in process."""

    def __init__(self, client: Any) -> None:
        self.target = client
        self._fetcher: ThreadPoolExecutor | None = None
        self._sender: ThreadPoolExecutor | None = None
        self._held: list[tuple[str, tuple[Any, ...], dict[str, Any], Future[Any]]] = []
        self._lock = threading.Lock()
        # Posts wait for the next send or flush instead of going at once: set by a caller
        # that schedules each step (the runtime, once its engine applies late plans)
        self.hold_posts = False

    def send(self, method: str, *args: Any, **kwargs: Any) -> Reply:
        """The held posts and this call go in one actor call. A schedule returns at once
        (the step launches its forward meanwhile) with its answer fetched on another thread;
        any other call returns once it is submitted."""
        going = self._submit((method, args, kwargs))
        assert going is not None
        if method != "schedule":
            return _sent_part(going.result())
        return _Waiting(self._pool("fetch").submit(lambda: _sent_part(going.result()).result()),
                        method, self.target.timeout_s + 1.0)

    def post(self, method: str, *args: Any, **kwargs: Any) -> Reply:
        answer: Future[Any] = Future()
        with self._lock:
            self._held.append((method, args, kwargs, answer))
        reply = _Held(answer, method, self.target.timeout_s + 1.0, self.flush)
        if not self.hold_posts:
            self.flush()
        return reply

    def flush(self) -> None:
        """Send the posts held since the last send or flush, in order, in one actor call."""
        self._submit(None)

    def _submit(self, call: tuple[str, tuple[Any, ...], dict[str, Any]] | None
                ) -> Future[list[Any]] | None:
        """The held posts, then `call`, to the sending thread as one actor call; each held
        post's answer is handed on from the fetching thread."""
        with self._lock:
            held, self._held = self._held, []
            if not held and call is None:
                return None
            calls = [(m, a, k) for m, a, k, _ in held] + ([call] if call is not None else [])
            going = self._pool("send").submit(self.target.send_many, calls)
        if held:
            self._pool("fetch").submit(_settle, going, [answer for *_, answer in held])
        return going

    def _pool(self, name: str) -> ThreadPoolExecutor:
        attr = "_sender" if name == "send" else "_fetcher"
        pool: ThreadPoolExecutor | None = getattr(self, attr)
        if pool is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"tpkv-{name}")
            setattr(self, attr, pool)
        return pool

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.send(method, *args, **kwargs).result()

    def close(self) -> None:
        self.flush()
        for pool in (self._sender, self._fetcher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._sender = self._fetcher = None
        if getattr(self.target, "owned", False):
            self.target.owned = False
            import ray

            from tpkv.controller import actor

            if ray.is_initialized():  # (else it ended with the Ray this runtime started)
                actor.end(self.target.handle, self.target.timeout_s)


def _sent_part(parts: list[Any]) -> Reply:
    """The last call's reply of a send_many (the call itself), or its error."""
    last = parts[-1]
    if isinstance(last, BaseException):
        raise last
    return last  # type: ignore[no-any-return]


def _settle(going: Future[list[Any]], answers: list[Future[Any]]) -> None:
    """The fetching thread's work: each held post's answer (or error), handed on."""
    try:
        parts = going.result()
    except BaseException as exc:
        for answer in answers:
            answer.set_exception(exc)
        return
    for part, answer in zip(parts, answers):
        if isinstance(part, BaseException):
            answer.set_exception(part)
            continue
        try:
            answer.set_result(part.result())
        except BaseException as exc:
            answer.set_exception(exc)


def make_link(controller: Any, timeout_s: float) -> Link:
    """The link for a controller object: the actor's client goes through Ray, anything else
    (a Controller, a test's stand-in) is called in process."""
    from tpkv.controller.controller import Controller

    if controller is None or isinstance(controller, Controller) or not hasattr(
            controller, "handle"):
        return LocalLink(controller, timeout_s)
    return RayLink(controller)
