"""bench/e2e.py with a host timeline of every resume: when each step of its critical path began
and ended, in ms from the start of its schedule (each resume record's "timeline").

    python bench/resume_timeline.py --full --configs b2 --out bench/results/e2e_b2_timeline.json
    (without --out: bench/results/e2e_timeline.json, never the published e2e.json)
    RESUME_HOST_END=1 python bench/resume_timeline.py ...   # also the host's view of the end

Wraps (the first call of each in a resume step counts; "name>" its start, "name<" its end):
the runtime's begin_step, the controller's schedule and in it the demand, plan_step and the
plan's end_phase; the rank's apply_step, SlotMirror.check, PlanExecutor.run and in it the
demotion-piece lookup, the stream marks, the copy calls into L1, the descriptor pass
(kernels.merged_copies) and cudaMemcpyBatchAsync. With RESUME_HOST_END=1 the engine's wait()
also blocks until the resume's copies are done and records "host_end" (this delays the
forward's launch; the resume's own time is unchanged), to check the device-timed end.
The wrappers cost about a microsecond each. Each record also has "cpu_timeline" (the step
thread's CPU time from the start to each mark: where it falls short of the wall time, the
thread was off the CPU) and "switches" (its voluntary and involuntary context switches from
the start to run< and to schedule<).

    RESUME_PROFILE=FILE python bench/resume_timeline.py ...   # cProfile of the resumes' paths

profiles each step whose schedule issues a copy into L1 (a resume's loads, or a prefetch) from
the schedule's start to that first copy issued (h2d<), all such steps in one pstats file (the
profiler's own cost inflates the times, not the call counts).
"""

from __future__ import annotations

import atexit
import cProfile
import functools
import os
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.e2e as e2e  # noqa: E402
import bench.e2e_run as e2e_run  # noqa: E402
from tpkv.controller import builder, controller, step  # noqa: E402
from tpkv.launch import runtime  # noqa: E402
from tpkv.models import tiered  # noqa: E402
from tpkv.workers import copy_engine, cuda_rt, executor, mirror, pieces, worker  # noqa: E402

MARKS: dict[str, int] = {}
CPU: dict[str, int] = {}  # the step thread's CPU time at each mark (time.thread_time_ns)
SWITCHES: dict[str, tuple[int, int]] = {}  # its (voluntary, involuntary) context switches
_SWITCH_AT = ("start", "run<", "schedule<")


# What install() times: (owner, attribute, label)
WRAPPED: tuple[tuple[Any, str, str], ...] = (
    (runtime.TpkvRuntime, "_begin_step", "begin"),
    (controller.Controller, "schedule", "controller"),
    (step, "demand", "demand"), (step, "plan_step", "plan_step"),
    (builder.PlanBuilder, "end_phase", "end_phase"),
    (controller.Controller, "finish_step", "finish_step"),
    (worker.Worker, "apply_step", "apply_step"),
    (mirror.SlotMirror, "check", "check"),
    (executor.PlanExecutor, "run", "run"),
    (pieces.DemotionPieces, "groups", "piece_lookup"),
    (executor.PlanExecutor, "_mark", "stream_mark"),
    (executor.PlanExecutor, "_h2d", "h2d"),
    (executor.PlanExecutor, "_demote", "demote"),
    (copy_engine, "merged_copies", "descriptors"),
    (cuda_rt, "memcpy_batch", "memcpy_batch"),
    (tiered.TieredEngine, "wait", "wait"),
)


PROFILE: str | None = os.environ.get("RESUME_PROFILE") or None
_PROFILES: list[Any] = []  # one cProfile.Profile per step whose schedule issued a copy into L1
_profiling: Any = None


def _mark(label: str) -> None:
    global _profiling
    if PROFILE is not None:
        if label == "start":
            _profiling = cProfile.Profile()
            _profiling.enable()
        elif _profiling is not None and label in ("h2d<", "schedule<"):
            _profiling.disable()  # the first copy into L1 issued, or none in this schedule
            if label == "h2d<":
                _PROFILES.append(_profiling)
            _profiling = None
    if label not in MARKS:
        MARKS[label] = time.perf_counter_ns()
        CPU[label] = time.thread_time_ns()
        if label in _SWITCH_AT:
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            SWITCHES[label] = (ru.ru_nvcsw, ru.ru_nivcsw)


def _wrap(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _mark(label + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            _mark(label + "<")
    setattr(owner, name, timed)


def install() -> None:
    schedule = tiered.TieredEngine.schedule

    def timed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        MARKS.clear()
        CPU.clear()
        SWITCHES.clear()
        _mark("start")
        try:
            return schedule(self, *args, **kwargs)
        finally:
            _mark("schedule<")
    tiered.TieredEngine.schedule = timed_schedule  # type: ignore[method-assign]
    for owner, name, label in WRAPPED:
        _wrap(owner, name, label)
    if os.environ.get("RESUME_HOST_END") == "1":
        wait = tiered.TieredEngine.wait

        def wait_host(self: Any, tables: Any) -> None:
            wait(self, tables)
            pending = self._resume_timing
            if pending is not None:
                pending[3].synchronize()
                _mark("host_end")
        tiered.TieredEngine.wait = wait_host  # type: ignore[method-assign]
    resume = e2e_run.Rounds._resume

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        resume(self, *args, **kwargs)
        t0 = MARKS.get("start", 0)
        self.resumes[-1]["timeline"] = {k: round((v - t0) / 1e6, 3) for k, v in
                                        sorted(MARKS.items(), key=lambda kv: kv[1])}
        # CPU time the step thread ran from the start to each mark: where it falls short of
        # the wall time above, the thread was off the CPU (descheduled, or waiting for the GIL)
        c0 = CPU.get("start", 0)
        self.resumes[-1]["cpu_timeline"] = {k: round((CPU[k] - c0) / 1e6, 3) for k in
                                            self.resumes[-1]["timeline"] if k in CPU}
        s0 = SWITCHES.get("start", (0, 0))
        self.resumes[-1]["switches"] = {k: [v[0] - s0[0], v[1] - s0[1]]
                                        for k, v in SWITCHES.items() if k != "start"}
    e2e_run.Rounds._resume = record  # type: ignore[method-assign]


def _dump_profiles() -> None:
    if PROFILE is not None and _PROFILES:
        stats = pstats.Stats(_PROFILES[0])
        for prof in _PROFILES[1:]:
            stats.add(prof)
        stats.dump_stats(PROFILE)
        print(f"profiles of {len(_PROFILES)} steps in {PROFILE}", file=sys.stderr)


if __name__ == "__main__":
    atexit.register(_dump_profiles)
    install()
    if not any(a == "--out" or a.startswith("--out=") for a in sys.argv[1:]):
        # not over the published e2e.json, which bench/e2e.py writes by default
        sys.argv += ["--out", "bench/results/e2e_timeline.json"]
    e2e.main()
