"""The pool/copy-engine cases of tests/unit on CUDA, through each copy method (GPU machine only)."""

import numpy as np
import pytest
import torch

from tests.pool_cases import check_round_trip, make_engine, random_fill
from tpkv.config import KvGeometry

pytestmark = pytest.mark.gpu

GEOMS = [
    KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),  # 2 MiB
    KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tp_size=8),  # 256 KiB
    KvGeometry(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float16", tp_size=2),  # 768 B
]


@pytest.mark.parametrize("method", ["dma", "kernel", "torch", "auto"])
@pytest.mark.parametrize("geometry", GEOMS, ids=lambda g: str(g.block_bytes))
def test_round_trip_cuda(geometry, method):
    engine = make_engine(geometry, l1_slots=64, l2_slots=40, device="cuda", method=method,
                         arena_blocks=16)
    assert engine.host.pinned
    for seed in range(2):
        check_round_trip(engine, seed)
    engine.host.close()


@pytest.mark.parametrize("method,kernel_args", [
    ("dma", None), ({"h2d": "dma", "d2h": "kernel"}, {"max_ctas": 16}),
    ("kernel", {"max_ctas": 3})], ids=["dma", "dma-up-kernel-down", "kernel-3-ctas"])
def test_both_directions_at_once_are_exact(method, kernel_args):
    g = GEOMS[1]
    engine = make_engine(g, l1_slots=128, l2_slots=128, device="cuda", arena_blocks=48,
                         method=method, kernel_args=kernel_args)
    random_fill(engine.hbm.tensor, 1)
    host_seed = engine.host.arenas
    for i, arena in enumerate(host_seed):
        random_fill(arena, 100 + i)
    want_host = [engine.host.block(s).clone() for s in range(64, 128)]
    want_hbm = engine.hbm.tensor[:64].cpu().clone()
    down = engine.d2h(np.arange(64), np.arange(64))       # L1 0..63 -> L2 0..63
    up = engine.h2d(np.arange(64, 128), np.arange(64, 128))  # L2 64..127 -> L1 64..127
    want = method if isinstance(method, dict) else {"h2d": method, "d2h": method}
    assert (up.method, down.method) == (want["h2d"], want["d2h"])
    down.wait()
    up.wait()
    for s in range(64):
        assert torch.equal(engine.host.block(s).view(torch.uint8), want_hbm[s].view(torch.uint8))
    got = engine.hbm.tensor[64:].cpu()
    for i in range(64):
        assert torch.equal(got[i].view(torch.uint8), want_host[i].view(torch.uint8))
    engine.host.close()


def test_d2h_waits_for_compute_on_current_stream():
    g = GEOMS[0]
    engine = make_engine(g, l1_slots=8, l2_slots=8, device="cuda")
    engine.hbm.tensor.zero_()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy, then write the block
    engine.hbm.tensor[3].fill_(1.5)
    engine.d2h(np.array([3]), np.array([0])).wait()
    assert (engine.host.block(0) == 1.5).all()
    engine.host.close()



@pytest.mark.parametrize("raw", [True, False], ids=["ctypes", "bindings"])
def test_dma_through_either_call_is_exact(monkeypatch, raw):
    """cudaMemcpyBatchAsync called through the loaded runtime (numpy arrays) and through
    cuda.bindings (lists) copy the same bytes; on this machine the direct call is found."""
    from tpkv.workers import cuda_rt

    monkeypatch.setattr(cuda_rt, "USE_RAW_BATCH", raw)
    assert (cuda_rt.raw_batch_call() is not None) == raw
    engine = make_engine(GEOMS[1], l1_slots=96, l2_slots=96, device="cuda", method="dma",
                         arena_blocks=40)
    for seed in range(2):
        check_round_trip(engine, seed)
    engine.host.close()


@pytest.mark.parametrize("method", ["dma", "kernel", "torch"])
def test_d2h_in_pieces_is_exact_and_gives_a_handle_per_piece(method):
    """d2h_pieces: 10 scattered blocks in pieces of 3 (3, 3, 3, 1), in order on one stream;
    every piece's event ends, and L2 holds exactly what L1 held."""
    g = GEOMS[1]
    engine = make_engine(g, l1_slots=32, l2_slots=32, device="cuda", arena_blocks=12,
                         method=method)
    random_fill(engine.hbm.tensor, 7)
    src = np.array([31, 2, 17, 5, 6, 7, 20, 11, 0, 29])
    dst = np.array([4, 30, 12, 13, 14, 1, 25, 9, 22, 3])
    want = engine.hbm.tensor[torch.from_numpy(src).cuda()].cpu().clone()
    handles = engine.d2h_pieces(src, dst, 3)
    assert [h.num_blocks for h in handles] == [3, 3, 3, 1]
    handles[-1].wait()
    assert all(h.done() for h in handles)
    for i, slot in enumerate(dst.tolist()):
        assert torch.equal(engine.host.block(slot).view(torch.uint8), want[i].view(torch.uint8))
    engine.host.close()
