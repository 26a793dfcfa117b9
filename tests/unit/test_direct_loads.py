"""Direct loads (workers/direct.py): chained L3 loads of blocks read ahead are copied from the
read-ahead buffers straight into L1, and L2 is filled from L1; leases of those buffers
(ReadAhead.lease) keep them out of the pool until given back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# one_block_jobs: a fixture, taken by usefixtures below
from tests.unit.test_chained_loads import Rig, l1_bytes, one_block_jobs  # noqa: E402,F401
from tpkv.protocol.plan import Tier  # noqa: E402
from tpkv.ssd.readahead import ReadAhead  # noqa: E402

H = int(Tier.HBM)


def read_ahead(rig: Rig, blocks: list[int]) -> None:
    store = rig.w.store
    assert store is not None and store.read_ahead("s", np.asarray(blocks))
    deadline = time.monotonic() + 30
    while not store.ahead.done("s"):
        assert time.monotonic() < deadline, "read ahead not done"
        time.sleep(0.01)


def l2_bytes(rig: Rig, slot: int) -> np.ndarray:
    return rig.w.host.block_bytes_view(slot).copy()


@pytest.mark.usefixtures("one_block_jobs")
def test_blocks_read_ahead_reach_l1_and_l2_bit_exact_without_a_read(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "l3")
    store = rig.w.store
    assert store is not None
    try:
        read_ahead(rig, [0, 1, 2, 3])
        loads, ups = rig.resume()
        assert loads.outcome.done.all() and ups.outcome.done.all()
        assert not len(loads.outcome.misses)
        assert loads.outcome.bytes_ssd_read == 4 * rig.w.hbm.block_bytes
        assert ups.outcome.num_ahead == 4
        for b in range(4):
            np.testing.assert_array_equal(l1_bytes(rig.w, b), rig.truth[b])
            np.testing.assert_array_equal(l2_bytes(rig, 4 + b), rig.truth[b])
        assert rig.w.executor.direct.num_blocks == 4
        assert rig.h2d_calls == []  # nothing went through L2 into L1
        assert store.step_disk_blocks == 0
        tier, slot = rig.w.mirror.where(np.arange(4))
        assert tier.tolist() == [H] * 4 and slot.tolist() == [0, 1, 2, 3]
        # the lease is given back: the read ahead is dropped (its last L3 block came up)
        assert store.ahead.held_bytes == 0
    finally:
        rig.close()


@pytest.mark.usefixtures("one_block_jobs")
def test_blocks_not_read_ahead_go_through_l2_beside_those_read_ahead(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "l3")
    try:
        read_ahead(rig, [0, 2])
        loads, ups = rig.resume()
        assert loads.outcome.done.all() and ups.outcome.done.all()
        assert ups.outcome.num_ahead == 4
        assert rig.w.executor.direct.num_blocks == 2
        assert rig.h2d_calls == [1, 1]  # blocks 1 and 3, each as its read is done
        for b in range(4):
            np.testing.assert_array_equal(l1_bytes(rig.w, b), rig.truth[b])
            np.testing.assert_array_equal(l2_bytes(rig, 4 + b), rig.truth[b])
    finally:
        rig.close()


@pytest.mark.usefixtures("one_block_jobs")
def test_a_read_ahead_made_stale_is_not_leased(tmp_path: Path) -> None:
    """The session's records changed on this rank after its read ahead (a commit): nothing is
    leased, every block is read from the disk again, bit-exact."""
    rig = Rig(tmp_path / "l3")
    store = rig.w.store
    assert store is not None
    try:
        read_ahead(rig, [0, 1, 2, 3])
        store.ahead.changed("s")
        loads, ups = rig.resume()
        assert loads.outcome.done.all() and ups.outcome.done.all()
        assert rig.w.executor.direct.num_blocks == 0 and rig.h2d_calls == [1, 1, 1, 1]
        assert store.step_disk_blocks == 4
        for b in range(4):
            np.testing.assert_array_equal(l1_bytes(rig.w, b), rig.truth[b])
    finally:
        rig.close()


def _all_hits(sid: str, idx: np.ndarray, out: object) -> np.ndarray:
    return np.ones(len(idx), dtype=bool)


def _read_done(ra: ReadAhead, sid: str, n: int, read: Any = _all_hits) -> None:
    """Read blocks 0..n-1 of `sid` ahead and wait until the read ahead is done."""
    assert ra.start(sid, np.arange(n), read)
    deadline = time.monotonic() + 30
    while not ra.done(sid):
        assert time.monotonic() < deadline, "read ahead not done"
        time.sleep(0.005)


def _ahead(tmp_path: Path, n: int = 6, bb: int = 4096) -> tuple[ReadAhead, list[np.ndarray]]:
    """A ReadAhead of 2-block jobs over a fake store holding `n` known blocks (block 3 a miss)."""
    rng = np.random.default_rng(3)
    truth = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]

    def read(sid: str, idx: np.ndarray, out: object) -> np.ndarray:
        hits = np.ones(len(idx), dtype=bool)
        for k, i in enumerate(idx.tolist()):
            if i == 3:
                hits[k] = False
                continue
            out[k][:] = truth[i]  # type: ignore[index]
        return hits
    ra = ReadAhead(bb, 64 * bb, threads=2, rank=0)
    ra._job_rows = 2
    ra._free_cap = 2
    _read_done(ra, "s", n, read)
    return ra, truth


def test_a_lease_gives_the_hits_asked_and_keeps_their_buffers_until_released(
        tmp_path: Path) -> None:
    ra, truth = _ahead(tmp_path)
    try:
        want = np.array([5, 3, 0, 9, 2])
        lease = ra.lease("s", want, pinned=False, views=True)
        assert lease is not None
        assert sorted(lease.rows.tolist()) == [0, 2, 4]  # 3 is a miss, 9 never read ahead
        assert len(lease.blocks) == len(lease.addresses) == 3
        for row, block, address in zip(lease.rows.tolist(), lease.blocks, lease.addresses):
            np.testing.assert_array_equal(block, truth[int(want[row])])
            assert int(address) == block.ctypes.data
        served = ra.num_served
        bare = ra.lease("s", want, pinned=False)  # addresses only
        assert bare is not None and bare.blocks == []
        assert bare.addresses.tolist() == lease.addresses.tolist()
        assert ra.num_served == served + 3  # counted as served without the views too
        ra.release(bare)
        assert ra.lease("s", want, pinned=True) is None  # nothing here is pinned
        held = ra.held_bytes
        ra.drop("s")
        assert ra.held_bytes == held  # leased: the buffers are not back in the pool
        ra.release(lease)
        assert ra.held_bytes == 0
        assert ra.lease("s", want, pinned=False) is None  # dropped
    finally:
        ra.close()


def test_buffers_are_pinned_as_mapped_and_unpinned_as_they_leave(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    bb = 4096
    ra = ReadAhead(bb, 64 * bb, threads=1, rank=0)
    ra._job_rows = 2
    ra._free_cap = 1
    ra.pin_with(lambda addr, n: calls.append(("pin", n)),
                lambda addr: calls.append(("unpin", 0)))
    try:
        _read_done(ra, "s", 6)  # three jobs of 2 blocks
        assert calls == [("pin", 2 * bb)] * 3
        lease = ra.lease("s", np.arange(6), pinned=True)
        assert lease is not None and len(lease.rows) == 6
        ra.release(lease)
        ra.drop("s")  # one buffer kept for the next read ahead, two unpinned
        assert calls.count(("unpin", 0)) == 2
    finally:
        ra.close()
    assert calls.count(("unpin", 0)) == 3  # and the kept one at close


def test_a_buffer_that_cannot_be_pinned_is_never_leased_for_a_gpu_copy(tmp_path: Path) -> None:
    bb = 4096
    ra = ReadAhead(bb, 64 * bb, threads=1, rank=0)

    def refuse(addr: int, n: int) -> None:
        raise RuntimeError("cudaHostRegister: out of memory")
    ra.pin_with(refuse, lambda addr: None)
    try:
        _read_done(ra, "s", 2)
        assert ra.pin_error is not None and "out of memory" in ra.pin_error
        assert ra.lease("s", np.arange(2), pinned=True) is None
        lease = ra.lease("s", np.arange(2), pinned=False)
        assert lease is not None
        ra.release(lease)
    finally:
        ra.close()


def test_an_unpin_that_fails_loses_nothing(tmp_path: Path) -> None:
    bb = 4096
    ra = ReadAhead(bb, 64 * bb, threads=1, rank=0)
    ra._job_rows = 1
    ra._free_cap = 0  # every buffer leaves the pool when given back

    def refuse(addr: int) -> None:
        raise RuntimeError("cudaHostUnregister failed")
    ra.pin_with(lambda addr, n: None, refuse)
    try:
        _read_done(ra, "s", 2)
        ra.drop("s")  # unpins both: the failures are logged, the budget is given back
        assert ra.held_bytes == 0
        _read_done(ra, "t", 2)
    finally:
        ra.close()
