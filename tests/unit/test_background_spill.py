"""Spills run in the background; a refill of their L2 source slots waits for them (bounded)."""

from __future__ import annotations

import errno
import threading
import time
import types
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.pool_cases import make_engine
from tpkv.config import KvGeometry, SsdConfig
from tpkv.errors import SsdIoError
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers import reads as reads_module
from tpkv.workers import spills as spills_module
from tpkv.workers.executor import PlanExecutor

pytestmark = pytest.mark.timeout(60)
GEO = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)


def _plan(epoch: int, block: int, src: int, src_slot: int, dst: int, dst_slot: int) -> MovePlan:
    return MovePlan(epoch, np.array([block]), np.array([src]), np.array([src_slot]),
                    np.array([dst]), np.array([dst_slot]), np.zeros(1), np.array([block]),
                    ("sess",))


def _setup(tmp_path: Path) -> tuple[PlanExecutor, SsdStore, threading.Event]:
    store = SsdStore(SsdConfig(root=str(tmp_path / "l3"), backend="posix", o_direct=False,
                               io_threads=2), GEO, "m", 0)
    gate = threading.Event()
    real = store.write_blocks

    def slow(*args: Any) -> Any:
        gate.wait(10)  # a disk that answers late
        return real(*args)

    store.write_blocks = slow  # type: ignore[method-assign]
    engine = make_engine(GEO, 4, 4, "cpu")
    return PlanExecutor(engine, store, timeout_s=5.0), store, gate


def test_a_spill_returns_at_once_and_a_refill_of_its_slot_waits_for_it(tmp_path: Path) -> None:
    ex, store, gate = _setup(tmp_path)
    hbm, host = ex.hbm, ex.host
    hbm.tensor[0].fill_(1.0)
    hbm.tensor[1].fill_(2.0)
    want = hbm.tensor[0].reshape(-1).view(torch.uint8).numpy().copy()  # block 0's bytes
    ex.run(_plan(1, 0, H, 0, D, 0), np.ones(1, dtype=bool))  # block 0: L1 slot 0 -> L2 slot 0
    out = ex.run(_plan(2, 0, D, 0, S, -1), np.ones(1, dtype=bool))  # L2 slot 0 -> L3
    # returned (and reported done) while the write still waits for the disk
    assert out.done.all() and len(ex.spills.running) == 1 and not gate.is_set()
    threading.Timer(0.3, gate.set).start()
    out = ex.run(_plan(3, 1, H, 1, D, 0), np.ones(1, dtype=bool))  # refills L2 slot 0: waits
    assert not ex.spills.running and gate.is_set()
    # the wait is not the copy's own time: the controller's rate meter does not see it
    assert out.blocked_ns >= 0.2e9 and out.host_ns >= out.blocked_ns
    assert out.spill_wait_ns >= 0.2e9  # counted as a wait for the spill
    assert out.elapsed_ns() == out.host_ns - out.blocked_ns < 0.2e9
    assert (host.block(0) == 2.0).all()  # the refill landed
    # the manifest commit is queued on reap, on the store's commit thread (and collected at
    # once if that thread was quicker than the reap)
    assert ex.spills.num_commits == 1
    assert [c.name for c in ex.spills.commits] in ([], ["sess"])
    assert all(c.future.result(5) is True for c in ex.spills.commits)
    buf = np.zeros(GEO.block_bytes, dtype=np.uint8)
    assert store.read_blocks("sess", np.array([0]), [buf])[0]
    assert np.array_equal(buf, want)  # L3 holds block 0, not the refill's bytes
    store.close()


def test_wait_written_waits_at_most_its_time_without_an_error(tmp_path: Path) -> None:
    """Returns waits for spills before a turn with fresh K/V when nothing else runs: past its
    time the spill simply stays running; once written, it is finished (its commit queued)."""
    ex, store, gate = _setup(tmp_path)
    ex.hbm.tensor[0].fill_(1.0)
    ex.run(_plan(1, 0, H, 0, D, 0), np.ones(1, dtype=bool))
    ex.run(_plan(2, 0, D, 0, S, -1), np.ones(1, dtype=bool))
    t0 = time.monotonic()
    ex.spills.wait_written(0.2)  # the disk answers late: no error, the spill still runs
    assert 0.15 <= time.monotonic() - t0 < 2 and len(ex.spills.running) == 1
    gate.set()
    ex.spills.wait_written(5)
    assert not ex.spills.running and ex.spills.num_commits == 1
    assert all(c.future.result(5) is True for c in ex.spills.commits)
    store.close()


