"""A step that waits for a spill does not wait behind the reads that spills yield to."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.pool_cases import make_engine
from tpkv.config import KvGeometry, SsdConfig
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.jobs import ReadsFirst
from tpkv.ssd.store import SsdStore
from tpkv.workers.executor import PlanExecutor

pytestmark = pytest.mark.timeout(60)
GEO = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
N = 8  # blocks spilled: one write piece each, so a spill pauses N times while a read runs


def _plan(epoch: int, src: int, src_slots: list[int], dst: int, dst_slots: list[int]
          ) -> MovePlan:
    n = len(src_slots)
    blocks = np.arange(n)
    return MovePlan(epoch, blocks, np.full(n, src), np.array(src_slots), np.full(n, dst),
                    np.array(dst_slots), np.zeros(n), blocks, ("sess",))


def test_a_pause_ends_when_writes_go_first() -> None:
    gate = ReadsFirst()
    gate.begin()  # a read that does not end
    paused = threading.Event()
    done = threading.Event()

    def write_piece() -> None:
        paused.set()
        gate.pause()
        done.set()

    t = threading.Thread(target=write_piece)
    t.start()
    assert paused.wait(5)
    assert not done.wait(0.05)  # held by the read
    with gate.writes_first():
        assert done.wait(5)  # released without the read ending
        gate.pause()  # and no later piece pauses
    t.join(5)
    assert gate.num_pauses == 1 and gate.num_urgent == 1
    gate.end()


def test_a_refill_of_a_spilled_slot_waits_for_the_spill_not_for_reads(tmp_path: Path) -> None:
    """A copy into L2 slots a spill still reads waits for that spill; a read that the disk
    answers late (which spills yield to) must not hold it: the spill's pieces go on, the
    copy lands, and L3 holds the spilled bytes, bit for bit."""
    store = SsdStore(SsdConfig(root=str(tmp_path / "l3"), backend="posix", o_direct=False,
                               io_threads=2, write_piece_bytes=GEO.block_bytes), GEO, "m", 0)
    late = threading.Event()
    entered = threading.Event()
    disk = store._sessions  # noqa: SLF001 (a disk whose read answers late)
    real_read = disk.read

    def slow_read(*args: Any) -> Any:
        entered.set()
        late.wait(30)
        return real_read(*args)

    ex = PlanExecutor(make_engine(GEO, N, 2 * N, "cpu"), store, timeout_s=5.0)
    try:
        host = ex.host
        for i in range(N):
            ex.hbm.tensor[i].fill_(float(i + 1))
        ok = np.ones(N, dtype=bool)
        ex.run(_plan(1, H, list(range(N)), D, list(range(N))), ok)  # L1 -> L2 slots 0..N-1
        want = [host.block(i).reshape(-1).view(torch.uint8).numpy().copy() for i in range(N)]
        disk.read = slow_read
        read = store.submit_read("other", np.array([0]), [np.zeros(GEO.block_bytes, np.uint8)])
        assert entered.wait(5)  # a read is on the disk now: spills pause for it
        out = ex.run(_plan(2, D, list(range(N)), S, [-1] * N), ok)  # spill L2 slots 0..N-1
        assert out.done.all() and len(ex.spills.running) == 1
        ex.hbm.tensor[:N].fill_(7.0)
        out = ex.run(_plan(3, H, list(range(N)), D, list(range(N))), ok)  # refill them
        assert not out.error and out.done.all()
        assert not late.is_set() and not read.done()  # the read is still held
        assert not ex.spills.running  # the spill was written before the refill
        assert store.write_pauses()[1] == 1  # the refill's wait made the writes go first
        assert all((host.block(i) == 7.0).all() for i in range(N))  # the refill landed
        ex.synchronize()
        bufs = [np.zeros(GEO.block_bytes, dtype=np.uint8) for _ in range(N)]
        disk.read = real_read
        assert store.read_blocks("sess", np.arange(N), bufs).all()
        for i in range(N):
            assert np.array_equal(bufs[i], want[i])
    finally:
        late.set()
        store.close()
