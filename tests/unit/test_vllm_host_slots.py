"""The vLLM connector's host memory is one HostPool of slots: the budget holds, a block's bytes
are copied once into its slot, and a slot stays unchanged while a load, a queued disk write or
the index still holds it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_vllm_async_load import caches, request, store_prompt, wait_finished
from tests.unit.test_vllm_disk_tier import RECORD, SEED, SHAPE, blocks
from tests.unit.test_vllm_disk_writer import BLOCK, Gate, gated_writes, host, wait_running
from tpkv.errors import SlotError
from tpkv.integrations.prefix_index import extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.host_slots import HostSlots
from tpkv.integrations.vllm.load_policy import LoadPolicy
from tpkv.integrations.vllm.options import DiskSpec
from tpkv.integrations.vllm.plan import SaveSpec
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.record import BlockRecord
from tpkv.integrations.vllm.store import HostBlockStore


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    yield from gated_writes(monkeypatch)


def test_slots_are_handed_out_lowest_first_and_freed_by_their_last_holder() -> None:
    slots = HostSlots(SHAPE, 3)
    assert slots.pool.total_bytes == 3 * BLOCK and slots.num_free == 3
    a, b = slots.take(), slots.take()
    assert (a, b) == (0, 1) and slots.num_used == 2
    assert slots.view(0).shape == SHAPE and slots.view(0).dtype == np.uint8
    slots.ref(0)
    slots.release(0)
    assert slots.refs(0) == 1 and slots.num_free == 1
    slots.release(0)
    assert slots.refs(0) == 0 and slots.num_free == 2
    with pytest.raises(SlotError, match="slot 0 released more often than held"):
        slots.release(0)
    with pytest.raises(SlotError, match="slot 0 is free"):
        slots.ref(0)
    assert slots.take() == 0 and slots.take() == 2 and slots.take() is None
    slots.close()


def test_blocks_live_in_the_pool_and_a_full_store_refuses_without_allocating() -> None:
    store = HostBlockStore(4 * BLOCK, SHAPE)
    bs = blocks(6)
    pool = store.slots.pool
    for b in bs[:4]:
        assert store.put(*b)
    for key, _, _, data in bs[:4]:
        rec = store.record(key)
        assert rec is not None and rec.slot >= 0
        # the record's bytes are the pool's slot, not an array of their own
        assert np.shares_memory(rec.data, pool.block_bytes_view(rec.slot))
        assert np.array_equal(rec.data, data)
    assert store.used_bytes == 4 * BLOCK == pool.total_bytes
    assert not store.put(*bs[4])  # no disk tier: the index drops, the store never evicts
    assert store.used_bytes == 4 * BLOCK and store.record(bs[4][0]) is None
    assert store.drop(bs[0][0]) and store.put(*bs[4])
    assert store.used_bytes == 4 * BLOCK
    store.close()


def test_a_block_is_copied_once_into_its_slot_and_a_bad_one_takes_none() -> None:
    store = HostBlockStore(2 * BLOCK, SHAPE)
    (key, parent, tokens, data), other = blocks(2)
    assert store.put(key, parent, tokens, data)
    assert np.array_equal(store.get(key), data)
    bad = other[3][:1]  # one layer of two
    assert not store.put(other[0], other[1], other[2], bad)
    assert not store.put(other[0], other[1], other[2], other[3].view(np.int8))
    assert not store.put(other[0], other[1], other[2], other[3][:, :-1])
    assert store.slots.num_free == 1 and store.record(other[0]) is None  # nothing taken
    store.close()


def test_a_held_record_keeps_its_slot_until_released() -> None:
    store = HostBlockStore(2 * BLOCK, SHAPE)
    bs = blocks(4)
    assert store.put(*bs[0]) and store.put(*bs[1])
    rec = store.take([bs[0][0]])[0]
    assert rec is not None and store.slots.refs(rec.slot) == 2
    assert store.drop(bs[0][0])  # the index forgets it; the load still reads its bytes
    assert not store.put(*bs[2])  # its slot is not free: a held slot counts against the budget
    assert store.used_bytes == 2 * BLOCK
    assert np.array_equal(rec.data, bs[0][3])
    store.release(rec)
    assert store.put(*bs[2]) and store.record(bs[2][0]).slot == rec.slot  # type: ignore[union-attr]
    assert store.take([bs[0][0]])[0] is None
    store.close()


def test_a_queued_write_holds_its_slot_until_written_and_a_load_beyond(
        tmp_path: Path, gate: Gate) -> None:
    store = host(tmp_path, capacity_blocks=4, queue_blocks=2)
    bs = blocks(4)
    for b in bs:
        assert store.put(*b)
    wait_running(store, gate)  # block 0 is being written, block 1 is queued
    held, pinned = store.hold_for_load(bs[0][0])
    assert held is not None and not pinned and store.slots.refs(held.slot) == 2
    gate.open.set()
    assert store.flush(10) and store.disk is not None and bs[0][0] in store.disk
    assert store.slots.refs(held.slot) == 1  # the writer let go; the load has not
    assert store.used_bytes == 3 * BLOCK  # block 1 written and freed, block 0 held by the load
    assert np.array_equal(held.data, bs[0][3])
    store.release(held)
    assert store.used_bytes == 2 * BLOCK and store.slots.num_free == 2
    got = store.get(bs[0][0])  # from disk, back into a slot
    assert got is not None and np.array_equal(got, bs[0][3])
    store.close()


def test_a_background_load_copies_its_blocks_though_their_slots_are_refilled() -> None:
    """The index drops the blocks of a load under way and new blocks fill the store: the load
    still copies the bytes it held, exactly, and their slots are reused only after it."""
    kv = caches(3)
    copier = BlockCopier(3 * BLOCK)
    copier.register(kv, 16)
    planner = Planner(4, SEED, 64, policy=LoadPolicy("always", 0, BLOCK, 64))
    prompt = list(range(700, 709))  # 2 full blocks
    store_prompt(planner, copier, prompt, [1, 2, 3])
    store = copier.store
    assert store is not None
    keys = extend_chain([], prompt, 4, SEED)
    expect = [store.get(k) for k in keys]

    release = threading.Event()
    entered = threading.Event()
    real = copier._copy_in

    def slow_copy_in(block_ids: list[int], recs: list[BlockRecord], stream: object) -> None:
        entered.set()
        assert release.wait(10)
        real(block_ids, recs, stream)

    copier._copy_in = slow_copy_in  # type: ignore[method-assign]
    copier.loader = None  # made anew with the slow copy
    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 8
    planner.after_alloc(req, [10, 11, 12], 8)
    copier.load(planner.plan([], lambda r: []).loads)
    assert entered.wait(10)
    with copier.lock:
        for key in keys:
            assert store.drop(key)
        fresh = blocks(3, start=900)
        assert store.put(*fresh[0])  # the one free slot
        assert not store.put(*fresh[1])  # the others are the load's
    release.set()
    assert wait_finished(copier) == {"r"} and copier.take_failed_block_ids() == set()
    for i, block_id in enumerate([10, 11]):
        got = torch.stack([kv[name][block_id].reshape(-1).view(torch.uint8)
                           for name in copier.layer_names]).numpy()
        assert np.array_equal(got, expect[i])
    assert store.slots.num_free == 2  # the load let its two slots go
    with copier.lock:
        assert store.put(*fresh[1]) and store.put(*fresh[2])
    copier.close()


def save_specs(keys_of: list[int], tokens: list[int]) -> list[SaveSpec]:
    """Saves of the full blocks of `tokens` (chain of SEED, 4 tokens a block) from vLLM blocks
    keys_of[i]."""
    keys = extend_chain([], tokens, 4, SEED)
    return [SaveSpec("w", keys_of[i], key, keys[i - 1] if i else SEED,
                     tuple(tokens[4 * i:4 * i + 4])) for i, key in enumerate(keys)]


@pytest.mark.parametrize("disk", [False, True])
def test_a_step_saving_more_blocks_than_slots_keeps_what_fits_exactly(
        tmp_path: Path, disk: bool) -> None:
    """Three slots, five saves in one step: without a disk tier the first three are kept and the
    others are failed saves; with one (written on the step's path), the batch so far is kept
    and moved out as the next blocks need room, so all five are held, bit-exact."""
    kv = caches(5)
    spec = DiskSpec(str(tmp_path), 16 * RECORD, SEED, 4, "test-model", queue_bytes=0)
    copier = BlockCopier(3 * BLOCK, spec if disk else None)
    copier.register(kv, 16)
    saves = save_specs([4, 9, 1, 12, 6], list(range(1000, 1020)))
    bad = SaveSpec("w", 2, b"\x00" * 16, SEED, (1, 2, 3, 4))  # not the key of its tokens
    copier.save([saves[0], bad, *saves[1:]])
    report = copier.take_report()
    store = copier.store
    assert report is not None and store is not None
    kept = saves if disk else saves[:3]
    assert report.saved == {s.key for s in kept}
    assert report.failed_saves == {bad.key} | {s.key for s in saves if s not in kept}
    assert store.used_bytes <= 3 * BLOCK and store.slots.num_used == len(store)
    for s in kept:
        want = torch.stack([t[s.block_id].reshape(-1).view(torch.uint8)
                            for t in kv.values()]).numpy()
        assert np.array_equal(store.get(s.key), want)
    copier.close()
