"""The vLLM connector's background (asynchronous) loads without vLLM: policy, loader, pins."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tpkv.errors import ConfigError
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.disk_format import DiskLayout, record_bytes
from tpkv.integrations.prefix_index import chain_seed, extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.load_policy import LoadPolicy
from tpkv.integrations.vllm.options import ConnectorOptions, DiskSpec
from tpkv.integrations.vllm.plan import StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.record import BlockRecord

BT = 4
NUM_BLOCKS = 16
SEED = chain_seed("test-model", BT)
SHAPE = (2, 256)  # two layers of 256 bytes a block (the caches below)
BLOCK_BYTES = SHAPE[0] * SHAPE[1]
RECORD = record_bytes(BT, BLOCK_BYTES)


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, BT, 8, generator=g) for i in range(2)}


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens)


def wait_finished(copier: BlockCopier, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = copier.take_finished()
        if done:
            return done
        time.sleep(0.005)
    raise AssertionError(f"no background load finished in {timeout_s} s")


def store_prompt(planner: Planner, copier: BlockCopier, prompt: list[int],
                 block_ids: list[int]) -> None:
    """Request "w" computes `prompt` and stores its full blocks."""
    planner.matched_tokens(request("w", prompt), 0)
    plan = planner.plan([("w", len(prompt))], lambda r: block_ids)
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None
    planner.report(report)
    planner.finished("w")


def three_stored(seed: int, first_token: int
                 ) -> tuple[dict[str, torch.Tensor], BlockCopier, Planner, list[int]]:
    """A copier over caches(seed) whose store holds the 3 full blocks of a 13-token prompt
    from first_token (computed in vLLM blocks 1-4), and a planner that loads in the
    background: (caches, copier, planner, prompt)."""
    kv = caches(seed)
    copier = BlockCopier(1 << 20)
    copier.register(kv, NUM_BLOCKS)
    planner = Planner(BT, SEED, 64, policy=LoadPolicy("always", 0, BLOCK_BYTES, 64))
    prompt = list(range(first_token, first_token + 13))
    store_prompt(planner, copier, prompt, [1, 2, 3, 4])
    return kv, copier, planner, prompt


def test_the_policy_runs_disk_and_large_loads_in_the_background() -> None:
    keys = [bytes([i]) * 16 for i in range(4)]
    auto = LoadPolicy("auto", 3 * 100, 100, host_blocks=2)
    assert auto.runs_async(keys[:2])  # never stored by this process: on disk
    auto.used(keys[:2])
    assert not auto.runs_async(keys[:2])  # in host memory, 200 bytes: before the forward
    auto.used(keys[2:3])  # host memory holds 2 blocks: key 0 went to disk
    assert auto.runs_async(keys[:1]) and not auto.runs_async(keys[1:3])
    auto.used(keys)
    assert auto.runs_async(keys[1:4])  # 300 bytes: large enough
    auto.gone(keys[3:])
    assert auto.runs_async(keys[3:])
    assert not auto.runs_async([])
    assert LoadPolicy("always", 10**9, 100, 2).runs_async(keys[:1])
    assert not LoadPolicy("never", 0, 100, 0).runs_async(keys)
    with pytest.raises(ConfigError, match="'sometimes'"):
        LoadPolicy("sometimes", 0, 100, 2)
    with pytest.raises(ConfigError, match="async_loads"):
        ConnectorOptions.from_extra({"async_loads": "yes"})
    with pytest.raises(ConfigError, match="async_load_bytes"):
        ConnectorOptions.from_extra({"async_load_bytes": -1})
    opts = ConnectorOptions.from_extra({"async_loads": "never", "async_load_bytes": "1MiB"})
    assert (opts.async_loads, opts.async_load_bytes) == ("never", 1 << 20)
    assert ConnectorOptions.from_extra({}).async_loads == "auto"


def test_a_background_load_is_bit_exact_and_finishes_once() -> None:
    kv = caches(0)
    copier = BlockCopier(1 << 20)
    copier.register(kv, NUM_BLOCKS)
    planner = Planner(BT, SEED, 64, policy=LoadPolicy("always", 0, BLOCK_BYTES, 64))
    prompt = list(range(100, 111))  # 2 full blocks
    store_prompt(planner, copier, prompt, [3, 7, 9])

    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 8 and planner.loads_async("r")
    planner.after_alloc(req, [10, 11, 12], 8)
    plan = planner.plan([], lambda r: [])
    assert [(s.req_id, s.background) for s in plan.loads] == [("r", True)]
    copier.load(plan.loads)
    assert wait_finished(copier) == {"r"}
    assert copier.take_finished() == set() and copier.take_failed_block_ids() == set()
    for layer in kv.values():
        assert torch.equal(layer[10], layer[3]) and torch.equal(layer[11], layer[7])
    lookups = planner.counters.lookups
    planner.after_alloc(req, [10, 11, 12], 0)  # vLLM's second call, once loaded: no new load
    assert planner.counters.lookups == lookups and planner.plan([], lambda r: []).loads == []
    stats = planner.finished("r")
    assert stats["async_load_blocks"] == 2 and stats["failed_load_blocks"] == 0
    copier.close()


def test_a_damaged_record_fails_its_block_with_the_finished_request() -> None:
    kv, copier, planner, prompt = three_stored(1, 200)
    keys = extend_chain([], prompt, BT, SEED)
    assert copier.store is not None
    rec = copier.store.record(keys[1])
    assert rec is not None
    rec.data[0, 0] ^= 0xFF
    before = kv["layer0"][6].clone()

    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 12
    planner.after_alloc(req, [5, 6, 8, 9], 12)
    plan = planner.plan([], lambda r: [])
    copier.load(plan.loads)
    assert wait_finished(copier) == {"r"}
    assert copier.take_failed_block_ids() == {6}  # vLLM recomputes from block 1 on
    assert torch.equal(kv["layer0"][6], before)  # never written with the damaged bytes
    assert torch.equal(kv["layer0"][5], kv["layer0"][1])
    report = copier.take_report()
    assert report is not None and report.failed_loads == {keys[1]}
    assert report.failed_load_reqs == {"r": 1}
    planner.report(report)
    assert planner.index.match(keys) == 1 and copier.store.record(keys[1]) is None
    copier.close()


def test_blocks_of_a_load_in_flight_are_not_dropped_for_room() -> None:
    planner = Planner(BT, SEED, 2, policy=LoadPolicy("always", 0, BLOCK_BYTES, 2))
    prompt = list(range(300, 309))  # 2 full blocks fill the index
    planner.matched_tokens(request("w", prompt), 0)
    planner.plan([("w", 9)], lambda r: [0, 1, 2])
    planner.report(StepReport(saved=set(extend_chain([], prompt, BT, SEED)), ranks={0}))
    planner.finished("w")
    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 8
    planner.after_alloc(req, [4, 5, 6], 8)
    planner.plan([], lambda r: [])  # the background load goes out
    other = list(range(400, 409))
    planner.matched_tokens(request("o", other), 0)
    plan = planner.plan([("o", 9)], lambda r: [7, 8, 9])
    assert plan.drops == [] and plan.saves == []  # no room: the loading blocks stay
    planner.loads_finished({"r"})  # every rank finished it: its blocks may go for room
    planner.matched_tokens(request("o2", list(other)), 0)
    plan = planner.plan([("o2", 9)], lambda r: [10, 11, 12])
    assert len(plan.drops) == 2 and len(plan.saves) == 2


def test_a_pinned_disk_record_is_not_deleted_for_room(tmp_path: Path) -> None:
    disk = DiskBlockStore(str(tmp_path), 2 * RECORD, DiskLayout(SEED, 0, BT, SHAPE))
    tokens = list(range(500, 516))
    keys = extend_chain([], tokens, BT, SEED)
    rng = np.random.default_rng(0)

    def put(i: int) -> bool:
        parent = keys[i - 1] if i else SEED
        data = rng.integers(0, 256, SHAPE, dtype=np.uint8)
        return disk.put(keys[i], parent, tuple(tokens[i * BT:(i + 1) * BT]), data)

    assert put(0) and put(1)
    disk.pin(keys[0])
    disk.pin(keys[0])
    assert put(2) and disk.keys() == [keys[0], keys[2]]  # the oldest unpinned one went
    disk.pin(keys[2])
    assert not put(3) and keys[3] not in disk  # every record pinned: no room
    disk.unpin(keys[0])
    assert not put(3)  # keys[0] is pinned once more
    disk.unpin(keys[2])
    assert put(3) and disk.keys() == [keys[0], keys[3]]
    disk.unpin(keys[0])
    disk.unpin(keys[0])  # more unpins than pins do nothing
    assert disk.drop(keys[3]) and put(2) and put(1)  # keys[0], no longer pinned, goes
    assert disk.keys() == [keys[2], keys[1]]
    disk.close()


def test_a_background_load_reads_the_disk_tier_and_releases_its_pins(tmp_path: Path) -> None:
    spec = DiskSpec(str(tmp_path), 8 * RECORD, SEED, BT, "test-model", queue_bytes=0)
    kv = caches(2)
    copier = BlockCopier(BLOCK_BYTES, spec)  # memory holds one block, the rest go to disk
    copier.register(kv, NUM_BLOCKS)
    planner = Planner(BT, SEED, 1 + 8, policy=LoadPolicy("auto", 1 << 30, BLOCK_BYTES, 1))
    prompt = list(range(600, 613))  # 3 full blocks
    store_prompt(planner, copier, prompt, [1, 2, 3, 4])
    store = copier.store
    assert store is not None and store.disk is not None and len(store.disk) == 2

    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 12
    assert planner.loads_async("r")  # blocks 0 and 1 were pushed out to disk
    planner.after_alloc(req, [8, 9, 10, 11], 12)
    plan = planner.plan([], lambda r: [])
    with copier.lock:  # the loader waits: the load's disk records are pinned meanwhile
        copier.load(plan.loads)
        assert dict(store.disk._pins) == {k: 1 for k in plan.loads[0].keys[:2]}
    assert wait_finished(copier) == {"r"}
    assert copier.take_failed_block_ids() == set() and not store.disk._pins
    for layer in kv.values():
        for src, dst in ((1, 8), (2, 9), (3, 10)):
            assert torch.equal(layer[dst], layer[src])
    report = copier.take_report()
    assert report is not None and report.disk_loads == {"r": {0, 1}}
    planner.report(report)
    assert planner.finished("r")["disk_loaded_blocks"] == 2
    copier.close()


def test_a_load_that_raises_fails_its_remaining_blocks_and_still_finishes() -> None:
    kv, copier, planner, prompt = three_stored(3, 700)
    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 12
    planner.after_alloc(req, [5, 6, 7, 8], 12)
    plan = planner.plan([], lambda r: [])
    loader = copier._loader()

    def flaky(block_ids: list[int], recs: list[BlockRecord], stream: object) -> None:
        raise RuntimeError("copy engine gone")

    loader.copy_in = flaky
    copier.load(plan.loads)
    assert wait_finished(copier) == {"r"}  # vLLM must hear of it to recompute
    assert copier.take_failed_block_ids() == {5, 6, 7}  # none is known to be in place
    report = copier.take_report()
    assert report is not None and report.failed_load_reqs == {"r": 0}
    slots = copier.store.slots if copier.store is not None else None
    assert slots is not None and slots.num_free == slots.num_slots - 3  # the load let go
    copier.close()


def test_a_load_whose_read_raises_midway_fails_every_block() -> None:
    """The copies come after every block was read: an error reading block 1 leaves block 0
    uncopied too, so all three are failed loads (vLLM recomputes), none left half done."""
    kv, copier, planner, prompt = three_stored(6, 900)
    keys = extend_chain([], prompt, BT, SEED)
    store = copier.store
    assert store is not None
    hold, take = store.hold_for_load, store.take

    def not_held(key: bytes) -> tuple[BlockRecord | None, bool]:
        return (None, False) if key == keys[1] else hold(key)  # block 1: read on the thread

    def flaky(keys_: list[bytes]) -> list[BlockRecord | None]:
        if keys_ == [keys[1]]:
            raise OSError("store gone")
        return take(keys_)

    store.hold_for_load = not_held  # type: ignore[method-assign]
    store.take = flaky  # type: ignore[method-assign]
    before = kv["layer0"][5].clone()
    req = request("r", list(prompt))
    assert planner.matched_tokens(req, 0) == 12
    planner.after_alloc(req, [5, 6, 7, 8], 12)
    copier.load(planner.plan([], lambda r: []).loads)
    assert wait_finished(copier) == {"r"}
    assert copier.take_failed_block_ids() == {5, 6, 7}
    assert torch.equal(kv["layer0"][5], before)  # block 0 was read, never copied
    assert store.slots.num_free == store.slots.num_slots - 3  # the load let its holds go
    copier.close()


def test_a_small_background_load_in_a_step_without_forward_runs_inline() -> None:
    kv = caches(4)
    copier = BlockCopier(1 << 20)
    copier.register(kv, NUM_BLOCKS)
    policy = LoadPolicy("always", 3 * BLOCK_BYTES, BLOCK_BYTES, 64)
    planner = Planner(BT, SEED, 64, policy=policy)
    prompt = list(range(800, 813))  # 3 full blocks
    store_prompt(planner, copier, prompt, [1, 2, 3, 4])
    for req_id, tokens, idle, inline in (("a", 9, True, True), ("b", 9, False, False),
                                         ("c", 13, True, False)):  # c: 3 blocks, not small
        req = request(req_id, prompt[:tokens])
        assert planner.matched_tokens(req, 0) == (tokens - 1) // BT * BT
        planner.after_alloc(req, [5, 6, 7, 8], (tokens - 1) // BT * BT)
        plan = planner.plan([], lambda r: [], idle=idle)
        assert [(s.background, s.inline) for s in plan.loads] == [(True, inline)]
        copier.load(plan.loads)
        if inline:
            assert copier.take_finished() == {req_id}  # done before load returned
        else:
            assert wait_finished(copier) == {req_id}
        assert torch.equal(kv["layer1"][5], kv["layer1"][1])
        assert torch.equal(kv["layer1"][6], kv["layer1"][2])
        kv["layer1"][5:9].zero_()
    assert copier.take_failed_block_ids() == set()
    copier.close()
