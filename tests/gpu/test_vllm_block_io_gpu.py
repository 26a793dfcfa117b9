"""The vLLM connector's row copies on a GPU: by address from pinned store slots (one
cudaMemcpyBatchAsync), row by row from pageable arrays, and a copier's save and whole load
round trip, all bit-exact (GPU machine only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.layer_load_cases import LOADED, NAMES, loaded, stored_setup
from tpkv.integrations.vllm.block_io import KvRows, batch_of, block_views
from tpkv.integrations.vllm.host_slots import HostSlots
from tpkv.integrations.vllm.record import BlockRecord
from tpkv.workers import cuda_rt

pytestmark = pytest.mark.gpu

NUM_BLOCKS, LAYERS = 16, 4


def gpu_kv() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"l{i}": torch.randn(NUM_BLOCKS, 2, 16, 8, 64, generator=g).cuda()
            for i in range(LAYERS)}


def host_rows(caches: dict[str, torch.Tensor], block_id: int) -> np.ndarray:
    return torch.stack([t[block_id].reshape(-1).view(torch.uint8)
                        for t in caches.values()]).cpu().numpy()


def test_pinned_slots_go_by_address_both_ways_bit_exact() -> None:
    caches = gpu_kv()
    _, views = block_views(caches, NUM_BLOCKS)
    rows = KvRows(views)
    assert rows.batched == cuda_rt.has_memcpy_batch()
    slots = HostSlots((LAYERS, rows.page_bytes), 8)
    taken = [slots.take() for _ in range(3)]
    assert None not in taken and slots.pinned_for(taken)  # type: ignore[arg-type]
    blocks = [slots.view(s) for s in taken]  # type: ignore[arg-type]
    stream = torch.cuda.Stream()
    ids = [9, 2, 14]
    rows.save(ids, blocks, stream, pinned=True)
    for block_id, block in zip(ids, blocks):
        assert np.array_equal(block, host_rows(caches, block_id))
    recs = [BlockRecord(bytes([i]) * 16, b"p" * 16, (i,), b, 0, s)
            for i, (b, s) in enumerate(zip(blocks, taken))]
    own = host_rows(caches, 5)  # an array of its own (pageable): row by row
    recs.append(BlockRecord(b"o" * 16, b"p" * 16, (9,), own, 0))
    batch = batch_of([0, 1, 3, 4], recs, slots, on_gpu=True)
    assert [(g.ids, g.pinned) for g in batch.groups] == [([0, 1, 3], True), ([4], False)]
    before = {name: t.clone() for name, t in caches.items()}
    with torch.cuda.stream(stream):
        rows.load_batch(batch, None, stream)
    stream.synchronize()
    for name, t in caches.items():
        for src, dst in zip([9, 2, 14, 5], [0, 1, 3, 4]):
            assert torch.equal(t[dst], before[name][src])
        assert torch.equal(t[5:], before[name][5:])
    slots.close()


def test_a_copier_saves_and_loads_whole_on_the_gpu() -> None:
    caches, copier, _, plan = stored_setup("cuda")
    assert copier.store is not None and copier.store.slots.pool.pinned
    copier.load(plan.loads)  # whole: no layer order
    assert copier.take_failed_block_ids() == set()
    torch.cuda.synchronize()
    assert all(loaded(caches, name) for name in NAMES)
    assert copier.store.slots.num_free == copier.store.slots.num_slots - len(LOADED[:3])
    copier.close()
