"""A save's CRC32Cs are taken on the store's CrcJobs thread after the save returns: a reader
waits for them, the job holds its slots until done, and a job that fails leaves misses."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.unit.test_vllm_disk_tier import SHAPE, blocks
from tests.unit.test_vllm_disk_writer import BLOCK
from tpkv.integrations.vllm import crc_jobs
from tpkv.integrations.vllm.record import PendingCrc, crc_value
from tpkv.integrations.vllm.store import HostBlockStore
from tpkv.ssd.crc_threads import crc_spread
from tpkv.ssd.format import crc_of


class Gated:
    """crc_spread held back until `go` is set; `entered` once a job called it."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.fail = fail

    def __call__(self, bufs: list[np.ndarray]) -> list[int]:
        self.entered.set()
        assert self.go.wait(10)
        if self.fail:
            raise RuntimeError("checksum unit gone")
        return crc_spread(bufs)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Gated:
    g = Gated()
    monkeypatch.setattr(crc_jobs, "crc_spread", g)
    return g


def test_a_save_returns_before_its_crcs_and_a_read_waits_for_them(gated: Gated) -> None:
    store = HostBlockStore(8 * BLOCK, SHAPE)
    bs = blocks(3)
    for b in bs:
        assert store.put(*b)  # returns with the job still held back
    assert gated.entered.wait(10)
    rec = store._records[bs[1][0]]
    assert isinstance(rec.crc, PendingCrc)
    assert store.slots.refs(rec.slot) == 2  # the index's hold and the job's
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(store.take([bs[1][0]])[0]))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # the read waits for the CRC32C
    gated.go.set()
    reader.join(10)
    assert got and got[0] is not None
    store.release(got[0])  # type: ignore[arg-type]
    for b in bs:
        r = store.record(b[0])
        assert r is not None and crc_value(r) == crc_of(b[3])
        assert store.slots.refs(r.slot) == 1  # the job let its hold go
    store.close()


def test_bytes_damaged_after_the_job_fail_their_check(gated: Gated) -> None:
    gated.go.set()
    store = HostBlockStore(8 * BLOCK, SHAPE)
    bs = blocks(2)
    for b in bs:
        assert store.put(*b)
    rec = store.record(bs[0][0])  # waits for the job
    assert rec is not None
    rec.data[0, 1] ^= 0x08
    assert store.take([bs[0][0]]) == [None] and store.num_bad_reads == 1
    assert store.get(bs[1][0]) is not None
    store.close()


def test_a_failed_job_leaves_misses_and_frees_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    g = Gated(fail=True)
    g.go.set()
    monkeypatch.setattr(crc_jobs, "crc_spread", g)
    store = HostBlockStore(4 * BLOCK, SHAPE)
    bs = blocks(2)
    for b in bs:
        assert store.put(*b)
    assert store.take([b[0] for b in bs]) == [None, None]  # never served unchecked
    assert store.num_bad_reads == 2 and len(store) == 0
    assert store.slots.num_free == store.slots.num_slots
    store.close()


def test_close_waits_for_the_jobs(gated: Gated) -> None:
    store = HostBlockStore(4 * BLOCK, SHAPE)
    assert store.put(*blocks(1)[0])
    assert gated.entered.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # the slots stay until the job is done
    gated.go.set()
    closer.join(10)
    assert not closer.is_alive()
