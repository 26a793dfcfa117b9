"""TpkvConnector in real vLLM (CPU): tokens equal, prefixes loaded, shared blocks stored once.

Two vLLM processes (tests/vllm/run_llm.py), one without the connector and one with it, run the
same rounds of prompts; every check reads their JSON results. `make vllm-test` builds the venv
these need; elsewhere the module is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import run, skip_without_vllm, tpkv_stats

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # two vLLM start-ups
skip_without_vllm()

BLOCK_TOKENS = 32
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, baseline: dict[str, Any]
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    tpkv = run(tiny_llama, tmp_path_factory.mktemp("vllm") / "tpkv.json", "tpkv")
    return baseline, tpkv


def computed_prefixes(result: dict[str, Any]) -> set[tuple[int, ...]]:
    """The token prefixes of the full blocks whose KV vLLM computed (every token but the last
    sampled one has its KV)."""
    seq = result["prompt"] + result["tokens"]
    full = (len(seq) - 1) // BLOCK_TOKENS
    return {tuple(seq[:(i + 1) * BLOCK_TOKENS]) for i in range(full)}


def test_greedy_tokens_equal_vllm_without_the_connector(runs: Any) -> None:
    base, tpkv = runs
    assert len(tpkv["results"]) == 10
    for r in tpkv["results"]:
        ref = base["by_name"][r["name"]]
        assert len(ref["tokens"]) == MAX_TOKENS and ref["prompt"] == r["prompt"], r["name"]
        assert r["tokens"] == ref["tokens"], r["name"]


def test_a_repeated_prompt_loads_its_blocks(runs: Any) -> None:
    _, tpkv = runs
    first, again = (tpkv_stats(tpkv["by_name"][n]) for n in ("a", "a_again"))
    prompt_len = len(tpkv["by_name"]["a"]["prompt"])
    assert first["matched_tokens"] == 0 and first["written_blocks"] == 3
    # every full block before the last prompt token: (100 - 1) // 32 blocks
    assert again["matched_tokens"] == (prompt_len - 1) // BLOCK_TOKENS * BLOCK_TOKENS == 96
    assert again["failed_load_blocks"] == 0 and again["written_blocks"] == 0
    assert tpkv["by_name"]["a_again"]["num_cached_tokens"] >= 96


def test_a_prefix_shared_with_an_earlier_prompt_is_loaded(runs: Any) -> None:
    _, tpkv = runs
    b, c = tpkv["by_name"]["b"], tpkv["by_name"]["c"]  # share a's first two blocks, one step
    assert tpkv_stats(b)["matched_tokens"] == 64 and tpkv_stats(b)["failed_load_blocks"] == 0
    # c, scheduled after b in the same step, finds those blocks in vLLM's own cache
    assert tpkv_stats(c)["matched_tokens"] == 0 and c["num_cached_tokens"] == 64
    for r in (b, c):
        stats = tpkv_stats(r)
        assert stats["deduplicated_blocks"] == 2 and stats["written_blocks"] == 1, r["name"]


def test_the_connector_serves_only_what_vllm_no_longer_holds(runs: Any) -> None:
    _, tpkv = runs
    third = tpkv["by_name"]["a_third"]
    # vLLM's own cache held the two system-prompt blocks (from b and c); tpkv loaded block 2
    assert tpkv_stats(third)["matched_tokens"] == 32
    assert third["num_cached_tokens"] == 96


def test_a_shared_prefix_is_stored_once(runs: Any) -> None:
    _, tpkv = runs
    d, e = tpkv["by_name"]["d"], tpkv["by_name"]["e"]  # a new shared prefix, in one step
    written = tpkv_stats(d)["written_blocks"] + tpkv_stats(e)["written_blocks"]
    assert written == len(computed_prefixes(d) | computed_prefixes(e)) == 4
    before_reset = tpkv["results"][:-1]
    distinct: set[tuple[int, ...]] = set()
    for r in before_reset:
        distinct |= computed_prefixes(r)
    # nothing was evicted (64 MiB hold 2048 blocks): the index holds each distinct block once;
    # one block was written twice (stored again after its damaged record failed its check)
    assert tpkv_stats(before_reset[-1])["index_blocks"] == len(distinct) == 12
    assert sum(tpkv_stats(r)["written_blocks"] for r in before_reset) == len(distinct) + 1


def test_resetting_the_connector_forgets_its_blocks(runs: Any) -> None:
    _, tpkv = runs
    stats = tpkv_stats(tpkv["by_name"]["a_forgotten"])
    assert stats["matched_tokens"] == 0 and stats["written_blocks"] == 3
    assert stats["index_blocks"] == 3


def test_a_corrupt_record_is_recomputed_never_served(runs: Any) -> None:
    base, tpkv = runs
    stats = tpkv_stats(tpkv["by_name"]["corrupt_again"])
    # 3 blocks matched, the second's record was damaged: it failed its check, vLLM
    # recomputed from it, and the block was stored again from the recomputed KV
    assert stats["matched_tokens"] == 96
    assert stats["failed_load_blocks"] == 1 and stats["written_blocks"] == 1
    assert tpkv["by_name"]["corrupt_again"]["tokens"] == base["by_name"]["corrupt"]["tokens"]
