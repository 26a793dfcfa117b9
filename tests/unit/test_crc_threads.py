"""CRC32Cs spread over threads equal those taken one by one, and a store's batch read still
finds the one damaged record among many."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.unit.test_vllm_disk_tier import SHAPE, blocks
from tests.unit.test_vllm_disk_writer import BLOCK
from tpkv.integrations.vllm.record import crc_value
from tpkv.integrations.vllm.store import HostBlockStore
from tpkv.ssd import crc_threads
from tpkv.ssd.crc_threads import crc_spread
from tpkv.ssd.format import crc_of


@pytest.fixture
def spread(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Four threads, a share from 1 KiB: small batches are spread too. Yields the names of the
    threads that took a CRC32C."""
    names: list[str] = []
    monkeypatch.setattr(crc_threads, "threads", lambda: 4)
    monkeypatch.setattr(crc_threads, "MIN_SHARE_BYTES", 1024)

    def named(b: np.ndarray) -> int:
        names.append(threading.current_thread().name)
        return crc_of(b)

    monkeypatch.setattr(crc_threads, "crc_of", named)
    return names


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 33])
def test_spread_crcs_equal_one_by_one_in_order(spread: list[str], n: int) -> None:
    rng = np.random.default_rng(n)
    bufs = [rng.integers(0, 256, 1024 + 512 * i, dtype=np.uint8) for i in range(n)]
    assert crc_spread(bufs) == [crc_of(b) for b in bufs]
    assert len(spread) == n
    if n >= 2:  # shares went to the pool
        assert any(name.startswith("tpkv-crc") for name in spread)


def test_a_small_batch_stays_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str] = []
    monkeypatch.setattr(crc_threads, "threads", lambda: 4)
    monkeypatch.setattr(crc_threads, "crc_of",
                        lambda b: names.append(threading.current_thread().name) or crc_of(b))
    bufs = [np.full(100, i, dtype=np.uint8) for i in range(8)]  # 800 bytes: below a share
    assert crc_spread(bufs) == [crc_of(b) for b in bufs]
    assert set(names) == {threading.current_thread().name}
    assert crc_spread([]) == []


def test_a_batch_read_fails_only_the_damaged_record(spread: list[str]) -> None:
    store = HostBlockStore(16 * BLOCK, SHAPE)
    bs = blocks(12)
    for b in bs:
        assert store.put(*b)
    damaged = bs[7][0]
    rec = store.record(damaged)
    assert rec is not None
    rec.data[1, 3] ^= 0x10
    got = store.take([b[0] for b in bs])
    assert [r is None for r in got] == [b[0] == damaged for b in bs]
    for b, r in zip(bs, got):
        if r is not None:
            assert np.array_equal(r.data, b[3])
            store.release(r)
    assert store.num_bad_reads == 1 and store.record(damaged) is None  # dropped
    assert store.take([damaged]) == [None]
    assert any(name.startswith("tpkv-crc") for name in spread)
    store.close()


def test_saved_blocks_carry_the_crc_of_their_bytes(spread: list[str]) -> None:
    store = HostBlockStore(16 * BLOCK, SHAPE)
    bs = blocks(9)
    slots = [store.reserve(k, p, t) for k, p, t, _ in bs]
    for slot, b in zip(slots, bs):
        assert slot is not None and slot >= 0
        store.slots.view(slot)[...] = b[3]
    store.admit([b[0] for b in bs])
    for b in bs:
        rec = store.record(b[0])
        assert rec is not None and crc_value(rec) == crc_of(b[3])
    store.close()
