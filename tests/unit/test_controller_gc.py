"""Python's GC stays out of Controller.schedule(); prepare() runs the young collection due."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from tests.fakes import FakeClock
from tpkv.controller import Controller
from tpkv.controller.gcpause import collect_due, pause, resume
from tpkv.errors import BadRequestError
from tpkv.protocol.digest import plan_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MoveResult


def _confirm(c: Controller, res: StepResult) -> None:
    for plan in res.plans:
        d = plan_digest(plan)
        c.commit([MoveResult(plan.epoch, r, plan.num_moves, d) for r in range(2)])


def _inside(name: str) -> bool:
    """Whether a Controller method `name` is on the calling thread's stack."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == name and "controller.py" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


@pytest.fixture
def collections() -> Iterator[list[tuple[int, bool, bool]]]:
    """Every collection that starts: (generation, inside schedule, inside prepare), with a
    threshold of 1 (every allocation of a container collects) and the collector on."""
    seen: list[tuple[int, bool, bool]] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append((info["generation"], _inside("schedule"), _inside("prepare")))

    was_on, threshold = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*threshold)
        if not was_on:
            gc.disable()


def _steps(c: Controller, names: list[str], steps: int, prepare: bool) -> None:
    for _ in range(steps):
        if prepare:
            c.prepare()
        gc.set_threshold(1, 10, 10)
        res = c.schedule(names, np.ones(len(names), dtype=np.int64))
        gc.set_threshold(700, 10, 10)
        _confirm(c, res)


def test_no_collection_starts_inside_schedule(make_config, collections) -> None:
    """With a collection due at every allocation, ten steps (demotions and spills among them)
    run without one: the collector is paused in schedule() (before: ~every allocation of a
    container there collected)."""
    c = Controller(make_config(l1=64, l2=64, l3=256), FakeClock())
    names = [f"s{i}" for i in range(6)]
    for n in names:
        c.open_session(n, 30)
    _steps(c, names, 10, prepare=False)
    assert gc.isenabled()
    assert not [g for g, in_schedule, _ in collections if in_schedule]


def test_prepare_runs_the_collection_that_is_due(make_config, collections) -> None:
    """Half the young threshold used up: prepare() collects (the youngest generation, or the
    middle one once its own count is past its threshold, as CPython would), and not while the
    collector is off."""
    c = Controller(make_config(), FakeClock())
    gc.collect()  # every count 0
    gc.set_threshold(100, 10, 10)
    junk = [[] for _ in range(40)]  # 41 young containers: under 100 // 2
    collections.clear()
    c.prepare()
    assert collections == []
    junk += [[] for _ in range(20)]  # past 50
    c.prepare()
    assert [(g, p) for g, _, p in collections] == [(0, True)]
    gc.disable()
    junk += [[] for _ in range(80)]
    assert collect_due() == -1  # off: left off, nothing collected
    gc.enable()
    gens = []
    for _ in range(12):
        junk += [[] for _ in range(80)]
        middle = gc.get_count()[1]
        gens.append((middle, collect_due()))
    assert [g for _, g in gens] == [1 if middle > 10 else 0 for middle, _ in gens]
    assert [g for _, g in gens].count(1) == 1
    assert len(junk) == 1100


def test_paused_keeps_the_collector_as_it_found_it(make_config) -> None:
    """Off stays off after a step; on is back on after a step and after a refused one."""
    c = Controller(make_config(), FakeClock())
    c.open_session("a", 8)
    was_on = gc.isenabled()
    try:
        gc.disable()
        _confirm(c, c.schedule(["a"], [1]))
        assert not gc.isenabled()
        gc.enable()
        _confirm(c, c.schedule(["a"], [1]))
        assert gc.isenabled()
        with pytest.raises(BadRequestError):
            c.schedule(["a"], [1, 2])
        assert gc.isenabled()
        outer = pause()
        assert outer and not gc.isenabled()
        assert not pause()  # nested: the inner one found it off, and leaves it off
        resume(False)
        assert not gc.isenabled()
        resume(outer)
        assert gc.isenabled()
    finally:
        if not was_on:
            gc.disable()
