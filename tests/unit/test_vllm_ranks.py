"""The vLLM connector over two ranks (tensor parallel 2) without vLLM: one planner, a copier per
rank with its own shard of the KV cache, their reports merged as vLLM merges them."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from tpkv.integrations.disk_blocks import stored_keys
from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.options import DiskSpec
from tpkv.integrations.vllm.plan import StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.rank_check import unconfirmed_saves

BT = 4
NUM_BLOCKS = 16
SEED = chain_seed("test-model|tp=2", BT)


def shard(rank: int) -> dict[str, torch.Tensor]:
    """One rank's two layers, [blocks, 2, BT, 8] float32, different on each rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, BT, 8, generator=g) for i in range(2)}


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens)


def two_ranks(capacity: list[int] | None = None, disk: DiskSpec | None = None
              ) -> tuple[Planner, list[BlockCopier], list[dict[str, torch.Tensor]]]:
    caps = capacity or [1 << 20, 1 << 20]
    caches = [shard(rank) for rank in range(2)]
    copiers = []
    for rank, cap in enumerate(caps):
        copier = BlockCopier(cap, disk)
        copier.register(caches[rank], NUM_BLOCKS, rank)
        copiers.append(copier)
    return Planner(BT, SEED, capacity_blocks=64, num_ranks=2), copiers, caches


def step(planner: Planner, copiers: list[BlockCopier], scheduled: list[tuple[str, int]],
         blocks: dict[str, list[int]]) -> tuple[StepReport | None, set[int]]:
    """One engine step on both ranks; the merged report (vLLM's KVOutputAggregator: the first
    non-empty report, the others merged into it) and the union of failed block ids."""
    plan = planner.plan(scheduled, lambda r: blocks[r])
    for copier in copiers:
        copier.load(plan.loads)
    failed: set[int] = set()
    for copier in copiers:
        failed |= copier.take_failed_block_ids()
        copier.apply_after_forward(plan)
    merged: StepReport | None = None
    for copier in copiers:
        report = copier.take_report()
        if report is not None:
            merged = report if merged is None else merged.merge(report)
    if merged is not None:
        planner.report(merged)
    return merged, failed


def test_each_rank_stores_and_loads_its_own_shard() -> None:
    planner, copiers, caches = two_ranks()
    prompt = list(range(100, 111))  # 2 full blocks
    planner.matched_tokens(request("r1", prompt), 0)
    report, _ = step(planner, copiers, [("r1", 11)], {"r1": [3, 7, 9]})
    assert report is not None and report.ranks == {0, 1} and len(report.saved) == 2
    planner.finished("r1")
    second = request("r2", list(prompt))
    assert planner.matched_tokens(second, 0) == 8
    planner.after_alloc(second, [10, 11, 12], 8)
    _, failed = step(planner, copiers, [("r2", 11)], {"r2": [10, 11, 12]})
    assert failed == set()
    for rank in range(2):
        for name, layer in caches[rank].items():
            assert torch.equal(layer[10], layer[3]) and torch.equal(layer[11], layer[7]), name
            assert not torch.equal(layer[10], caches[1 - rank][name][3])  # not the other's


def test_a_block_one_rank_could_not_store_is_no_hit_and_leaves_both_ranks() -> None:
    one_block = 2 * shard(0)["layer0"][0].numel() * 4
    planner, copiers, _ = two_ranks([1 << 20, one_block])  # rank 1 holds a single block
    prompt = list(range(20, 29))  # 2 full blocks
    planner.matched_tokens(request("a", prompt), 0)
    report, _ = step(planner, copiers, [("a", 9)], {"a": [0, 1, 2]})
    keys = planner._reqs["a"].keys
    assert report is not None and report.saved == set(keys)  # each saved by some rank
    assert report.failed_saves == {keys[1]}  # rank 1 had no room for block 1
    # only block 0 is held by every rank: block 1, held by rank 0 alone, is no hit
    assert planner.matched_tokens(request("b", prompt + [5]), 0) == 4
    store0 = copiers[0].store
    assert store0 is not None and store0.holds(keys[1])
    step(planner, copiers, [], {})  # the next plan drops it on every rank
    assert not store0.holds(keys[1]) and store0.holds(keys[0])


