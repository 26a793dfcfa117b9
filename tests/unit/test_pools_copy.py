"""L1/L2 pools and the copy engine on CPU: layout, arenas, bit-exact scattered copies, bad input."""

import numpy as np
import pytest
import torch

from tests.pool_cases import check_round_trip, make_engine
from tpkv.config import HostConfig, KvGeometry
from tpkv.errors import SlotError
from tpkv.workers.kernels import merged_copies
from tpkv.workers.pools import PAGE_BYTES, HbmPool, HostPool

GEOMS = [
    KvGeometry(num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16", tp_size=2),
    KvGeometry(num_layers=2, num_kv_heads=2, head_dim=6, dtype="float32", block_tokens=5),
    KvGeometry(num_layers=4, num_kv_heads=8, head_dim=16, dtype="float16", tp_size=8),
]


@pytest.mark.parametrize("geometry", GEOMS, ids=lambda g: f"{g.dtype}-{g.block_bytes}")
@pytest.mark.parametrize("arena_blocks", [None, 3])
def test_round_trip_cpu(geometry, arena_blocks):
    engine = make_engine(geometry, l1_slots=24, l2_slots=17, device="cpu",
                         arena_blocks=arena_blocks)
    assert engine.choose_method("d2h") == "torch"
    for seed in range(3):
        check_round_trip(engine, seed)


def test_host_pool_arenas_are_page_aligned_and_block_contiguous():
    g = GEOMS[0]
    pool = HostPool(g, 10, HostConfig(budget_bytes=1 << 20, arena_bytes=4 * g.block_bytes))
    assert pool.slots_per_arena == 4 and len(pool.arenas) == 3
    assert all(int(p) % PAGE_BYTES == 0 for p in pool.arena_ptrs)
    ptrs = pool.slot_ptrs(np.arange(10))
    assert ptrs[1] - ptrs[0] == g.block_bytes
    assert ptrs[5] == pool.arena_ptrs[1] + g.block_bytes
    ends = {int(p) + a.shape[0] * g.block_bytes for p, a in zip(pool.arena_ptrs, pool.arenas)}
    assert not ends & {int(p) for p in pool.arena_ptrs}, "two arenas are adjacent"
    view = pool.block_bytes_view(7)
    view[:] = 0xAB
    assert (pool.block(7).view(torch.uint8) == 0xAB).all()
    assert pool.block(7).shape == g.block_shape
    pool.close()


def test_pools_reject_bad_slots():
    g = GEOMS[0]
    hbm = HbmPool(g, 4, "cpu")
    with pytest.raises(SlotError, match="L1 slot 4 outside 0..3"):
        hbm.block(4)
    engine = make_engine(g, 4, 4, "cpu")
    before = engine.host.arenas[0].clone()
    with pytest.raises(SlotError, match="L2 slot outside 0..3"):
        engine.d2h(np.array([0, 1]), np.array([0, 9]))
    with pytest.raises(SlotError, match="2 L1 slots but 1 L2 slots"):
        engine.h2d(np.array([0]), np.array([0, 1]))
    assert torch.equal(engine.host.arenas[0].view(torch.uint8), before.view(torch.uint8))


def test_empty_batch_is_a_no_op():
    engine = make_engine(GEOMS[0], 4, 4, "cpu")
    h = engine.d2h(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert h.num_blocks == 0 and h.done()


def test_copies_merge_runs_only_where_both_sides_continue():
    """L2 slots 0-5 in arenas of 4 slots (slot 4 starts a new arena): a run is one copy only
    while both addresses continue, in ascending host address (or device address)."""
    b = 100
    arenas = np.array([10_000, 90_000], dtype=np.int64)
    hbm = np.array([5, 0, 1, 3, 4, 6], dtype=np.int64)
    host = np.array([5, 0, 1, 2, 3, 4], dtype=np.int64)  # host 3 -> 4 crosses arenas
    s, d, sizes = merged_copies(50_000, b, arenas, 4, hbm, host, True, True)
    # in host order: 0->0 and 1->1 merge; 2->3 and 3->4 merge; 4 (arena 1) -> 6 alone; 5 -> 5
    # alone (its L1 address goes down)
    assert s.tolist() == [10_000, 10_200, 90_000, 90_100]
    assert d.tolist() == [50_000, 50_300, 50_600, 50_500]
    assert sizes.tolist() == [200, 200, 100, 100]
    assert sizes.sum() == len(hbm) * b
    s, d, sizes = merged_copies(50_000, b, arenas, 4, hbm, host, False, False)  # L1 -> L2
    assert s.tolist() == [50_000, 50_300, 50_500, 50_600]  # by device address
    assert d.tolist() == [10_000, 10_200, 90_100, 90_000]
    assert sizes.tolist() == [200, 200, 100, 100]

