"""A session whose L3 records are deleted (closed, dropped from L3) holds no step for its spills."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.multiproc.harness import make_config
from tests.unit.test_background_spill import GEO, D, H, S, _plan, _setup
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MovePlan
from tpkv.workers.worker import Worker

pytestmark = pytest.mark.timeout(60)


def _spill_at_the_gate(ex: Any) -> np.ndarray:
    """Block 0 (all 1.0) from L1 slot 0 to L2 slot 0, then its spill to L3, held at the
    gate; returns the plans' `ok` mask."""
    ok = np.ones(1, dtype=bool)
    ex.hbm.tensor[0].fill_(1.0)
    ex.run(_plan(1, 0, H, 0, D, 0), ok)
    ex.run(_plan(2, 0, D, 0, S, -1), ok)
    return ok


def _block(value: float) -> np.ndarray:
    return np.full(GEO.block_bytes // 2, value, dtype=np.float16).view(np.uint8)


def test_a_write_asked_before_a_drop_writes_nothing_and_one_asked_after_lands(
        tmp_path: Path) -> None:
    _, store, gate = _setup(tmp_path)  # writes wait for `gate` before they begin
    try:
        early = store.submit_write("sess", np.array([0]), [_block(1.0)])
        store.drop_session_later("sess")
        late = store.submit_write("sess", np.array([0, 1]), [_block(2.0), _block(3.0)])
        gate.set()
        assert early.result(10) == 0  # asked before the drop: nothing written
        assert late.result(10) > 0
        assert store.commit_manifest("sess")
        assert store.session_indices("sess").tolist() == [0, 1]  # the early record is not there
        out = [np.zeros(GEO.block_bytes, dtype=np.uint8) for _ in range(2)]
        assert store.read_blocks("sess", np.array([0, 1]), out).all()
        assert np.array_equal(out[0], _block(2.0)) and np.array_equal(out[1], _block(3.0))
    finally:
        gate.set()
        store.close()


def test_an_abandoned_spill_holds_nothing_but_its_slots_and_is_never_committed(
        tmp_path: Path) -> None:
    ex, store, gate = _setup(tmp_path)
    try:
        ok = _spill_at_the_gate(ex)
        assert len(ex.spills.running) == 1 and not gate.is_set()
        ex.spills.abandon({"sess"})  # the session's L3 records are being deleted
        store.drop_session_later("sess")
        assert not ex.spills.busy("sess")  # a read ahead of it would not wait for that write
        ex.spills.wait(0.0)  # finishing the spills done waits for none of its (deadline 0)
        assert len(ex.spills.running) == 1
        ex.hbm.tensor[1].fill_(2.0)
        threading.Timer(0.2, gate.set).start()
        ex.run(_plan(3, 1, H, 1, D, 0), ok)  # into L2 slot 0: waits for that spill still
        assert gate.is_set() and not ex.spills.running and not ex.spills.commits
        assert (ex.host.block(0) == 2.0).all()  # the refill landed
        ex.synchronize()
        assert ex.spills.num_failed_spills == 0
        assert ex.spills.write_bytes_per_s == 0  # no write: no sample of the disk's rate
        assert store.session_indices("sess").tolist() == []
        assert not store.commit_manifest("sess")
    finally:
        gate.set()
        store.close()


def test_a_spill_of_another_session_is_committed_beside_an_abandoned_one(
        tmp_path: Path) -> None:
    ex, store, gate = _setup(tmp_path)
    try:
        ok = np.ones(1, dtype=bool)
        ex.hbm.tensor[0].fill_(5.0)
        want = ex.hbm.tensor[0].reshape(-1).view(torch.uint8).numpy().copy()
        ex.run(_plan(1, 0, H, 0, D, 0), ok)
        ex.run(_plan(2, 0, D, 0, S, -1), ok)  # "sess": kept
        ex.run(_plan(3, 1, H, 1, D, 1), ok)
        ex.run(dataclasses.replace(_plan(4, 1, D, 1, S, -1), session_names=("gone",)), ok)
        ex.spills.abandon({"gone"})
        store.drop_session_later("gone")
        gate.set()
        ex.synchronize()
        assert [c.name for c in ex.spills.commits] in ([], ["sess"])
        for c in ex.spills.commits:
            assert c.future.result(5) is True
        assert store.session_indices("sess").tolist() == [0]
        assert store.session_indices("gone").tolist() == []
        buf = np.zeros(GEO.block_bytes, dtype=np.uint8)
        assert store.read_blocks("sess", np.array([0]), [buf])[0]
        assert np.array_equal(buf, want)
    finally:
        gate.set()
        store.close()


def test_a_step_that_drops_a_session_from_l3_returns_while_its_spill_waits(
        tmp_path: Path) -> None:
    """The step naming a session in ssd_dropped_sessions does not wait for the session's spill
    (the disk here answers only once that step has returned: a wait would time out); the
    spill then writes nothing and the session's files are gone."""

    w = Worker(make_config(1, str(tmp_path / "l3"), wait_timeout_s=10.0), rank=0, device="cpu")
    store = w.store
    assert store is not None
    gate = threading.Event()
    real = store.write_blocks

    def slow(*args: object) -> int:
        gate.wait(30)  # a disk that answers late
        return real(*args)  # type: ignore[arg-type]

    store.write_blocks = slow  # type: ignore[method-assign]
    empty = np.zeros(0, dtype=np.int64)

    def step(tick: int, plans: tuple[MovePlan, ...], dropped: tuple[str, ...] = ()
             ) -> StepResult:
        return StepResult(tick=tick, session_ids=(), num_tokens=empty,
                          block_offsets=np.zeros(1, dtype=np.int64),
                          block_table=np.zeros(0, dtype=np.int32), plans=plans,
                          drops=(empty,) * (len(plans) + 1), ssd_dropped_sessions=dropped)

    def move(epoch: int, src: int, src_slot: int, dst: int, dst_slot: int) -> MovePlan:
        return MovePlan(epoch, np.array([0]), np.array([src], dtype=np.int8),
                        np.array([src_slot]), np.array([dst], dtype=np.int8),
                        np.array([dst_slot]), np.zeros(1, dtype=np.int32), np.array([0]),
                        ("s",))

    try:
        w.mirror.put(np.arange(1), np.full(1, H), np.zeros(1, dtype=np.int64), ["s"], np.arange(1))
        w.finish(w.apply_step(step(1, (move(1, H, 0, D, 0), move(2, D, 0, S, -1)))))
        assert len(w.executor.spills.running) == 1 and not gate.is_set()
        w.finish(w.apply_step(step(2, (), dropped=("s",))))  # returns: no wait for the disk
        assert not gate.is_set() and not w.executor.spills.busy("s")
        gate.set()
        w.executor.synchronize()
        assert store.session_indices("s").tolist() == []
        assert not list((tmp_path / "l3").glob("*/*.seg"))
    finally:
        gate.set()
        w.close()


def test_a_long_wait_for_a_spill_is_logged_with_what_it_waited_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from tpkv.workers import spills

    monkeypatch.setattr(spills, "LONG_WAIT_S", 0.1)
    ex, store, gate = _setup(tmp_path)
    try:
        ok = _spill_at_the_gate(ex)
        ex.hbm.tensor[1].fill_(2.0)
        threading.Timer(0.3, gate.set).start()
        with caplog.at_level("WARNING", logger="tpkv.workers.spills"):
            ex.run(_plan(3, 1, H, 1, D, 0), ok)  # into L2 slot 0: waits for that spill
        assert ex.spills.num_long_waits == 1
        [msg] = [r.getMessage() for r in caplog.records if "spills:" in r.getMessage()]
        assert "for 1 spills: sess (L2 slots, 1 blocks, queued" in msg, msg
        ex.synchronize()
        assert (ex.host.block(0) == 2.0).all()
    finally:
        gate.set()
        store.close()
