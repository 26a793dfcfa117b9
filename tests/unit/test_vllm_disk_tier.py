"""The disk tier of the vLLM connector without vLLM: cap, LRU eviction, restart, damage, config."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tpkv.errors import ConfigError, SsdRootInUseError
from tpkv.integrations.disk_blocks import DiskBlockStore, stored_keys
from tpkv.integrations.disk_format import DiskLayout, rank_dir, record_bytes
from tpkv.integrations.prefix_index import PrefixIndex, block_key, chain_seed, extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.options import ConnectorOptions, DiskSpec
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.store import HostBlockStore

BT = 4
SHAPE = (2, 256)  # two layers of 256 bytes a block
SEED = chain_seed("test-model", BT)
RECORD = record_bytes(BT, SHAPE[0] * SHAPE[1])


def layout(rank: int = 0, seed: bytes = SEED) -> DiskLayout:
    return DiskLayout(seed, rank, BT, SHAPE)


def blocks(n: int, seed: bytes = SEED, start: int = 0
           ) -> list[tuple[bytes, bytes, tuple[int, ...], np.ndarray]]:
    """n chained blocks (key, parent, tokens, data) of one sequence, data random per block."""
    rng = np.random.default_rng(start)
    tokens = list(range(start, start + n * BT))
    keys = extend_chain([], tokens, BT, seed)
    out = []
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else seed
        data = rng.integers(0, 256, SHAPE, dtype=np.uint8)
        out.append((key, parent, tuple(tokens[i * BT:(i + 1) * BT]), data))
    return out


def files_bytes(directory: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())


def test_records_round_trip_bit_exact_and_survive_a_restart(tmp_path: Path) -> None:
    bs = blocks(3)
    store = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    for key, parent, toks, data in bs:
        assert store.put(key, parent, toks, data)
    assert store.used_bytes == 3 * RECORD == files_bytes(store.dir)
    got = store.get(bs[1][0])
    assert got is not None and np.array_equal(got, bs[1][3])
    store.close()

    again = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    assert sorted(again.keys()) == sorted(b[0] for b in bs) and again.used_bytes == 3 * RECORD
    for key, _, _, data in bs:
        got = again.get(key)
        assert got is not None and np.array_equal(got, data)
    again.close()


def test_the_cap_is_never_exceeded_and_the_least_recently_used_go_first(tmp_path: Path) -> None:
    cap = 4 * RECORD + RECORD // 2  # room for 4 records, not 5
    store = DiskBlockStore(str(tmp_path), cap, layout())
    bs = blocks(9)
    for i, (key, parent, toks, data) in enumerate(bs):
        assert store.put(key, parent, toks, data)
        assert files_bytes(store.dir) == store.used_bytes <= cap
        if i == 3:
            assert store.get(bs[0][0]) is not None  # block 0 is now the most recently used
    # blocks 1, 2, 3 went first (block 0 was read after them), then 0, then 4
    assert store.keys() == [b[0] for b in bs[5:]]
    assert store.num_evicted == 5 and len(store) == 4
    store.close()


def test_a_smaller_cap_at_restart_keeps_the_most_recently_used(tmp_path: Path) -> None:
    bs = blocks(5)
    store = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    for i, (key, parent, toks, data) in enumerate(bs):
        assert store.put(key, parent, toks, data)
        os.utime(store.path(key), ns=(10**18 + i * 10**9,) * 2)  # distinct mtimes, in order
    store.close()
    smaller = DiskBlockStore(str(tmp_path), 2 * RECORD, layout())
    assert smaller.keys() == [bs[3][0], bs[4][0]]
    assert files_bytes(smaller.dir) == smaller.used_bytes == 2 * RECORD
    smaller.close()


@pytest.mark.parametrize("damage", ["data", "head", "truncate", "renamed", "foreign"])
def test_a_damaged_record_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    bs = blocks(2)
    store = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    for key, parent, toks, data in bs:
        store.put(key, parent, toks, data)
    path = store.path(bs[0][0])
    raw = bytearray(Path(path).read_bytes())
    if damage == "data":
        raw[-1] ^= 0x01
    elif damage == "head":
        raw[40] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "renamed":  # block 1's record under block 0's name
        raw = bytearray(Path(store.path(bs[1][0])).read_bytes())
    else:  # another model's record of the same tokens under this key's name
        other = blocks(1, chain_seed("other-model", BT))[0]
        foreign = DiskBlockStore(str(tmp_path / "o"), 10 * RECORD, layout(seed=other[1]))
        foreign.put(*other)
        raw = bytearray(Path(foreign.path(other[0])).read_bytes())
        foreign.close()
    Path(path).write_bytes(bytes(raw))
    assert store.get(bs[0][0]) is None
    assert store.num_bad_reads == 1 and not os.path.exists(path) and bs[0][0] not in store
    assert store.used_bytes == RECORD == files_bytes(store.dir)
    got = store.get(bs[1][0])
    assert got is not None and np.array_equal(got, bs[1][3])
    store.close()


def test_start_removes_torn_writes_and_damaged_heads_and_evicts_foreign_first(
        tmp_path: Path) -> None:
    ours, theirs = blocks(2), blocks(2, chain_seed("other-model", BT), start=50)
    other = DiskBlockStore(str(tmp_path), 10 * RECORD, layout(seed=theirs[0][1]))
    for i, b in enumerate(theirs):
        other.put(*b)
        os.utime(other.path(b[0]), ns=(10**18 + i * 10**9,) * 2)  # theirs[0] is the oldest
    other.close()
    d = rank_dir(str(tmp_path), 0)
    Path(d, "0" * 32 + ".blk.tmp").write_bytes(b"x" * 100)  # a write a crash cut short
    Path(d, "1" * 32 + ".blk").write_bytes(b"not a record")
    store = DiskBlockStore(str(tmp_path), 3 * RECORD, layout())
    assert sorted(os.listdir(d)) == sorted(k.hex() + ".blk" for k, *_ in theirs)
    assert len(store) == 0 and store.used_bytes == 2 * RECORD  # another model's, counted
    for b in ours:
        assert store.put(*b)
        assert files_bytes(d) == store.used_bytes <= 3 * RECORD
    # the other model's records went first, oldest first; ours are all kept
    assert sorted(os.listdir(d)) == sorted(k.hex() + ".blk" for k, *_ in theirs[1:] + ours)
    assert store.get(theirs[1][0]) is None  # never served under another model's seed
    store.close()


def test_a_failed_write_keeps_nothing_and_counts_nothing(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    b = blocks(1)[0]

    def no_room(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    assert not store.put(*b)
    monkeypatch.undo()
    assert len(store) == 0 and store.used_bytes == 0 and os.listdir(store.dir) == []
    store.close()


def test_bad_config_is_a_typed_error_with_the_numbers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"disk_bytes {RECORD - 1} holds no block record of "
                                          rf"{RECORD} bytes \(512 bytes of KV"):
        DiskBlockStore(str(tmp_path), RECORD - 1, layout())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"cannot create and write .*a-file/rank0.*errno"):
        DiskBlockStore(str(blocker), 10 * RECORD, layout())
    store = DiskBlockStore(str(tmp_path), 10 * RECORD, layout())  # the refusals held nothing
    with pytest.raises(SsdRootInUseError, match="rank 0 is owned by another live store"):
        DiskBlockStore(str(tmp_path), 10 * RECORD, layout())
    store.close()
    with pytest.raises(ConfigError, match="disk_bytes is '1GiB' but disk_dir is not set"):
        ConnectorOptions.from_extra({"disk_bytes": "1GiB"})
    with pytest.raises(ConfigError, match="disk_dir must be a directory path, got 5"):
        ConnectorOptions.from_extra({"disk_dir": 5})
    with pytest.raises(ConfigError, match="disk_bytes must be a positive integer, got 0"):
        ConnectorOptions.from_extra({"disk_dir": str(tmp_path), "disk_bytes": 0})
    opts = ConnectorOptions.from_extra({"disk_dir": str(tmp_path), "disk_bytes": "2MiB"})
    assert (opts.disk_dir, opts.disk_bytes) == (str(tmp_path), 2 << 20)


def test_host_store_moves_its_oldest_blocks_to_disk_within_both_caps(tmp_path: Path) -> None:
    disk = DiskBlockStore(str(tmp_path), 4 * RECORD, layout())
    host = HostBlockStore(2 * SHAPE[0] * SHAPE[1], SHAPE, disk)
    bs = blocks(7)
    for key, parent, toks, data in bs:
        assert host.put(key, parent, toks, data)
        assert host.used_bytes <= host.capacity_bytes and len(host) <= 2
        assert files_bytes(disk.dir) == disk.used_bytes <= 4 * RECORD
    assert host.keys() == [bs[5][0], bs[6][0]] and disk.keys() == [b[0] for b in bs[1:5]]
    assert host.num_spilled == 5 and disk.num_evicted == 1
    for key, _, _, data in bs[1:]:
        got = host.get(key)
        assert got is not None and np.array_equal(got, data)
    assert host.get(bs[0][0]) is None and host.num_bad_reads == 0
    # a host record damaged in memory is dropped, never written to disk
    host.record(bs[5][0]).data[0, 0] ^= 0xFF  # type: ignore[union-attr]
    for b in blocks(2, start=200):
        host.put(*b)
    assert not host.holds(bs[5][0]) and host.num_bad_reads == 1
    host.close()


def caches(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # two layers, [B, 2, BT, 8] float32: 256 bytes a layer and block
    return {f"layer{i}": torch.randn(num_blocks, 2, BT, 8, generator=g) for i in range(2)}


def test_a_new_process_loads_the_blocks_an_earlier_one_left_on_disk(tmp_path: Path) -> None:
    """Planner and copier as the connector wires them, twice over one directory: the second
    pair adopts the disk records and loads the prompt's blocks bit-exact; a damaged one is a
    failed load that the index forgets."""
    spec = DiskSpec(str(tmp_path), 8 * RECORD, SEED, BT, "test-model")
    first_kv = caches(16, 0)
    copier = BlockCopier(SHAPE[0] * SHAPE[1], spec)  # memory holds one block
    copier.register(first_kv, 16)
    planner = Planner(BT, SEED, capacity_blocks=1 + 8)
    prompt = list(range(300, 313))  # 13 tokens: 3 full blocks
    req = SimpleNamespace(request_id="r1", all_token_ids=prompt)
    assert planner.matched_tokens(req, 0) == 0
    plan = planner.plan([("r1", 13)], lambda r: [3, 7, 9, 11])
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and len(report.saved) == 3
    assert copier.store is not None and len(copier.store) == 1 and copier.store.disk is not None
    assert len(copier.store.disk) == 2  # the two oldest went to disk
    copier.store.close()

    keys = extend_chain([], prompt, BT, SEED)
    assert stored_keys(str(tmp_path), SEED, BT, 1) == keys[:2]
    assert stored_keys(str(tmp_path), chain_seed("other-model", BT), BT, 1) == []
    assert stored_keys(str(tmp_path), SEED, BT, 2) == []  # rank 1 holds none of them

    second_kv = caches(16, 1)
    copier2 = BlockCopier(SHAPE[0] * SHAPE[1], spec)
    copier2.register(second_kv, 16)
    planner2 = Planner(BT, SEED, capacity_blocks=1 + 8)
    assert planner2.index.adopt(stored_keys(str(tmp_path), SEED, BT, 1)) == 2
    req2 = SimpleNamespace(request_id="r2", all_token_ids=list(prompt))
    assert planner2.matched_tokens(req2, 0) == 8
    planner2.after_alloc(req2, [4, 5, 6, 8], 8)
    plan2 = planner2.plan([("r2", 13)], lambda r: [4, 5, 6, 8])
    copier2.load(plan2.loads)
    assert copier2.take_failed_block_ids() == set()
    for name in first_kv:
        assert torch.equal(second_kv[name][4], first_kv[name][3])
        assert torch.equal(second_kv[name][5], first_kv[name][7])
    copier2.apply_after_forward(plan2)
    report2 = copier2.take_report()
    assert report2 is not None and report2.disk_loads == {"r2": {0, 1}}
    planner2.report(report2)
    assert planner2.finished("r2")["disk_loaded_blocks"] == 2

    # damage block 1's record on disk: the next load of it fails and the index forgets it
    assert copier2.store is not None and copier2.store.disk is not None
    path = copier2.store.disk.path(keys[1])
    raw = bytearray(Path(path).read_bytes())
    raw[-3] ^= 0x10
    Path(path).write_bytes(bytes(raw))
    req3 = SimpleNamespace(request_id="r3", all_token_ids=list(prompt))
    assert planner2.matched_tokens(req3, 0) == 12
    planner2.after_alloc(req3, [12, 13, 14, 15], 12)
    plan3 = planner2.plan([("r3", 13)], lambda r: [12, 13, 14, 15])
    copier2.load(plan3.loads)
    assert copier2.take_failed_block_ids() == {13}
    copier2.apply_after_forward(plan3)
    report3 = copier2.take_report()
    assert report3 is not None and report3.failed_loads == {keys[1]}
    planner2.report(report3)
    assert not planner2.index.holds(keys[1]) and not os.path.exists(path)
    copier2.store.close()


def test_adopt_takes_the_newest_keys_that_fit() -> None:
    index = PrefixIndex(capacity_blocks=3)
    keys = [block_key(SEED, [i]) for i in range(5)]
    assert index.adopt(keys) == 3 and index.match(keys[2:]) == 3 and not index.holds(keys[1])
    assert index.adopt(keys) == 0


def test_a_block_dropped_by_a_reset_and_saved_again_in_one_step_is_kept() -> None:
    """Drops apply before saves: a key a reset dropped and the same step saves again stays."""
    kv = caches(16, 2)
    copier = BlockCopier(1 << 20)
    copier.register(kv, 16)
    planner = Planner(BT, SEED, capacity_blocks=8)
    prompt = list(range(500, 509))  # 2 full blocks
    for req_id, ids in (("r1", [1, 2, 3]), ("r2", [4, 5, 6])):
        planner.matched_tokens(SimpleNamespace(request_id=req_id, all_token_ids=prompt), 0)
        if req_id == "r2":
            planner.reset()  # vLLM's reset_prefix_cache(reset_connector=True) between them
        plan = planner.plan([(req_id, 9)], lambda r, ids=ids: ids)
        copier.load(plan.loads)
        copier.apply_after_forward(plan)
        report = copier.take_report()
        assert report is not None
        planner.report(report)
    keys = extend_chain([], prompt, BT, SEED)
    assert sorted(plan.drops) == sorted(keys) and [s.key for s in plan.saves] == keys
    assert copier.store is not None
    assert all(planner.index.holds(k) and copier.store.holds(k) for k in keys)
