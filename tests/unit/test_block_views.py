"""HostPool.block_views: L2 blocks handed to the L3 store as views made on its thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tpkv.config import HostConfig, KvGeometry, SsdConfig
from tpkv.errors import SlotError, SsdRequestError
from tpkv.workers.executor import _by_session
from tpkv.workers.pools import HostPool
from tpkv.workers.ssd_backend import BlockViews, SpillViews
from tpkv.workers.ssd_store import SsdStore

# 4096-byte blocks: page-aligned, so O_DIRECT takes them without staging
GEO = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=8)


@pytest.fixture
def pool() -> HostPool:
    p = HostPool(GEO, 10, HostConfig(budget_bytes=1 << 20, arena_bytes=3 * GEO.block_bytes))
    for s in range(10):
        p.block_bytes_view(s)[:] = np.random.default_rng(s).integers(0, 256, GEO.block_bytes)
    yield p
    p.close()


def test_views_are_the_slots_blocks_across_arenas(pool: HostPool) -> None:
    slots = np.array([7, 0, 3, 9, 4])  # arenas of 3 slots: 2, 0, 1, 3, 1
    views = pool.block_views(slots)
    assert len(views) == 5 and views.page_aligned and views.block_bytes == GEO.block_bytes
    for i, s in enumerate(slots.tolist()):
        assert views[i].ctypes.data == pool.block_bytes_view(s).ctypes.data
    assert views[-1].ctypes.data == pool.block_bytes_view(4).ctypes.data
    part = views[1:4]
    assert isinstance(part, BlockViews) and part.slots.tolist() == [0, 3, 9]
    assert [v.ctypes.data for v in part] == [pool.block_bytes_view(s).ctypes.data
                                             for s in (0, 3, 9)]
    views[2][:] = 5  # writable, into the pool
    assert (pool.block_bytes_view(3) == 5).all()


def test_a_slot_outside_the_pool_is_refused_with_its_number(pool: HostPool) -> None:
    with pytest.raises(SlotError, match="L2 slot 10 outside 0..9"):
        pool.block_views(np.array([1, 10]))
    with pytest.raises(SlotError, match="L2 slot -1 outside"):
        pool.block_views(np.array([-1]))


@pytest.mark.parametrize("o_direct", [True, False])
def test_the_store_writes_and_reads_views_bit_exact(pool: HostPool, tmp_path: Path,
                                                    o_direct: bool) -> None:
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix", o_direct=o_direct),
                     GEO, "m", 0)
    try:
        want = [pool.block_bytes_view(s).copy() for s in (2, 5, 8)]
        assert store.write_blocks("s", np.array([0, 1, 2]), pool.block_views(np.array([2, 5, 8])))
        assert store.commit_manifest("s")
        dst = pool.block_views(np.array([9, 1, 6]))
        for v in dst:
            v[:] = 0
        hits = store.read_blocks("s", np.array([0, 1, 2]), dst)
        assert hits.all()
        for got, w in zip(dst, want):
            assert np.array_equal(got, w)
    finally:
        store.close()


def test_views_of_another_block_size_are_refused(tmp_path: Path) -> None:
    other = KvGeometry(num_layers=4, num_kv_heads=1, head_dim=64, dtype="float16",
                       block_tokens=8)
    big = HostPool(other, 2, HostConfig(budget_bytes=1 << 20))
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix"), GEO, "m", 0)
    try:
        with pytest.raises(SsdRequestError, match=f"{other.block_bytes} bytes; L3 needs "
                                                  f"blocks of {GEO.block_bytes}"):
            store.write_blocks("s", np.array([0]), big.block_views(np.array([1])))
        assert store.session_indices("s").tolist() == []  # nothing written
    finally:
        store.close()
        big.close()


def test_rows_split_by_session_in_plan_order() -> None:
    session_idx = np.array([2, 0, 2, 1, 0, 2, 5])
    parts = _by_session(session_idx, np.array([0, 1, 2, 3, 4, 5]))
    assert [p.tolist() for p in parts] == [[0, 2, 5], [1, 4], [3]]
    parts = _by_session(session_idx, np.array([6, 4, 0, 3]))
    assert [p.tolist() for p in parts] == [[6], [4], [0], [3]]
    assert _by_session(session_idx, np.array([], dtype=np.int64)) == []


# ---- SpillViews: a spill's slots taken back piece by piece ---------------------------------------


def test_spill_views_are_taken_back_once_the_pieces_that_carry_them_are_written(
        pool: HostPool) -> None:
    views = pool.spill_views(np.array([1, 2, 3, 4]))
    assert isinstance(views, SpillViews) and views.page_aligned
    assert views.take_back(np.array([], dtype=np.int64), timeout=0.0)  # nothing to wait for
    threading.Timer(0.2, views.written, args=(2,)).start()  # the first piece: positions 0, 1
    t0 = time.monotonic()
    assert views.take_back(np.array([1]), timeout=5.0)
    assert time.monotonic() - t0 >= 0.15
    assert views.take_back(np.array([0, 1]), timeout=0.0)  # written: no wait
    assert not views.take_back(np.array([1, 2]), timeout=0.05)  # 2 not written: timed out
    views.ended()  # the write returned (or failed): nothing is read any more
    assert views.take_back(np.array([2, 3]), timeout=0.0)


@pytest.mark.parametrize("o_direct", [True, False])
def test_a_spill_taken_back_midway_writes_what_it_was_given(pool: HostPool, tmp_path: Path,
                                                            o_direct: bool) -> None:
    """The store writes a spill a block a piece; a refill of some of its slots, started
    between two pieces, overwrites each only once the piece that carries it is written:
    every record read back holds the bytes the spill had at its start."""
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix", o_direct=o_direct,
                               write_piece_bytes=GEO.block_bytes), GEO, "m", 0)
    slots = np.array([0, 1, 2, 3, 4, 5])
    want = [pool.block_bytes_view(s).copy() for s in slots.tolist()]
    views = pool.spill_views(slots)
    pieces: list[int] = []
    refilled: list[int] = []  # the pieces begun when the refill overwrote the slots

    def refill() -> None:
        assert views.take_back(np.array([3, 4]), timeout=5.0)
        refilled.append(len(pieces))
        for s in (3, 4):
            pool.block_bytes_view(s)[:] = 0xEE

    def pause() -> None:  # before each piece of the write
        pieces.append(len(pieces))
        if len(pieces) == 3:  # two pieces written, the third about to be
            assert views.take_back(np.array([0, 1]), timeout=0.0)
            threading.Thread(target=refill).start()
            time.sleep(0.05)
            assert not refilled  # waits for pieces 3 and 4
    store._pause = lambda: pause  # type: ignore[method-assign]
    try:
        store.write_blocks("s", np.arange(6), views)
        assert store.commit_manifest("s") and len(pieces) == 6
        deadline = time.monotonic() + 5
        while not refilled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refilled and refilled[0] >= 5  # after the fifth piece (position 4) was written
        out = [np.zeros(GEO.block_bytes, dtype=np.uint8) for _ in range(6)]
        assert store.read_blocks("s", np.arange(6), out).all()
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, w)
        assert (pool.block_bytes_view(3) == 0xEE).all()
    finally:
        store.close()