def test_an_unrelated_d2h_does_not_wait_and_synchronize_finishes_every_spill(tmp_path: Path
                                                                          ) -> None:
    ex, store, gate = _setup(tmp_path)
    ex.run(_plan(1, 0, H, 0, D, 0), np.ones(1, dtype=bool))
    ex.run(_plan(2, 0, D, 0, S, -1), np.ones(1, dtype=bool))
    ex.run(_plan(3, 1, H, 1, D, 2), np.ones(1, dtype=bool))  # another L2 slot: no wait
    assert len(ex.spills.running) == 1 and not gate.is_set()
    gate.set()
    ex.synchronize()
    assert not ex.spills.running and ex.spills.num_failed_spills == 0
    assert store.session_indices("sess").tolist() == [0]
    store.close()


def _settled(ex: PlanExecutor) -> None:
    """Wait for the background manifest commits queued so far (failed or not)."""
    futures.wait([c.future for c in ex.spills.commits], timeout=5)


def test_manifests_are_committed_after_the_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy into L2 slots a spill reads waits until the spill is written, but the manifest
    commits (fsyncs) come after the plan's copies are issued; a spill done before a plan is
    committed by it, after its copies."""
    ex, store, gate = _setup(tmp_path)
    order: list[str] = []
    commit = store.commit_manifest
    monkeypatch.setattr(store, "commit_manifest",
                        lambda name: order.append("commit") or commit(name))
    d2h = ex.engine.d2h_pieces
    monkeypatch.setattr(ex.engine, "d2h_pieces",
                        lambda *a, **k: order.append("d2h") or d2h(*a, **k))
    ok = np.ones(1, dtype=bool)
    ex.run(_plan(1, 0, H, 0, D, 0), ok)  # block 0: L1 slot 0 -> L2 slot 0
    ex.run(_plan(2, 0, D, 0, S, -1), ok)  # L2 slot 0 -> L3 (waits for the gate)
    order.clear()
    threading.Timer(0.2, gate.set).start()
    ex.run(_plan(3, 1, H, 1, D, 0), ok)  # into L2 slot 0: waits for the write
    _settled(ex)
    assert order == ["d2h", "commit"]
    ex.run(_plan(4, 2, H, 2, D, 1), ok)
    ex.run(_plan(5, 2, D, 1, S, -1), ok)  # a second spill, done at once (the gate is open)
    ex.spills.running[0].future.result(5)
    order.clear()
    ex.run(_plan(6, 3, H, 3, D, 2), ok)
    _settled(ex)
    assert order == ["d2h", "commit"] and not ex.spills.running
    store.close()


def test_a_load_of_records_this_rank_no_longer_holds_misses_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records deleted (a failed spill, a drop) never come back: the load reports misses at
    once instead of polling for a manifest up to half the wait timeout."""
    ex, store, gate = _setup(tmp_path)
    gate.set()
    ok = np.ones(1, dtype=bool)
    ex.run(_plan(1, 0, H, 0, D, 0), ok)
    ex.run(_plan(2, 0, D, 0, S, -1), ok)
    ex.synchronize()
    assert store.committed_indices("sess").tolist() == [0]
    store.drop_session("sess")
    assert store.committed_indices("sess").tolist() == []

    def no_poll(seconds: float) -> None:
        raise AssertionError(f"polled ({seconds} s) for records that cannot come")

    monkeypatch.setattr(spills_module, "time", types.SimpleNamespace(
        monotonic=time.monotonic, perf_counter_ns=time.perf_counter_ns, sleep=no_poll))
    out = ex.run(_plan(3, 0, S, -1, D, 1), ok)
    assert not out.error and out.misses.tolist() == [0]
    store.close()


