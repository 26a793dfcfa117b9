"""The vLLM connector's planner and worker copier without vLLM: fake requests, CPU KV tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tpkv.errors import ConfigError, KvLayoutError
from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.block_io import block_views
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.plan import StepReport
from tpkv.integrations.vllm.planner import Planner

BT = 4
NUM_BLOCKS = 16
SEED = chain_seed("test-model", BT)


def kv_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two layers laid out as vLLM's CPU backend does: blocks first, [B, 2, 32, 8] float32."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, BT, 8, generator=g) for i in range(2)}


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens)


def run_step(planner: Planner, copier: BlockCopier, scheduled: list[tuple[str, int]],
             blocks: dict[str, list[int]]) -> StepReport | None:
    """One engine step: plan, loads, (forward), saves and drops, report back."""
    plan = planner.plan(scheduled, lambda r: blocks[r])
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    if report is not None:
        planner.report(report)
    return report


def test_second_request_loads_the_first_ones_blocks_bit_exact() -> None:
    caches = kv_caches()
    copier = BlockCopier(capacity_bytes=1 << 20)
    copier.register(caches, NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks
    first = request("r1", prompt)
    assert planner.matched_tokens(first, 0) == 0
    run_step(planner, copier, [("r1", 11)], {"r1": [3, 7, 9]})
    planner.finished("r1")
    assert planner.index.num_stored == 2 and len(copier.store or ()) == 2

    second = request("r2", list(prompt))
    assert planner.matched_tokens(second, 0) == 8
    planner.after_alloc(second, [10, 11, 12], 8)
    run_step(planner, copier, [("r2", 11)], {"r2": [10, 11, 12]})
    for layer in caches.values():
        assert torch.equal(layer[10], layer[3]) and torch.equal(layer[11], layer[7])
    assert copier.take_failed_block_ids() == set()
    stats = planner.finished("r2")
    assert stats["matched_tokens"] == 8 and stats["deduplicated_blocks"] == 2
    assert stats["written_blocks"] == 0


def test_last_prompt_token_is_never_served() -> None:
    planner = Planner(BT, SEED, capacity_blocks=64)
    copier = BlockCopier(1 << 20)
    copier.register(kv_caches(), NUM_BLOCKS)
    prompt = list(range(8))  # exactly 2 blocks
    planner.matched_tokens(request("a", prompt), 0)
    run_step(planner, copier, [("a", 8)], {"a": [1, 2]})
    # both blocks are held, but one token must be computed: only the first block is matched
    assert planner.matched_tokens(request("b", list(prompt)), 0) == 4
    # what vLLM's own prefix cache holds is not loaded again
    assert planner.matched_tokens(request("c", list(prompt)), 4) == 0


@pytest.mark.parametrize("damage", ["bytes", "tokens", "key"])
def test_a_record_that_does_not_check_out_is_a_failed_load(damage: str) -> None:
    caches = kv_caches()
    copier = BlockCopier(1 << 20)
    copier.register(caches, NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    prompt = list(range(13))  # 3 full blocks
    planner.matched_tokens(request("a", prompt), 0)
    run_step(planner, copier, [("a", 13)], {"a": [0, 1, 2, 3]})
    store = copier.store
    assert store is not None
    keys = planner._reqs["a"].keys
    rec = store.record(keys[1])
    assert rec is not None
    if damage == "bytes":
        rec.data[1, 5] ^= 0x01
    elif damage == "tokens":
        object.__setattr__(rec, "tokens", (4, 5, 6, 8))
    else:
        other = store.record(keys[2])
        assert other is not None
        store.slots.ref(other.slot)  # the entry holds its slot, as every record in memory does
        store.release(rec)
        store._records[keys[1]] = other
    before = {name: t[9].clone() for name, t in caches.items()}

    b = request("b", list(prompt))
    assert planner.matched_tokens(b, 0) == 12
    planner.after_alloc(b, [8, 9, 10, 11], 12)
    plan = planner.plan([("b", 13)], lambda r: [8, 9, 10, 11])
    copier.load(plan.loads)
    assert copier.take_failed_block_ids() == {9}  # vLLM recomputes from block 9 on
    for name, t in caches.items():
        assert torch.equal(t[9], before[name])  # nothing was written into the failed block
        assert torch.equal(t[8], t[0])
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and report.failed_loads == {keys[1]}
    assert report.failed_load_reqs == {"b": 1}
    planner.report(report)
    assert planner.index.match(keys) == 1 and store.record(keys[1]) is None
    # the recompute's next step stores the block again, from vLLM's recomputed copy
    plan = planner.plan([("b", 13)], lambda r: [8, 9, 10, 11])
    assert [s.key for s in plan.saves] == [keys[1]] and plan.saves[0].block_id == 9


def test_saves_of_a_request_whose_load_failed_this_step_are_refused() -> None:
    copier = BlockCopier(1 << 20)
    copier.register(kv_caches(), NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    prompt = list(range(9))
    planner.matched_tokens(request("a", prompt), 0)
    run_step(planner, copier, [("a", 9)], {"a": [0, 1, 2]})
    store = copier.store
    assert store is not None
    for key in store.keys():
        store.drop(key)  # the store lost them; the index does not know yet
    longer = request("b", prompt[:8] + [50, 51, 52, 53, 54])
    assert planner.matched_tokens(longer, 0) == 8
    planner.after_alloc(longer, [4, 5, 6, 7], 8)
    report = run_step(planner, copier, [("b", 13)], {"b": [4, 5, 6, 7]})
    assert report is not None
    assert copier.take_failed_block_ids() == {4, 5}
    # block 2 of b was computed over blocks that did not load: it is not stored
    assert len(report.failed_saves) == 1 and not report.saved and len(store) == 0
    assert planner.index.num_stored == 0


def test_full_store_refuses_and_the_index_forgets() -> None:
    copier = BlockCopier(capacity_bytes=1)  # not one block fits
    with pytest.raises(ConfigError, match="host_bytes 1 holds no block of 512 bytes"):
        copier.register(kv_caches(), NUM_BLOCKS)
    caches = kv_caches()
    one_block = 2 * caches["layer0"][0].numel() * 4
    copier = BlockCopier(capacity_bytes=one_block)
    copier.register(caches, NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    planner.matched_tokens(request("a", list(range(9))), 0)
    report = run_step(planner, copier, [("a", 9)], {"a": [0, 1, 2]})
    assert report is not None and len(report.saved) == 1 and len(report.failed_saves) == 1
    assert planner.index.num_stored == 1


def test_layouts_that_cannot_be_copied_by_block_are_refused() -> None:
    with pytest.raises(KvLayoutError, match="not 16 contiguous blocks"):
        block_views({"l0": torch.zeros(2, NUM_BLOCKS, 4, 8).transpose(0, 1)}, NUM_BLOCKS)
    with pytest.raises(KvLayoutError, match="not 16 contiguous blocks"):
        block_views({"l0": torch.zeros(NUM_BLOCKS + 1, 4)}, NUM_BLOCKS)
    with pytest.raises(KvLayoutError, match="different block sizes"):
        block_views({"l0": torch.zeros(NUM_BLOCKS, 4), "l1": torch.zeros(NUM_BLOCKS, 8)},
                    NUM_BLOCKS)
    # two kernel blocks per vLLM block: one block is both
    names, views = block_views({"l0": torch.zeros(2 * NUM_BLOCKS, 4)}, NUM_BLOCKS)
    assert names == ["l0"] and views[0].shape == (NUM_BLOCKS, 32)


def test_reset_forgets_every_block_and_drops_it_on_the_ranks() -> None:
    copier = BlockCopier(1 << 20)
    copier.register(kv_caches(), NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    prompt = list(range(13))
    planner.matched_tokens(request("a", prompt), 0)
    plan = planner.plan([("a", 8)], lambda r: [0, 1, 2, 3])  # blocks 0, 1: pending
    planner.reset()  # while their saves are in flight
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and len(report.saved) == 2
    planner.report(report)  # confirmations of forgotten keys are ignored
    assert planner.index.num_stored == 0
    assert planner.matched_tokens(request("b", list(prompt)), 0) == 0
    store = copier.store
    assert store is not None and len(store) == 2
    run_step(planner, copier, [], {})  # the next plan drops them on every rank
    assert len(store) == 0


def test_connector_options_are_checked() -> None:
    from tpkv.integrations.vllm.options import DEFAULT_HOST_BYTES, ConnectorOptions

    assert ConnectorOptions.from_extra(None).host_bytes == DEFAULT_HOST_BYTES
    opts = ConnectorOptions.from_extra({"host_bytes": "64MiB", "model_fingerprint": "m-1"})
    assert opts.host_bytes == 64 << 20 and opts.model_fingerprint == "m-1"
    with pytest.raises(ConfigError, match=r"keys tpkv does not know: \['host_byte'\]"):
        ConnectorOptions.from_extra({"host_byte": 1})
    for bad in (0, -5, True, 1.5, "lots"):
        with pytest.raises(ConfigError):
            ConnectorOptions.from_extra({"host_bytes": bad})
    with pytest.raises(ConfigError):
        ConnectorOptions.from_extra({"model_fingerprint": " "})


def test_lora_salt_and_multimodal_requests_never_share_plain_blocks() -> None:
    copier = BlockCopier(1 << 20)
    copier.register(kv_caches(), NUM_BLOCKS)
    planner = Planner(BT, SEED, capacity_blocks=64)
    prompt = list(range(13))
    planner.matched_tokens(request("plain", prompt), 0)
    run_step(planner, copier, [("plain", 13)], {"plain": [0, 1, 2, 3]})
    assert planner.matched_tokens(request("again", list(prompt)), 0) == 12

    lora = SimpleNamespace(lora_name="adapter", lora_path="/a", lora_int_id=1)
    salted = [SimpleNamespace(request_id="lora", all_token_ids=list(prompt), lora_request=lora),
              SimpleNamespace(request_id="salt", all_token_ids=list(prompt), cache_salt="s1")]
    for req in salted:
        assert planner.matched_tokens(req, 0) == 0, req.request_id
    # their own blocks are stored under their own keys, and serve their own kind
    run_step(planner, copier, [("lora", 13)], {"lora": [4, 5, 6, 7]})
    assert planner.index.num_stored == 6
    twin = SimpleNamespace(request_id="lora2", all_token_ids=list(prompt), lora_request=lora)
    assert planner.matched_tokens(twin, 0) == 12
    assert planner.matched_tokens(SimpleNamespace(
        request_id="salt2", all_token_ids=list(prompt), cache_salt="s2"), 0) == 0

    image = SimpleNamespace(request_id="mm", all_token_ids=list(prompt), mm_features=[object()])
    assert planner.matched_tokens(image, 0) == 0
    plan = planner.plan([("mm", 13)], lambda r: [8, 9, 10, 11])
    assert plan.saves == [] and planner.finished("mm")["written_blocks"] == 0
