"""The vLLM connector's background disk writer without vLLM: the step never waits on a disk
write, queued blocks are served from memory, a writer that falls behind loses blocks honestly,
a block dropped before its write lands is never adopted, disk hits come back into memory, and
disk loads are counted only up to a request's first failed block."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.unit.test_vllm_disk_tier import BT, RECORD, SEED, SHAPE, blocks, caches, layout
from tpkv.errors import ConfigError
from tpkv.integrations.disk_blocks import DiskBlockStore, stored_keys
from tpkv.integrations.prefix_index import PrefixIndex, extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.disk_writer import DiskWriter
from tpkv.integrations.vllm.options import ConnectorOptions, DiskSpec, write_queue_blocks
from tpkv.integrations.vllm.plan import StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.store import BlockRecord, HostBlockStore
from tpkv.ssd.format import crc_of

BLOCK = SHAPE[0] * SHAPE[1]


class Gate:
    """Holds every disk record write until opened: a disk as slow as the test wants."""

    def __init__(self) -> None:
        self.entered = threading.Event()  # a write is waiting
        self.open = threading.Event()
        self.writes = 0


def gated_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Every disk record write waits for the gate (the body of a `gate` fixture)."""
    g = Gate()
    real = DiskBlockStore.write

    def slow_write(self: DiskBlockStore, *args: object) -> bool:
        g.entered.set()
        assert g.open.wait(20), "the test never opened the gate"
        g.writes += 1
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskBlockStore, "write", slow_write)
    yield g
    g.open.set()  # never leave a writer thread stuck


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    yield from gated_writes(monkeypatch)


def host(tmp_path: Path, capacity_blocks: int, queue_blocks: int,
         disk_records: int = 20) -> HostBlockStore:
    disk = DiskBlockStore(str(tmp_path), disk_records * RECORD, layout())
    return HostBlockStore(capacity_blocks * BLOCK, SHAPE, disk, queue_blocks)


def wait_running(store: HostBlockStore, gate: Gate) -> None:
    assert gate.entered.wait(10), "the writer never started a write"


def prompt_step(planner: Planner, copier: BlockCopier, req_id: str, prompt: list[int],
                block_ids: list[int]) -> tuple[StepReport, float]:
    """One step of a fresh request: plan, load, forward (none), save; the report and the
    seconds apply_after_forward (vLLM's wait_for_save) took."""
    req = SimpleNamespace(request_id=req_id, all_token_ids=prompt)
    matched = planner.matched_tokens(req, 0)
    if matched:
        planner.after_alloc(req, block_ids, matched)
    plan = planner.plan([(req_id, len(prompt))], lambda r: block_ids)
    copier.load(plan.loads)
    began = time.perf_counter()
    copier.apply_after_forward(plan)
    took = time.perf_counter() - began
    report = copier.take_report() or StepReport()
    planner.report(report)
    return report, took


def test_the_step_does_not_wait_for_a_slow_disk(tmp_path: Path, gate: Gate) -> None:
    """Eight blocks saved into a host store of 8 with a queue of 4: four go to the writer,
    whose disk does not answer; wait_for_save returns at once, the records land later."""
    spec = DiskSpec(str(tmp_path), 20 * RECORD, SEED, BT, "test-model", queue_bytes=4 * BLOCK)
    copier = BlockCopier(8 * BLOCK, spec)
    copier.register(caches(16, 0), 16)
    planner = Planner(BT, SEED, capacity_blocks=8 - 4 + 20)
    prompt = list(range(1000, 1000 + 8 * BT + 1))
    report, took = prompt_step(planner, copier, "r1", prompt, list(range(8)))
    assert len(report.saved) == 8 and not report.lost
    assert took < 2.0, f"wait_for_save took {took:.2f} s behind a stuck disk"
    store = copier.store
    assert store is not None and store.disk is not None and store.writer is not None
    wait_running(store, gate)
    assert len(store) == 4 and store.num_pending == 4 and len(store.disk) == 0
    assert store.used_bytes == 8 * BLOCK == store.capacity_bytes
    gate.open.set()
    assert store.flush(10)
    keys = extend_chain([], prompt, BT, SEED)
    assert store.disk.keys() == keys[:4] and store.keys() == keys[4:]
    assert store.num_pending == 0 and gate.writes == 4
    store.close()


