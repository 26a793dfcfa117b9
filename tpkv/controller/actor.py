"""The controller as a named, restartable Ray actor, and a client that speaks msgpack to it.

With controller/client.py, the only modules in tpkv that import ray. About two actor calls
a step (the next step's `schedule`, sent while the forward runs, and a commit), never one per
block. Arguments and answers cross as msgpack bytes (tpkv.protocol.wire, strict limits);
typed errors come back as the same tpkv.errors class. The actor also serves the dashboard
(tpkv.controller.dashboard) from a child process of its own (ServerProcess), with snapshots taken
on the actor's loop at most once per `dashboard_cache_s` (only a copy there: Controller.capture;
the page, JSON and metrics are made from it in the child), and hands its metrics to
ray.util.metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from typing import Any

import ray

from tpkv import errors
from tpkv.config import TpkvConfig
from tpkv.controller.client import METHODS, ControllerClient, Turns
from tpkv.controller.controller import Controller
from tpkv.controller.dashboard import DashboardServer, MetricSpec, Recorder
from tpkv.controller.dashboard.process import ServerProcess
from tpkv.controller.dashboard.view import dumps
from tpkv.protocol.messages import move_result_from_dict
from tpkv.protocol.wire import decode, encode

# Methods _dispatch unpacks itself: (required, optional) argument names.
_OWN_ARGS = {"schedule": ({"session_ids", "num_new_tokens"}, {"upcoming", "rewrite",
                                                               "resume"}),
             "commit": ({"results"}, set()), "report_attention": ({"updates"}, set()),
             "resync": (set(), set()), "check_integrity": (set(), set())}
NAME = "tpkv-controller"
NAMESPACE = "tpkv"
_KV_PREFIX = b"tpkv-controller-inits:"
log = logging.getLogger(__name__)


def _count_inits() -> int:
    """How many times this actor's constructor ran (1 + restarts), kept in the GCS KV store."""
    try:
        from ray.experimental import internal_kv

        key = _KV_PREFIX + str(ray.get_runtime_context().get_actor_id()).encode()
        n = int(internal_kv._internal_kv_get(key) or b"0") + 1
        internal_kv._internal_kv_put(key, str(n).encode(), overwrite=True)
        return n
    except Exception:  # the KV store is an internal API: fall back to Ray's own flag
        return 2 if _ray_says_reconstructed() else 1