def test_a_session_read_in_chunks_comes_back_bit_exact(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's L3 read is split into jobs of READ_CHUNK_BYTES (here 2 blocks: 3 jobs for 5
    blocks), each into its own L2 slots: every block lands where its move says."""
    store = SsdStore(SsdConfig(root=str(tmp_path / "l3"), backend="posix", o_direct=False,
                               io_threads=2), GEO, "m", 0)
    ex = PlanExecutor(make_engine(GEO, 8, 12, "cpu"), store, timeout_s=5.0)
    monkeypatch.setattr(reads_module, "READ_CHUNK_BYTES", 2 * GEO.block_bytes)
    n = 5
    rng = np.random.default_rng(3)
    for k in range(n):
        ex.host.block_bytes_view(k)[:] = rng.integers(0, 256, GEO.block_bytes, dtype=np.uint8)
    want = [ex.host.block_bytes_view(k).copy() for k in range(n)]
    ids, ones = np.arange(n), np.ones(n, dtype=bool)

    def plan(epoch: int, src: int, src_slot: np.ndarray, dst: int, dst_slot: np.ndarray
             ) -> MovePlan:
        return MovePlan(epoch, ids, np.full(n, src), src_slot, np.full(n, dst), dst_slot,
                        np.zeros(n), ids, ("sess",))

    ex.run(plan(1, D, ids, S, np.full(n, -1)), ones)
    ex.synchronize()
    dst = np.array([11, 6, 9, 5, 7])  # other slots, out of order
    calls: list[int] = []
    real = store.submit_read

    def counted(*args: Any) -> Any:
        calls.append(len(args[1]))
        return real(*args)

    monkeypatch.setattr(store, "submit_read", counted)
    out = ex.run(plan(2, S, np.full(n, -1), D, dst), ones)
    assert calls == [2, 2, 1] and not out.error and len(out.misses) == 0 and out.done.all()
    for k in range(n):
        assert np.array_equal(ex.host.block_bytes_view(int(dst[k])), want[k])
    store.close()


def test_a_load_into_slots_a_spill_still_reads_waits_and_says_how_long(tmp_path: Path) -> None:
    """An L3 read into an L2 slot a running spill still reads starts once the spill is done,
    and the plan's outcome counts that wait (spill_wait_ns, in the e2e's resume records)."""
    ex, store, gate = _setup(tmp_path)
    ex.hbm.tensor[0].fill_(3.0)
    ex.run(_plan(1, 0, H, 0, D, 0), np.ones(1, dtype=bool))  # block 0: L1 slot 0 -> L2 slot 0
    ex.run(_plan(2, 0, D, 0, S, -1), np.ones(1, dtype=bool))  # L2 slot 0 -> L3, held at the gate
    threading.Timer(0.3, gate.set).start()
    out = ex.run(_plan(3, 0, S, -1, D, 0), np.ones(1, dtype=bool))  # back into L2 slot 0
    assert out.done.all() and not out.misses.size and gate.is_set()
    assert out.spill_wait_ns >= 0.2e9  # it waited for the spill's write
    assert out.blocked_ns >= out.spill_wait_ns and out.elapsed_ns() < 0.2e9  # not disk time
    assert (ex.host.block(0) == 3.0).all()  # and read back what was written
    quick = ex.run(_plan(4, 0, D, 0, H, 0), np.ones(1, dtype=bool))  # no L3 read: no wait
    assert quick.spill_wait_ns == 0
    store.close()


def test_a_load_of_a_block_appended_again_waits_for_the_manifest_of_its_newest_record(
        tmp_path: Path) -> None:
    """L3 copies: a block loaded back, written, and spilled again is appended to the session's
    segment; the older manifest still lists its older record. A load must wait until the
    manifest covers this rank's newest record (another rank writes its own a moment later),
    never read the older one."""
    geo = KvGeometry(num_layers=1, num_kv_heads=2, head_dim=64, dtype="float16",
                     block_tokens=16, tp_size=2)
    cfg = SsdConfig(root=str(tmp_path / "l3"), backend="posix", o_direct=False, io_threads=2)
    stores = [SsdStore(cfg, geo, "m", r) for r in (0, 1)]
    rng = np.random.default_rng(0)
    old, new = (rng.integers(0, 256, geo.block_bytes, dtype=np.uint8) for _ in range(2))
    for st in stores:
        st.write_blocks("sess", np.array([0]), [old])
    assert stores[0].commit_manifest("sess") and stores[0].manifest_covers_commit("sess")
    stores[0].write_blocks("sess", np.array([0]), [new])  # rank 0's newer record of block 0
    assert not stores[0].manifest_covers_commit("sess")
    assert stores[1].manifest_covers_commit("sess")  # (rank 1 has not written it yet)
    late = threading.Timer(0.3, stores[1].write_blocks, ("sess", np.array([0]), [new]))
    ex = PlanExecutor(make_engine(geo, 4, 4, "cpu"), stores[0], timeout_s=5.0)
    began = time.monotonic()
    late.start()
    out = ex.run(_plan(1, 0, S, -1, D, 2), np.ones(1, dtype=bool))  # L3 -> L2 slot 2
    assert time.monotonic() - began >= 0.25 and not out.error and len(out.misses) == 0
    np.testing.assert_array_equal(ex.host.block_bytes_view(2), new)
    assert stores[0].manifest_covers_commit("sess")
    late.join()
    for st in stores:
        st.close()


def test_a_slow_manifest_commit_holds_no_step_and_a_load_of_its_session_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that finds a spill written queues its manifest commit on
    the store's commit thread and returns; a load of that session waits for the commit and
    reads back the spilled bytes."""
    ex, store, gate = _setup(tmp_path)
    gate.set()
    committing = threading.Event()
    commit = store.commit_manifest
    monkeypatch.setattr(store, "commit_manifest",
                        lambda name: committing.wait(10) and commit(name))
    ok = np.ones(1, dtype=bool)
    ex.hbm.tensor[0].fill_(3.0)
    want = ex.hbm.tensor[0].reshape(-1).view(torch.uint8).numpy().copy()
    ex.run(_plan(1, 0, H, 0, D, 0), ok)
    ex.run(_plan(2, 0, D, 0, S, -1), ok)
    ex.spills.running[0].future.result(5)
    t0 = time.monotonic()
    ex.run(_plan(3, 1, H, 1, D, 2), ok)  # finds the spill written: queues the commit only
    assert time.monotonic() - t0 < 2.0 and not ex.spills.running
    commits = ex.spills.commits
    assert [c.name for c in commits] == ["sess"] and not commits[0].future.done()
    threading.Timer(0.3, committing.set).start()
    t0 = time.monotonic()
    out = ex.run(_plan(4, 0, S, -1, D, 1), ok)  # load the session: waits for its commit
    assert time.monotonic() - t0 >= 0.25 and not ex.spills.commits
    assert not out.error and len(out.misses) == 0 and out.done.all()
    assert np.array_equal(ex.host.block_bytes_view(1), want)
    assert ex.spills.num_commits == 1 and ex.commit_ns >= 0.25e9  # the wait counts as commit time
    store.close()