def test_a_block_queued_for_disk_is_read_from_memory(tmp_path: Path, gate: Gate) -> None:
    store = host(tmp_path, capacity_blocks=6, queue_blocks=2)
    bs = blocks(6)
    for b in bs:
        assert store.put(*b)
    wait_running(store, gate)  # block 0 is being written, block 1 is queued
    assert store.disk is not None and store.writer is not None
    assert store.writer.pending(bs[0][0]) is not None and store.writer.pending(bs[1][0])
    got = store.get(bs[1][0])  # queued: taken back into memory, its write not made
    assert got is not None and np.array_equal(got, bs[1][3])
    assert store.writer.pending(bs[1][0]) is None and bs[1][0] in store.keys()
    got = store.get(bs[0][0])  # being written: served from memory meanwhile
    assert got is not None and np.array_equal(got, bs[0][3])
    assert len(store.disk) == 0 and store.used_bytes <= store.capacity_bytes
    gate.open.set()
    assert store.flush(10)
    assert bs[0][0] in store.disk and bs[1][0] not in store.disk
    assert all(store.holds(b[0]) for b in bs) and store.take_lost() == []
    for key, _, _, data in bs:
        got = store.get(key)
        assert got is not None and np.array_equal(got, data)
    store.close()


def test_a_writer_that_falls_behind_loses_the_oldest_queued_and_the_index_forgets(
        tmp_path: Path, gate: Gate) -> None:
    """Ten blocks in one step into 8 of host memory, 4 of them for the queue, the disk stuck:
    the two oldest queued writes are given up (never blocking), reported, forgotten by the
    index and dropped on every rank; the index claims only what the store holds."""
    spec = DiskSpec(str(tmp_path), 20 * RECORD, SEED, BT, "test-model", queue_bytes=4 * BLOCK)
    copier = BlockCopier(8 * BLOCK, spec)
    copier.register(caches(16, 1), 16)
    planner = Planner(BT, SEED, capacity_blocks=8 - 4 + 20)
    prompt = list(range(2000, 2000 + 10 * BT + 1))
    keys = extend_chain([], prompt, BT, SEED)
    report, took = prompt_step(planner, copier, "r1", prompt, list(range(10)))
    assert took < 2.0
    store = copier.store
    assert store is not None and store.disk is not None
    lost = report.lost  # the oldest two queued: blocks 1, 2 (or 0, 1 if 0 was not started)
    assert len(lost) == 2 and lost <= set(keys[:3]) and store.num_dropped == 2
    assert store.used_bytes <= store.capacity_bytes
    assert not any(planner.index.holds(k) for k in lost)
    held = [k for k in keys if planner.index.holds(k)]
    assert len(held) == 8 and all(store.holds(k) for k in held)
    # a returning prompt matches only up to the first lost block
    again = SimpleNamespace(request_id="r2", all_token_ids=list(prompt))
    first_lost = min(keys.index(k) for k in lost)
    assert planner.matched_tokens(again, 0) == first_lost * BT
    plan = planner.plan([], lambda r: [])
    assert sorted(plan.drops) == sorted(lost)
    gate.open.set()
    assert store.flush(10)
    copier.apply_after_forward(plan)
    assert sorted(store.disk.keys()) == sorted(set(keys[:6]) - lost)
    assert not any(store.holds(k) for k in lost)
    store.close()


def test_a_block_dropped_before_its_write_lands_is_never_adopted(tmp_path: Path,
                                                                 gate: Gate) -> None:
    store = host(tmp_path, capacity_blocks=6, queue_blocks=2)
    bs = blocks(6)
    for b in bs:
        assert store.put(*b)
    wait_running(store, gate)
    assert store.disk is not None
    assert store.drop(bs[0][0])  # being written: deleted once written
    assert store.drop(bs[1][0])  # queued: never written
    gate.open.set()
    assert store.flush(10)
    assert not store.holds(bs[0][0]) and not store.holds(bs[1][0])
    assert not os.path.exists(store.disk.path(bs[0][0]))
    assert not os.path.exists(store.disk.path(bs[1][0]))
    assert store.disk.used_bytes == 0 and gate.writes == 1 and store.take_lost() == []
    store.close()
    index = PrefixIndex(capacity_blocks=10)
    assert index.adopt(stored_keys(str(tmp_path), SEED, BT, 1)) == 0