def _ray_says_reconstructed() -> bool:
    """RuntimeContext.was_current_actor_reconstructed, asked only when the KV count fails: it
    reads Ray's own deprecated `actor_id` property (a RayDeprecationWarning in every actor's log
    since Ray 2.4x) and asks the GCS for the actor's record."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _error(exc: errors.TpkvError) -> dict[str, Any]:
    """A typed error as an answer (the client raises it again by name)."""
    message = str(exc.args[0]) if exc.args else str(exc)  # KeyError's str() quotes
    return {"error": type(exc).__name__, "message": message}


class ControllerActor:
    """Holds one Controller; each method decodes its request and encodes its answer."""

    _METHODS = METHODS

    def __init__(self, config: TpkvConfig) -> None:
        restarts = _count_inits() - 1  # > 0: Ray restarted this actor (its state is gone)
        self.ctl = Controller(config, time.monotonic, restarts=restarts,
                              awaiting_rebuild=restarts > 0)
        g = config.geometry
        self.recorder = Recorder(g.block_bytes * g.tp_size, self.ctl.now_s)
        self.dashboard_server = DashboardServer(
            self.ctl.snapshot, recorder=self.recorder, blocks_fn=self.ctl.session_blocks,
            host=config.dashboard_host, port=config.dashboard_port,
            token=config.dashboard_token, export_fn=RayMetrics().export,
            cache_s=config.dashboard_cache_s, capture_fn=self.ctl.capture,
            info={"geometry": dataclasses.asdict(g), "block_bytes": g.block_bytes,
                  "tp_size": g.tp_size})
        self.dashboard_process: ServerProcess | None = None
        self._sample_task: asyncio.Task[None] | None = None
        self._dashboard_error: str | None = None
        self._dashboard_task: asyncio.Task[None] | None = None
        self._prepare_task: asyncio.Task[None] | None = None  # held: the loop keeps weak refs
        self._turns = Turns(config.wait_timeout_s)
        try:  # Ray runs an async actor's __init__ on its event loop: serve from there
            self._dashboard_task = asyncio.get_running_loop().create_task(self._serve())
        except RuntimeError:  # no loop yet (older Ray): the first async call starts it
            pass

    async def _serve(self) -> None:
        s = self.dashboard_server  # serves from a child process; captures on this loop
        loop = s.frames.owner = asyncio.get_running_loop()
        proc = ServerProcess(s, loop)
        try:
            await loop.run_in_executor(None, proc.start)
        except OSError as exc:  # the controller works on without its dashboard
            self._dashboard_error = f"cannot listen on {s.host}:{s.port}: {exc}"
            log.warning("tpkv dashboard not started: %s", self._dashboard_error)
            return
        self.dashboard_process = proc
        if s.recorder is not None and s.sample_interval_s:  # fed here, sampled here
            self._sample_task = loop.create_task(s.sampling(s.sample_interval_s))

    async def close_dashboard(self) -> None:
        """Stops the dashboard's process (it also ends by itself when this actor ends)."""
        proc, self.dashboard_process = self.dashboard_process, None
        if self._sample_task is not None:
            self._sample_task.cancel()
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, proc.stop)

    async def dashboard(self) -> dict[str, Any]:
        """Where the dashboard listens: url, host, port, token_required, error."""
        if self._dashboard_task is None:
            self._dashboard_task = asyncio.get_running_loop().create_task(self._serve())
        await self._dashboard_task
        s = self.dashboard_server
        return {"url": None if self._dashboard_error else s.url, "host": s.host, "port": s.port,
                "token_required": s.token is not None, "error": self._dashboard_error}

    async def dashboard_payload(self) -> str:
        """What /api/snapshot serves, less the heat map, as JSON (for `tpkv status`): captured
        here, rendered on a thread of the loop's executor."""
        make = self.dashboard_server.capture(heatmap=False)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: dumps(make()))

    async def call(self, method: str, payload: bytes, order: Any = None) -> bytes:
        """One Controller call. `order` = [client id, sequence number]: a client's calls run
        in the order it sent them (ControllerClient sends without waiting for answers)."""
        return await self.call_many([[method, payload]], order, one=True)

    async def call_many(self, calls: Any, order: Any = None, one: bool = False) -> bytes:
        """Controller calls ([method, payload] each) in one actor call, run in this order
        under one `order` (a step's held commits and reports, then its schedule): the list of
        their answers, each as `call` gives it (with `one`, that answer alone)."""
        if self._dashboard_task is None:
            self._dashboard_task = asyncio.get_running_loop().create_task(self._serve())
        turn = await self._turns.wait(order)
        try:
            if not (isinstance(calls, list) and calls and all(
                    isinstance(c, list) and len(c) == 2 for c in calls)):
                return encode(_error(errors.WireFormatError(
                    "calls must be a list of [method, payload]")))
            answers = [self._answer(method, payload) for method, payload in calls]
            if any(method == "schedule" for method, _ in calls):  # the next step's work,
                # once this reply is on its way
                self._prepare_task = asyncio.get_running_loop().create_task(self._prepare())
            return encode(answers[0] if one else answers)
        finally:
            self._turns.done(turn)

    def _answer(self, method: Any, payload: Any) -> dict[str, Any]:
        try:
            if method not in METHODS:
                raise errors.BadRequestError(f"controller has no method {method!r}")
            if not isinstance(payload, bytes):
                raise errors.WireFormatError(f"{method} payload is {type(payload).__name__}, "
                                             f"not bytes")
            args = decode(payload)
            if not isinstance(args, dict):
                raise errors.WireFormatError("request must be a map of arguments")
            return {"ok": self._dispatch(method, args)}
        except errors.TpkvError as exc:
            return _error(exc)
        except Exception as exc:  # a bug: this call's error alone (the calls sent with it
            # ran, or run next, as if sent one by one)
            log.exception("controller.%s failed", method)
            return _error(errors.ControllerError(
                f"controller.{method} raised {type(exc).__name__}: {exc}"))

    async def _prepare(self) -> None:
        """Controller.prepare() after a step's reply: it runs while the engine computes, off
        the critical path (a request that comes meanwhile waits for it, well under a step).
        Yields first, so the reply goes out before it. Never fails a call: the next schedule
        does the work itself if this did not."""
        await asyncio.sleep(0)
        try:
            self.ctl.prepare()
        except Exception:  # optional work: log it, the step scans as before
            log.exception("Controller.prepare failed")

    async def ping(self) -> int:
        return self.ctl.restarts

    def _check_args(self, method: str, a: dict[str, Any]) -> None:
        """ArgumentTypeError naming the method and argument for a missing or unknown one."""
        if method in _OWN_ARGS:
            required, optional = _OWN_ARGS[method]
            names = set(a)
            problem = (f"missing argument {sorted(required - names)[0]!r}" if required - names
                       else f"unknown argument {sorted(names - required - optional)[0]!r}"
                       if names - required - optional else "")
        else:
            try:
                inspect.signature(getattr(self.ctl, method)).bind(**a)
                problem = ""
            except TypeError as exc:
                problem = str(exc)
        if problem:
            raise errors.ArgumentTypeError(f"controller.{method}: {problem}")

    def _dispatch(self, method: str, a: dict[str, Any]) -> Any:
        c = self.ctl
        self._check_args(method, a)
        if method == "schedule":
            return c.schedule(a["session_ids"], a["num_new_tokens"], a.get("upcoming"),
                              a.get("rewrite"), a.get("resume")).to_dict()
        if method == "commit":
            if not isinstance(a["results"], list):
                raise errors.ArgumentTypeError("commit: results must be a list of move results")
            results = [move_result_from_dict(r) for r in a["results"]]
            plan = c.pending[0].plan if c.pending else None  # the plan these reports confirm
            outcome = c.commit(results)
            self.recorder.on_commit(plan, results, outcome)
            return outcome.to_dict()
        if method == "resync":
            full = c.resync()
            self.recorder.on_resync(int(full["epoch"]), len(full["block_ids"]))
            return full
        if method == "report_attention":
            updates = a["updates"]
            if not isinstance(updates, list) or not all(
                    isinstance(u, list) and len(u) == 3 for u in updates):
                raise errors.ArgumentTypeError("report_attention: updates must be a list of "
                                               "[session_id, start, mass]")
            c.report_attentions(updates)  # (a restarted controller refuses it first)
            return None
        if method == "check_integrity":
            c.check_integrity()
            return True
        return getattr(c, method)(**a)


