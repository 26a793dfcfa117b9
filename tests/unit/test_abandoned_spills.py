"""A session whose L3 records are deleted (closed, dropped from L3) holds no step for its spills."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_background_spill import GEO, D, H, S, _plan, _setup

pytestmark = pytest.mark.timeout(60)


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
        ok = np.ones(1, dtype=bool)
        ex.hbm.tensor[0].fill_(1.0)
        ex.run(_plan(1, 0, H, 0, D, 0), ok)  # block 0: L1 slot 0 -> L2 slot 0
        ex.run(_plan(2, 0, D, 0, S, -1), ok)  # L2 slot 0 -> L3: held at the gate
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