def test_a_save_made_over_another_ranks_failed_load_is_not_kept() -> None:
    """Rank 1's load of block 1 fails; in the same step both ranks compute block 2 over it, so
    rank 0's copy of block 2 is wrong KV (over tensor parallelism a rank's KV depends on the
    other ranks' attention). vLLM recomputes from block 1 and the planner saves 1 and 2 again:
    rank 0 must then hold the recomputed block 2, not the one made in the failed step."""
    planner, copiers, caches = two_ranks()
    prompt = list(range(40, 49))  # 2 full blocks
    planner.matched_tokens(request("a", prompt), 0)
    step(planner, copiers, [("a", 9)], {"a": [0, 1, 2]})
    planner.finished("a")
    store1 = copiers[1].store
    assert store1 is not None
    longer = request("b", prompt[:8] + [60, 61, 62, 63, 64])  # blocks 0, 1 held, 2 new
    assert planner.matched_tokens(longer, 0) == 8
    bkeys = planner._reqs["b"].keys
    rec = store1.record(bkeys[1])
    assert rec is not None
    rec.data[0, 0] ^= 0xFF  # rank 1's copy of block 1 is damaged
    planner.after_alloc(longer, [4, 5, 6, 7], 8)
    for rank in range(2):  # the failed step computes block 2 over a block that did not load
        for layer in caches[rank].values():
            layer[6].fill_(-7.0)
    report, failed = step(planner, copiers, [("b", 13)], {"b": [4, 5, 6, 7]})
    assert failed == {5}  # vLLM recomputes from block 1 on every rank
    assert report is not None and report.failed_load_reqs == {"b": 1}
    assert report.failed_saves == {bkeys[2]} and report.saved == {bkeys[2]}  # rank 0 saved it
    assert planner.index.match(bkeys) == 1
    # the recompute: blocks 1 and 2 hold the right KV now, and are saved again
    right = []
    for rank in range(2):
        for layer in caches[rank].values():
            layer[5].copy_(layer[1])
            layer[6].fill_(3.0)
        right.append({name: layer[6].clone() for name, layer in caches[rank].items()})
    report, failed = step(planner, copiers, [("b", 13)], {"b": [4, 5, 6, 7]})
    assert failed == set() and report is not None
    assert report.saved == {bkeys[1], bkeys[2]} and not report.failed_saves
    assert planner.index.match(bkeys) == 3
    planner.finished("b")
    # a third request loads block 2 on both ranks: the recomputed KV, on each rank
    third = request("c", list(longer.all_token_ids) + [1])
    assert planner.matched_tokens(third, 0) == 12
    planner.after_alloc(third, [8, 9, 10, 11], 12)
    _, failed = step(planner, copiers, [("c", 14)], {"c": [8, 9, 10, 11]})
    assert failed == set()
    for rank in range(2):
        for name, layer in caches[rank].items():
            assert torch.equal(layer[10], right[rank][name]), (rank, name)


def test_a_merged_report_without_every_rank_confirms_no_save() -> None:
    planner, copiers, _ = two_ranks()
    prompt = list(range(70, 79))
    planner.matched_tokens(request("a", prompt), 0)
    plan = planner.plan([("a", 9)], lambda r: [0, 1, 2])
    copiers[0].apply_after_forward(plan)  # rank 1's report never arrives
    report = copiers[0].take_report()
    assert report is not None and report.ranks == {0} and len(report.saved) == 2
    assert unconfirmed_saves(report, 2) == report.saved
    planner.report(report)
    assert planner.matched_tokens(request("b", prompt), 0) == 0
    store0 = copiers[0].store
    assert store0 is not None and len(store0) == 2
    step(planner, copiers, [], {})  # and rank 0 drops what it alone holds
    assert len(store0) == 0


def test_merge_keeps_the_ranks_and_unconfirmed_saves_need_all_of_them() -> None:
    a = StepReport(saved={b"k1", b"k2"}, ranks={0})
    b = StepReport(saved={b"k1"}, failed_saves={b"k2"}, ranks={1})
    merged = a.merge(b)
    assert merged.ranks == {0, 1} and merged.saved == {b"k1", b"k2"}
    assert merged.failed_saves == {b"k2"}
    assert unconfirmed_saves(merged, 2) == set()
    assert unconfirmed_saves(a, 2) == {b"k1", b"k2"} and unconfirmed_saves(a, 1) == set()
    assert unconfirmed_saves(StepReport(ranks={0}), 2) == set()  # nothing saved: nothing held
    assert not StepReport(ranks={0})  # a rank that did nothing sends no report


def test_a_restart_adopts_only_the_disk_blocks_every_rank_holds(tmp_path: Path) -> None:
    one_block = 2 * shard(0)["layer0"][0].numel() * 4
    disk = DiskSpec(str(tmp_path), 1 << 20, SEED, BT, "test-model|tp=2", queue_bytes=0)
    planner, copiers, caches = two_ranks([one_block, one_block], disk)
    prompt = list(range(80, 93))  # 3 full blocks: the oldest two go to each rank's disk
    planner.matched_tokens(request("a", prompt), 0)
    step(planner, copiers, [("a", 13)], {"a": [0, 1, 2, 3]})
    keys = planner._reqs["a"].keys
    for copier in copiers:
        assert copier.store is not None and copier.store.disk is not None
        assert copier.store.disk.keys() == keys[:2]
        copier.store.close()  # the process ends: host memory is gone, the disk stays
    os.remove(copiers[1].store.disk.path(keys[1]))  # type: ignore[union-attr]
    # rank 0 alone holds block 1: it is no hit after a restart, block 0 is
    assert stored_keys(str(tmp_path), SEED, BT, 2) == keys[:1]
    planner2, copiers2, caches2 = two_ranks([one_block, one_block], disk)
    assert planner2.index.adopt(stored_keys(str(tmp_path), SEED, BT, 2)) == 1
    again = request("b", list(prompt))
    assert planner2.matched_tokens(again, 0) == 4
    planner2.after_alloc(again, [5, 6, 7, 8], 4)
    _, failed = step(planner2, copiers2, [("b", 13)], {"b": [5, 6, 7, 8]})
    assert failed == set()
    for rank in range(2):  # each rank's own shard of block 0, from its own directory
        for name, layer in caches2[rank].items():
            assert torch.equal(layer[5], caches[rank][name][0]), (rank, name)
    for copier in copiers2:
        assert copier.store is not None
        copier.store.close()
