"""KvRows: a step's rows between vLLM's KV cache and host blocks, by address in one call (the
compiled loop on the CPU), bit-exact against row-by-row torch copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpkv.integrations.vllm.block_io import HostBatch, KvRows, RowGroup, batch_of, block_views
from tpkv.integrations.vllm.host_slots import HostSlots
from tpkv.integrations.vllm.record import BlockRecord
from tpkv.ssd import kernels

NUM_BLOCKS, LAYERS = 12, 3


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(NUM_BLOCKS, 2, 4, 8, generator=g) for i in range(LAYERS)}


def by_rows(caches: dict[str, torch.Tensor], block_id: int) -> np.ndarray:
    """The block as the store keeps it: [layers, page_bytes], one torch copy a row."""
    return torch.stack([t[block_id].reshape(-1).view(torch.uint8)
                        for t in caches.values()]).numpy()


@pytest.fixture(params=["by address", "row by row"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "row by row":  # as where the compiled loop does not run
        monkeypatch.setattr(kernels, "copy_addresses", lambda *a: False)
    else:
        assert kernels.available()
    return str(request.param)


def test_addresses_are_layer_then_block() -> None:
    caches = kv(0)
    _, views = block_views(caches, NUM_BLOCKS)
    rows = KvRows(views)
    page = rows.page_bytes
    blocks = [np.zeros((LAYERS, page), np.uint8) for _ in range(2)]
    got_kv, got_host = rows.addresses([5, 2], kernels.addresses(blocks)[0], [2, 0])
    want_kv = [views[2].data_ptr() + 5 * page, views[2].data_ptr() + 2 * page,
               views[0].data_ptr() + 5 * page, views[0].data_ptr() + 2 * page]
    want_host = [blocks[0].ctypes.data + 2 * page, blocks[1].ctypes.data + 2 * page,
                 blocks[0].ctypes.data, blocks[1].ctypes.data]
    assert got_kv.tolist() == want_kv and got_host.tolist() == want_host


def test_save_then_load_is_bit_exact_and_touches_nothing_else(mode: str) -> None:
    caches = kv(1)
    _, views = block_views(caches, NUM_BLOCKS)
    rows = KvRows(views)
    ids = [7, 0, 11, 3]
    blocks = [np.full((LAYERS, rows.page_bytes), 0xAB, np.uint8) for _ in ids]
    rows.save(ids, blocks)
    for block_id, block in zip(ids, blocks):
        assert np.array_equal(block, by_rows(caches, block_id))
    before = {name: t.clone() for name, t in caches.items()}
    targets = [1, 2, 9, 10]
    rows.load(RowGroup.of(targets, blocks, True))
    for name, t in caches.items():
        for src, dst in zip(ids, targets):
            assert torch.equal(t[dst], before[name][src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in targets]
        assert torch.equal(t[untouched], before[name][untouched])


def test_a_load_of_some_layers_copies_only_those(mode: str) -> None:
    caches = kv(2)
    _, views = block_views(caches, NUM_BLOCKS)
    rows = KvRows(views)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, (LAYERS, rows.page_bytes), dtype=np.uint8) for _ in range(2)]
    before = {name: t.clone() for name, t in caches.items()}
    rows.load(RowGroup.of([4, 6], blocks, True), layers=[1])
    names = list(caches)
    for layer, name in enumerate(names):
        for block_id, block in zip([4, 6], blocks):
            got = caches[name][block_id].reshape(-1).view(torch.uint8).numpy()
            if layer == 1:
                assert np.array_equal(got, block[1])
            else:
                assert torch.equal(caches[name][block_id], before[name][block_id])


def test_a_batch_off_a_gpu_is_one_group_of_slots_and_arrays_alike() -> None:
    slots = HostSlots((LAYERS, 256), 2)
    slot = slots.take()
    assert slot is not None
    own = np.zeros((LAYERS, 256), np.uint8)
    recs = [BlockRecord(b"k" * 16, b"p" * 16, (1,), slots.view(slot), 0, slot),
            BlockRecord(b"j" * 16, b"p" * 16, (2,), own, 0)]
    batch = batch_of([3, 4], recs, slots, on_gpu=False)
    assert len(batch) == 2 and [g.ids for g in batch.groups] == [[3, 4]]
    assert batch.groups[0].host.tolist() == [slots.view(slot).ctypes.data, own.ctypes.data]
    # on a GPU, only slots of pinned memory go by address; a pool not pinned has none
    gpu = batch_of([3, 4], recs, slots, on_gpu=True)
    assert [(g.ids, g.pinned) for g in gpu.groups] == [([3, 4], False)]
    assert len(HostBatch()) == 0 and len(batch_of([], [], slots, on_gpu=False)) == 0
    slots.close()