def test_a_key_written_again_after_a_cancelled_write_is_kept(tmp_path: Path,
                                                             gate: Gate) -> None:
    """The cancelled write's delete lands before the new write of the same key."""
    disk = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    writer = DiskWriter(disk, 4)
    key, parent, toks, data = blocks(1)[0]
    rec = BlockRecord(key, parent, toks, data, crc_of(data))
    with writer.lock:
        writer.submit(rec)
    assert gate.entered.wait(10)
    with writer.lock:
        assert writer.cancel(key) and writer.pending(key) is None
        writer.submit(rec)
    gate.open.set()
    assert writer.flush(10) and writer.close()
    got = disk.get(key)
    assert got is not None and np.array_equal(got, data) and disk.used_bytes == RECORD
    disk.close()


def test_a_failed_background_write_leaves_nothing_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    store = host(tmp_path, capacity_blocks=4, queue_blocks=1)
    bs = blocks(4)
    for b in bs:
        assert store.put(*b)  # block 0 goes to the writer, whose write fails
    assert store.flush(10)
    assert store.disk is not None and store.disk.used_bytes == 0 and len(store.disk) == 0
    assert os.listdir(store.disk.dir) == []
    assert store.take_lost() == [bs[0][0]] and not store.holds(bs[0][0])
    assert store.used_bytes == 3 * BLOCK and store.num_pending == 0
    monkeypatch.undo()
    store.close()


def test_a_disk_hit_comes_back_into_memory(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    store = host(tmp_path, capacity_blocks=4, queue_blocks=1)
    bs = blocks(4)
    for b in bs:
        assert store.put(*b)
    assert store.flush(10)
    disk = store.disk
    assert disk is not None and disk.keys() == [bs[0][0]]
    got = store.get(bs[0][0])
    assert got is not None and np.array_equal(got, bs[0][3])
    assert store.num_promoted == 1 and bs[0][0] in store.keys()
    assert bs[0][0] in disk and disk.is_cached(bs[0][0])  # its record stays
    assert store.flush(10) and disk.keys() == [bs[0][0], bs[1][0]]  # the oldest made room
    reads = []
    real = DiskBlockStore.get_record
    monkeypatch.setattr(DiskBlockStore, "get_record",
                        lambda self, key: reads.append(key) or real(self, key))
    for _ in range(3):  # a hot prefix pays no more disk reads
        got = store.get(bs[0][0])
        assert got is not None and np.array_equal(got, bs[0][3])
    assert reads == []
    # moving it out of memory again writes nothing: its record is there
    assert store.writer is not None
    written = store.writer.num_written
    for b in blocks(3, start=100):
        assert store.put(*b) and store.flush(10)  # each write lands before the next put
    assert bs[0][0] not in store.keys() and store.take_lost() == []
    assert store.writer.num_written == written + 2 and not disk.is_cached(bs[0][0])
    got = store.get(bs[0][0])
    assert got is not None and np.array_equal(got, bs[0][3])
    store.close()


def test_a_full_disk_gives_up_records_memory_holds_too_first(tmp_path: Path) -> None:
    disk = DiskBlockStore(str(tmp_path), 3 * RECORD, layout())
    bs = blocks(4)
    for b in bs[:3]:
        assert disk.put(*b)
    disk.mark_cached(bs[1][0])
    assert disk.put(*bs[3])
    assert disk.keys() == [bs[0][0], bs[2][0], bs[3][0]] and disk.used_bytes == 3 * RECORD
    disk.close()


def test_disk_loaded_blocks_counts_only_blocks_before_the_first_failed_one(
        tmp_path: Path) -> None:
    bs = blocks(3)
    disk = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    for b in bs:
        assert disk.put(*b)
    raw = bytearray(Path(disk.path(bs[1][0])).read_bytes())
    raw[-1] ^= 0x01  # block 1's record is damaged; blocks 0 and 2 are fine
    Path(disk.path(bs[1][0])).write_bytes(bytes(raw))
    disk.close()
    spec = DiskSpec(str(tmp_path), 10 * RECORD, SEED, BT, "test-model", queue_bytes=1 * BLOCK)
    kv = caches(16, 3)
    copier = BlockCopier(8 * BLOCK, spec)
    copier.register(kv, 16)
    planner = Planner(BT, SEED, capacity_blocks=8 - 1 + 10)
    assert planner.index.adopt(stored_keys(str(tmp_path), SEED, BT, 1)) == 3
    prompt = list(range(3 * BT)) + [7]
    report, _ = prompt_step(planner, copier, "r1", prompt, [5, 6, 7, 8])
    assert report.disk_loads == {"r1": {0, 2}} and report.failed_load_reqs == {"r1": 1}
    assert torch.equal(kv["layer0"][5].view(torch.uint8).reshape(-1),
                       torch.from_numpy(bs[0][3][0]))
    stats = planner.finished("r1")
    assert stats["disk_loaded_blocks"] == 1 and stats["failed_load_blocks"] == 1
    assert copier.store is not None
    copier.store.close()
    # over ranks: one rank loaded blocks 0..2 from disk, another failed block 1
    one = StepReport(disk_loads={"r": {0, 1, 2}})
    other = StepReport(failed_loads={b"k"}, failed_load_reqs={"r": 1})
    merged = one.merge(other)
    assert merged.disk_loads == {"r": {0, 1, 2}} and merged.failed_load_reqs == {"r": 1}
    planner2 = Planner(BT, SEED, capacity_blocks=4)
    planner2.matched_tokens(SimpleNamespace(request_id="r", all_token_ids=prompt), 0)
    planner2.report(merged)
    assert planner2.finished("r")["disk_loaded_blocks"] == 1


def test_disk_queue_bytes_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="disk_queue_bytes is '1MiB' but disk_dir is not set"):
        ConnectorOptions.from_extra({"disk_queue_bytes": "1MiB"})
    with pytest.raises(ConfigError, match="disk_queue_bytes 4096 must be below host_bytes 4096"):
        ConnectorOptions.from_extra({"disk_dir": str(tmp_path), "host_bytes": 4096,
                                     "disk_queue_bytes": 4096})
    opts = ConnectorOptions.from_extra({"disk_dir": str(tmp_path), "disk_queue_bytes": 0})
    assert opts.disk_queue_bytes == 0
    assert write_queue_blocks(8 * BLOCK, None, BLOCK) == 2  # a quarter by default
    assert write_queue_blocks(3 * BLOCK, None, BLOCK) == 0  # too small: written in line
    with pytest.raises(ConfigError, match=r"\(4 blocks of 512 bytes\) leaves no room in "
                                          r"host_bytes 2048 \(4 blocks\)"):
        write_queue_blocks(4 * BLOCK, 4 * BLOCK, BLOCK)
    with pytest.raises(ConfigError, match="a disk write queue of 4 blocks leaves no room"):
        host(tmp_path, capacity_blocks=4, queue_blocks=4)