class RayMetrics:
    """Hands the dashboard's metrics to ray.util.metrics, so Ray's Prometheus and Grafana show
    them too (Ray prefixes the names with ray_). Counters get the increase since last time."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        self.last: dict[tuple[str, tuple[str, ...]], float] = {}

    def export(self, specs: list[MetricSpec]) -> None:
        from ray.util import metrics

        for spec in specs:
            metric: Any = self.metrics.get(spec.name)
            if metric is None:
                cls = metrics.Counter if spec.kind == "counter" else metrics.Gauge
                metric = self.metrics[spec.name] = cls(spec.name, description=spec.help,
                                                       tag_keys=spec.labels)
            for labels, value in spec.samples:
                tags = dict(zip(spec.labels, labels)) or None
                if spec.kind == "gauge":
                    metric.set(value, tags=tags)
                    continue
                delta = value - self.last.get((spec.name, labels), 0.0)
                self.last[(spec.name, labels)] = value
                if delta > 0:
                    metric.inc(delta, tags=tags)


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


def end(handle: ray.actor.ActorHandle, timeout_s: float = 30.0) -> None:
    """Kill the controller for good and wait (up to timeout_s) until its name is free, so the
    next get_or_create makes a fresh one from its own config."""
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    log.warning("controller actor %s still listed %g s after it was killed", NAME, timeout_s)


def attach(address: str | None = None, timeout_s: float = 10.0) -> tuple[ControllerClient, bool]:
    """Join a running cluster (`address`, default "auto") and find its controller by name.
    Returns the client and whether this call connected to Ray (then `detach(True)` after)."""
    from tpkv.ray_notice import quiet_token_notice

    joined = not ray.is_initialized()
    if joined:
        quiet_token_notice()
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    try:
        return ControllerClient(get_existing(timeout_s), timeout_s), joined
    except BaseException:
        detach(joined)
        raise


def detach(joined: bool) -> None:
    if joined and ray.is_initialized():
        ray.shutdown()