def test_a_failed_background_commit_forgets_its_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest commit that fails on the commit thread is found by a later step: the
    session's L3 records are deleted (its blocks there miss, never read stale)."""
    ex, store, gate = _setup(tmp_path)
    gate.set()

    release = threading.Event()

    def broken(name: str) -> bool:
        release.wait(10)
        raise SsdIoError(f"L3 rank 0: writing the manifest of session {name} failed: disk full",
                         errno.ENOSPC)

    monkeypatch.setattr(store, "commit_manifest", broken)
    ok = np.ones(1, dtype=bool)
    ex.run(_plan(1, 0, H, 0, D, 0), ok)
    ex.run(_plan(2, 0, D, 0, S, -1), ok)
    ex.spills.running[0].future.result(5)
    ex.run(_plan(3, 1, H, 1, D, 2), ok)  # queues the commit
    assert len(ex.spills.commits) == 1
    release.set()
    _settled(ex)
    assert store.committed_indices("sess").tolist() == [0]  # written, not yet forgotten
    ex.run(_plan(4, 2, H, 2, D, 3), ok)  # finds it failed
    assert ex.spills.num_failed_spills == 1 and not ex.spills.commits
    assert store.committed_indices("sess").tolist() == []
    out = ex.run(_plan(5, 0, S, -1, D, 1), ok)
    assert out.misses.tolist() == [0]
    store.close()


