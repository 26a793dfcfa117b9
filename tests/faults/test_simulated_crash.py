"""Power cuts at every file-system call of a spill workload: unsynced writes lost, torn, garbled."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.faults.crashcheck import (
    SESSIONS,
    Model,
    Op,
    Tally,
    close_stores,
    leftovers,
    open_stores,
    recover,
    run_op,
    verify,
)
from tests.faults.faultfs import STORE_MODULES, FaultOs, SimulatedCrash, installed
from tpkv.ssd.backend import PosixFile

USED = ("sess-00", "sess-01", "sess-02", "sess-03")
INITIAL = (Op("put", "sess-00", ((0, 1), (1, 2), (2, 3))), Op("put", "sess-01", ((0, 4), (1, 5))),
           Op("put", "sess-02", ((3, 6),)))
WORKLOAD = (
    Op("put", "sess-03", ((0, 10), (1, 11))),  # a new session: fresh segments, new fan-out dir
    Op("put", "sess-00", ((3, 12), (1, 13))),  # an append that also rewrites index 1
    Op("drop", "sess-01"),
    Op("put", "sess-01", ((0, 14),)),  # a new life of a dropped session
    Op("put", "sess-02", ((3, 15), (4, 16))),
    Op("drop", "sess-03"),
)
# (directory entries, unsynced data) after the crash; ("current", "keep") is what a SIGKILL
# leaves, which test_sigkill_writer.py covers with real processes.
MODES = [m for m in itertools.product(("durable", "current"), ("drop", "keep", "garble"))
         if m != ("current", "keep")]


@pytest.fixture
def tmp_path(mem_path: Path) -> Path:
    """The fault layer, not the disk, is under test: hundreds of small trees go to memory."""
    return mem_path


@pytest.fixture
def seed_root(tmp_path: Path) -> Path:
    """The directory before the workload: three complete sessions, all synced."""
    root = tmp_path / "seed"
    stores = open_stores(root)
    for op in INITIAL:
        run_op(stores, op)
    close_stores(stores)
    return root


def initial_model() -> Model:
    model = Model()
    for op in INITIAL:
        model.ack(op)
    return model


def run_until_crash(work: Path, crash_at: int | None, self_check: bool = False,
                    workload: tuple[Op, ...] = WORKLOAD) -> tuple[Model, FaultOs]:
    """The workload under the fault layer; the model holds what was acknowledged before the
    crash and the op it cut."""
    model = initial_model()
    fault_os = FaultOs(work, crash_at, self_check)
    try:
        with installed(fault_os):
            stores = open_stores(work)
            for op in workload:
                model.inflight = op
                run_op(stores, op)
                model.ack(op)
    except SimulatedCrash:
        pass
    return model, fault_os


def count_calls(seed_root: Path, tmp_path: Path, workload: tuple[Op, ...] = WORKLOAD) -> int:
    work = tmp_path / "dry"
    shutil.copytree(seed_root, work)
    model, fault_os = run_until_crash(work, None, self_check=True, workload=workload)
    assert not fault_os.crashed and model.inflight is None
    shutil.rmtree(work)
    return fault_os.calls


def crash_and_check(seed_root: Path, tmp_path: Path, crash_at: int, names: str, data: str,
                    tally: Tally, workload: tuple[Op, ...] = WORKLOAD,
                    sessions: tuple[str, ...] = USED) -> None:
    work, after = tmp_path / "work", tmp_path / "after"
    shutil.copytree(seed_root, work)
    model, fault_os = run_until_crash(work, crash_at, workload=workload)
    assert fault_os.crashed, crash_at
    fault_os.crash_tree(after, names, data, np.random.default_rng(crash_at))
    label = f"crash at call {crash_at} ({names} names, {data} data)"
    with installed(FaultOs(after)):  # no crash: only to skip real fsyncs
        stores = open_stores(after)
        assert leftovers(after) == [], label
        verify(stores, model, tally, label, sessions)
        recover(stores, model, tally, label)
        # The node keeps serving: a session is written again, all reads agree.
        redo = Op("put", "sess-03", ((5, 99),))
        run_op(stores, redo)
        model.ack(redo)
        verify(stores, model, tally, label + ", after a new write", sessions)
        close_stores(stores)
    shutil.rmtree(work)
    shutil.rmtree(after)


def test_every_crash_point_in_every_mode_loses_nothing_acked(seed_root: Path,
                                                             tmp_path: Path) -> None:
    num_calls = count_calls(seed_root, tmp_path)
    assert num_calls > 50  # every op of the workload reached the file layer
    tally = Tally()
    for crash_at in range(1, num_calls + 1):
        for names, data in MODES:
            crash_and_check(seed_root, tmp_path, crash_at, names, data, tally)
        assert tally.problems == [], tally.problems
    assert tally.wrong == tally.lost == tally.dirty_misses == 0
    assert tally.hits > 0
    print(f"\nsimulated crashes: points={num_calls} modes={len(MODES)} "
          f"crashes={num_calls * len(MODES)} blocks_checked={tally.checked} hits={tally.hits} "
          f"wrong={tally.wrong} lost={tally.lost}")


def test_random_workloads_crashed_at_random_points(seed_root: Path, tmp_path: Path) -> None:
    """Other op sequences: 12 random 8-op workloads over all sessions, 10 crashes each at
    random calls, in random modes."""
    rng = np.random.default_rng(7)
    tally, crashes = Tally(), 0
    for _ in range(12):
        planner = initial_model()
        planner.next_version = 100
        workload = []
        for _ in range(8):
            workload.append(op := planner.pick(rng))
            planner.ack(op)
        num_calls = count_calls(seed_root, tmp_path, tuple(workload))
        for crash_at in rng.choice(np.arange(1, num_calls + 1), size=10, replace=False):
            names, data = MODES[int(rng.integers(len(MODES)))]
            crash_and_check(seed_root, tmp_path, int(crash_at), names, data, tally,
                            tuple(workload), SESSIONS)
            crashes += 1
        assert tally.problems == [], tally.problems
    assert crashes == 120 and tally.wrong == tally.lost == tally.dirty_misses == 0
    print(f"\nrandom workloads: crashes={crashes} blocks_checked={tally.checked} "
          f"hits={tally.hits} wrong={tally.wrong} lost={tally.lost}")


@pytest.mark.parametrize("skip", ["segment fsync", "directory fsync"])
def test_the_fault_layer_catches_a_store_that_skips_an_fsync(
        seed_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: str) -> None:
    """The checker has teeth: without the segment fsync (or the directory fsync), a crash that
    drops unsynced data (or unsynced directory entries) loses blocks the store acknowledged."""
    num_calls = count_calls(seed_root, tmp_path)
    if skip == "segment fsync":
        monkeypatch.setattr(PosixFile, "sync", lambda self: None)
    else:
        for module in STORE_MODULES:
            if hasattr(module, "fsync_dir"):
                monkeypatch.setattr(module, "fsync_dir", lambda path: None)
    tally = Tally()
    for crash_at in range(1, num_calls + 1):
        crash_and_check(seed_root, tmp_path, crash_at, "durable", "drop", tally)
        if tally.lost:
            break
    assert tally.lost > 0 and any("lost" in p for p in tally.problems)


def test_a_cut_write_may_be_torn_and_every_tear_is_a_miss(seed_root: Path,
                                                          tmp_path: Path) -> None:
    """Crash inside each pwritev of the workload and keep each sector-aligned prefix of it."""
    num_calls = count_calls(seed_root, tmp_path)
    tally, torn = Tally(), 0
    for crash_at in range(1, num_calls + 1):
        work = tmp_path / "work"
        shutil.copytree(seed_root, work)
        model, fault_os = run_until_crash(work, crash_at)
        if fault_os.torn is not None and len(fault_os.torn[2]) > 4096:
            fid, offset, data = fault_os.torn
            for cut in range(0, len(data) + 1, 2048):
                fault_os.torn = (fid, offset, data[:cut])
                after = tmp_path / f"after-{cut}"
                fault_os.crash_tree(after, "current", "keep", np.random.default_rng(0))
                stores = open_stores(after)
                verify(stores, model, tally, f"call {crash_at} torn at {cut}", USED)
                close_stores(stores)
                shutil.rmtree(after)
                torn += 1
        shutil.rmtree(work)
    assert torn > 10 and tally.problems == [] and tally.wrong == tally.lost == 0
    print(f"\ntorn writes: tears={torn} blocks_checked={tally.checked} wrong={tally.wrong} "
          f"lost={tally.lost}")
