"""HostPool.block_views: L2 blocks handed to the L3 store as views made on its thread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tpkv.config import HostConfig, KvGeometry, SsdConfig
from tpkv.errors import SlotError, SsdRequestError
from tpkv.ssd import kernels
from tpkv.ssd.backend import BlockViews
from tpkv.ssd.store import SsdStore
from tpkv.workers.pools import HostPool
from tpkv.workers.reads import by_session

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
    # their addresses at once (the store's CRCs and copies take them so, not view by view)
    assert views.addresses(np.arange(5)).tolist() == [
        pool.block_bytes_view(s).ctypes.data for s in slots.tolist()]
    assert part.addresses(np.array([2])).tolist() == [pool.block_bytes_view(9).ctypes.data]
    views[2][:] = 5  # writable, into the pool
    assert (pool.block_bytes_view(3) == 5).all()


def test_a_slot_outside_the_pool_is_refused_with_its_number(pool: HostPool) -> None:
    with pytest.raises(SlotError, match="L2 slot 10 outside 0..9"):
        pool.block_views(np.array([1, 10]))
    with pytest.raises(SlotError, match="L2 slot -1 outside"):
        pool.block_views(np.array([-1]))


@pytest.mark.parametrize("o_direct", [True, False])
def test_the_store_writes_and_reads_views_bit_exact(pool: HostPool, tmp_path: Path,
                                                    o_direct: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """...with the records' headers (CRCs) made from the views' addresses in one call."""
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix", o_direct=o_direct),
                     GEO, "m", 0)
    given: list[type] = []
    real = kernels.fill_headers
    monkeypatch.setattr(kernels, "fill_headers",
                        lambda h, t, i, n, payloads: given.append(type(payloads))
                        or real(h, t, i, n, payloads))
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
        assert given == [BlockViews]  # one chunk: the pool's views, not a list of them
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
    parts = by_session(session_idx, np.array([0, 1, 2, 3, 4, 5]))
    assert [p.tolist() for p in parts] == [[0, 2, 5], [1, 4], [3]]
    parts = by_session(session_idx, np.array([6, 4, 0, 3]))
    assert [p.tolist() for p in parts] == [[6], [4], [0], [3]]
    assert by_session(session_idx, np.array([], dtype=np.int64)) == []