def test_a_commit_failing_with_a_plain_oserror_forgets_its_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError the store did not turn into SsdIoError is a failed commit: the session is
    forgotten (its records miss), the step goes on."""
    ex, store, gate = _setup(tmp_path)
    gate.set()

    def broken(name: str) -> bool:
        raise OSError(errno.EIO, f"manifest of {name}: I/O error")

    monkeypatch.setattr(store, "commit_manifest", broken)
    ok = np.ones(1, dtype=bool)
    ex.run(_plan(1, 0, H, 0, D, 0), ok)
    ex.run(_plan(2, 0, D, 0, S, -1), ok)
    ex.spills.running[0].future.result(5)
    ex.run(_plan(3, 1, H, 1, D, 2), ok)  # finishes the spill: queues the commit
    _settled(ex)
    ex.run(_plan(4, 2, H, 2, D, 3), ok)  # finds it failed
    assert ex.spills.num_failed_spills == 1 and not ex.spills.commits and not ex.spills.running
    assert store.committed_indices("sess").tolist() == []
    out = ex.run(_plan(5, 0, S, -1, D, 1), ok)
    assert out.misses.tolist() == [0]
    store.close()


def test_each_plan_reports_which_spills_are_written_and_the_rate_the_disk_wrote_them(
        tmp_path: Path) -> None:
    """ExecOutcome.spills_written_below / spill_write_bytes_per_s (MoveResult's, for the
    controller's spill pacing): the epoch below which every spill has written, and the
    disk's rate as spills measure it (0 until one has)."""
    ex, store, gate = _setup(tmp_path)
    ex.run(_plan(1, 0, H, 0, D, 0), np.ones(1, dtype=bool))
    out = ex.run(_plan(2, 0, D, 0, S, -1), np.ones(1, dtype=bool))  # waits for the gate
    assert (out.spills_written_below, out.spill_write_bytes_per_s) == (2, 0)
    time.sleep(0.2)  # the disk takes 0.2 s or more for the block
    gate.set()
    ex.spills.running[0].future.result(5)
    below, rate = ex.spills.progress()
    assert below == 3 and 0 < rate < GEO.block_bytes / 0.2
    out = ex.run(_plan(3, 1, H, 1, D, 1), np.ones(1, dtype=bool))
    assert (out.spills_written_below, out.spill_write_bytes_per_s) == (4, rate)
    store.close()


def test_spills_that_end_together_share_their_time_in_the_disk_rate() -> None:
    """Two spills in flight for 0.1 s that end a moment apart: the rate is their bytes over
    that 0.1 s, not the second's bytes over the moment between the two ends (which measured
    hundreds of GB/s on the H200 and let the pacer queue seconds of spills)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from tpkv.workers.spills import SpillTracker

    tracker = SpillTracker(None, SimpleNamespace(block_bytes=1), 1.0)  # type: ignore[arg-type]
    done = []
    for _ in range(2):
        tracker._began()
        fut: Future[int] = Future()
        fut.set_result(1)
        done.append(fut)
    time.sleep(0.1)
    for fut in done:  # 100 MB each
        tracker._ended(100_000_000, fut)
    # (the first end takes the 0.1 s; the second's bytes wait for the next sample's time)
    assert 0.4e9 < tracker.write_bytes_per_s <= 2e9 + 1, tracker.write_bytes_per_s
    assert tracker._wrote == 100_000_000
    # a spill that wrote nothing (its session dropped first) adds its time, not its bytes
    tracker._began()
    empty: Future[int] = Future()
    empty.set_result(0)
    time.sleep(0.06)
    tracker._ended(100_000_000, empty)
    assert tracker._wrote == 0  # the carried 100 MB over the 0.06 s and more
    assert 0.4e9 < tracker.write_bytes_per_s < 2e9, tracker.write_bytes_per_s
