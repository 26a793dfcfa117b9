"""The controller's two links in tests: in process ("local") and the Ray actor ("ray").

A test body written against these runs alike on both (tests/conftest.py's `transport`)."""

from __future__ import annotations

import time
from typing import Any

TRANSPORTS = ["local", "ray"]
_made: list[Any] = []  # create_actor's handles: Ray ends an actor once its creator's are gone


def kill_actor(timeout_s: float = 30.0) -> None:
    """Kill the named controller actor for good, and wait until its name is free (the next
    tpkv.init creates a fresh one with its own config)."""
    import ray

    from tpkv.controller.actor import NAME, NAMESPACE

    _made.clear()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            handle = ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:
            return
        ray.kill(handle, no_restart=True)
        if time.monotonic() > deadline:
            raise TimeoutError(f"controller actor {NAME} still listed {timeout_s:g} s after kill")
        time.sleep(0.05)


def restart(rt: Any, restarts: int, timeout_s: float = 60.0) -> None:
    """The controller loses its state, as when its actor dies: in process a fresh Controller
    awaiting a rebuild takes its place; through Ray the actor is killed and Ray restarts it
    (this returns once the restarted actor answers, as restart number `restarts`). Either way
    the runtime finds out at its next controller call."""
    from tpkv.controller.controller import Controller

    ctl = rt.controller
    if isinstance(ctl, Controller):
        rt.controller = Controller(rt.config, restarts=restarts, awaiting_rebuild=True)
        return
    import ray

    ray.kill(ctl.handle, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.get(ctl.handle.ping.remote(), timeout=timeout_s) == restarts:
                return
        except ray.exceptions.RayActorError:  # killed, not yet back
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"controller actor not restarted within {timeout_s:g} s")
        time.sleep(0.05)


def session_tokens(rt: Any) -> dict[str, int]:
    """Rank 0: every open session's tokens at the controller, counting those of steps planned
    but not yet fed (the snapshot's `tokens` + `pending_tokens`), through either link."""
    return {s["session"]: int(s["tokens"]) + int(s["pending_tokens"])
            for s in rt.controller.snapshot()["sessions"]}


def failing_planner(fail_at: int) -> type:
    """The controller actor class whose planner raises RuntimeError("planner bug") in its
    `fail_at`-th call, once (tests/unit/test_step_failure.py in process). Made here, so Ray
    ships the class by value to the actor's process."""
    from tpkv.controller.actor import ControllerActor

    class FailingPlanner(ControllerActor):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            from tpkv.controller import step as step_mod

            real_plan, calls = step_mod._plan, [0]

            def plan(*a: Any, **k: Any) -> Any:
                calls[0] += 1
                if calls[0] == fail_at:
                    raise RuntimeError("planner bug")
                return real_plan(*a, **k)
            step_mod._plan = plan

    return FailingPlanner


def create_actor(cls: type, config: Any) -> Any:
    """Create the named controller actor from `cls` before tpkv.init, which then finds it (as
    tpkv.controller.actor.get_or_create makes it). It lives until kill_actor()."""
    import ray

    from tpkv.controller.actor import NAME, NAMESPACE

    remote: Any = ray.remote(num_cpus=0, max_restarts=-1)(cls)
    handle = remote.options(name=NAME, namespace=NAMESPACE).remote(config)
    ray.get(handle.ping.remote(), timeout=60)
    _made.append(handle)
    return handle