def test_blocks_a_full_queue_gives_up_are_counted_and_logged_at_a_bounded_rate(
        tmp_path: Path, gate: Gate, caplog: pytest.LogCaptureFixture) -> None:
    """A queue of 4 blocks behind a stuck disk, 12 blocks into 8 of memory: each of the 4
    blocks given up is counted; the warning names disk_queue_bytes, its value and the bytes
    the writer needed, at the first drop, then not again within the interval, then with the
    running count, and once more at close for the drops since."""
    disk = DiskBlockStore(str(tmp_path), 20 * RECORD, layout())
    store = HostBlockStore(8 * BLOCK, SHAPE, disk, queue_blocks=4, queue_bytes=4 * BLOCK)
    writer = store.writer
    assert writer is not None
    now = [100.0]
    writer.clock = lambda: now[0]
    bs = blocks(12)
    for b in bs[:8]:
        assert store.put(*b)
    wait_running(store, gate)  # block 0 is being written, 1-3 are queued

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and "disk write queue" in r.getMessage()]

    caplog.set_level("WARNING", logger="tpkv.integrations.vllm.disk_writer")
    assert store.put(*bs[8])  # block 1 given up: the queue (4 blocks) needed a fifth
    assert writer.num_dropped == 1 and writer.bytes_dropped == BLOCK
    first = warnings()
    assert len(first) == 1
    assert (f"disk_queue_bytes is {4 * BLOCK} (4 blocks)" in first[0]
            and f"needed {5 * BLOCK} bytes" in first[0] and f"1 blocks ({BLOCK} bytes)" in first[0])
    assert store.put(*bs[9])  # within the interval: counted, not logged
    assert writer.num_dropped == 2 and len(warnings()) == 1
    now[0] += writer.warn_interval_s
    assert store.put(*bs[10])
    assert len(warnings()) == 2
    assert (f"3 blocks ({3 * BLOCK} bytes)" in warnings()[1]
            and f"needed {7 * BLOCK} bytes" in warnings()[1])
    assert store.put(*bs[11])
    assert writer.num_dropped == 4 == store.num_dropped and writer.bytes_dropped == 4 * BLOCK
    assert len(warnings()) == 2 and len(store.take_lost()) == 4
    gate.open.set()
    assert store.flush(10)
    store.close()  # the drop since the last warning is said at close
    assert len(warnings()) == 3 and f"4 blocks ({4 * BLOCK} bytes)" in warnings()[2]
