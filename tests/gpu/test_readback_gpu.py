"""HostReadback on CUDA: SM writes into pinned memory give exactly what .tolist() gives, also
while a large L1 -> L2 copy holds the copy engines, and the engine reads its tokens that way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpkv.config import HostConfig, KvGeometry
from tpkv.models.readback import HostReadback
from tpkv.workers import copy_kernel
from tpkv.workers.copy_engine import CopyEngine
from tpkv.workers.pools import HbmPool, HostPool

pytestmark = pytest.mark.gpu
needs_cupy = pytest.mark.skipif(not copy_kernel.available(), reason="needs CuPy")


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
@pytest.mark.parametrize("shape", [(1,), (3,), (5, 7), (3, 40000)])  # the last grows the buffer
def test_mapped_equals_tolist(dtype, shape):
    rb = HostReadback("cuda", capacity=4096)
    g = torch.Generator(device="cuda").manual_seed(1)
    t = (torch.randn(shape, device="cuda", generator=g) * 1000).to(dtype)
    assert rb.tolist(t) == t.tolist()
    got = rb.numpy(t[..., ::2])  # a strided view: copied contiguous first
    assert np.array_equal(got, t[..., ::2].cpu().numpy())
    assert rb.num_mapped == 2


@needs_cupy
def test_mapped_is_exact_while_a_large_demotion_runs():
    geom = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    n = 512
    hbm = HbmPool(geom, n, "cuda")
    host = HostPool(geom, n, HostConfig(budget_bytes=n * geom.block_bytes))
    try:
        hbm.tensor.normal_()
        engine = CopyEngine(hbm, host, method="dma")
        rb = HostReadback("cuda")
        logits = torch.randn(3, 128256, device="cuda")
        for _ in range(3):
            handle = engine.d2h(np.arange(n), np.arange(n)[::-1].copy())
            logits.mul_(-1.0)  # new values each round, ordered after nothing the copy does
            assert rb.tolist(logits.argmax(dim=-1)) == logits.argmax(dim=-1).tolist()
            handle.wait()
        assert torch.equal(host.block(0).to("cuda"), hbm.tensor[n - 1])
    finally:
        host.close()


def test_engine_reads_tokens_by_the_kernel():
    from tpkv.models.engine import PagedEngine
    from tpkv.models.llama import build_model

    model = build_model("small", seed=0, device="cuda")
    pool = HbmPool(model.kv_geometry(block_tokens=16), 64, model.device)
    engine = PagedEngine(model, pool.tensor, scheduler_seed=1)
    engine.add_turn("a", list(range(1, 40)), 4)
    engine.run()
    assert (engine.readback.num_mapped > 0) == copy_kernel.available()
