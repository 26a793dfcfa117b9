"""TpkvConnector's background loads in real vLLM (CPU): loads from the disk tier run as vLLM's
asynchronous KV loads (the request waits in WAITING_FOR_REMOTE_KVS, get_finished names it).

One vLLM process with the connector (tests/vllm/run_llm.py "async", async_loads "auto") keeps
2 blocks in host memory and writes the rest to disk on the step's path; every load it makes
reads blocks pushed out to disk, so each runs in the background. Tokens are compared with vLLM
without the connector (the session's baseline run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import run, skip_without_vllm, tpkv_stats
from tpkv.integrations.disk_format import record_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # one vLLM start-up
skip_without_vllm()

BLOCK_TOKENS = 32
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 32 * 4  # the tiny Llama's block on one rank


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-async")
    extra = {"host_bytes": 2 * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_bytes": 40 * record_bytes(BLOCK_TOKENS, BLOCK_BYTES),
             "disk_queue_bytes": 0, "async_loads": "auto"}
    return run(tiny_llama, root / "async.json", "async", extra)


def test_tokens_equal_vllm_without_the_connector(baseline: Any, async_run: Any) -> None:
    results = async_run["results"]
    assert [r["name"] for r in results] == ["s1", "s_filler", "s2", "q", "q_filler",
                                            "q_again", "s_new", "s3"]
    for r in results:
        ref = baseline["by_name"][r["name"].removesuffix("_again")]
        assert ref["prompt"] == r["prompt"] and r["tokens"] == ref["tokens"], r["name"]


def test_a_second_turn_loads_from_disk_in_the_background(async_run: Any) -> None:
    first = tpkv_stats(async_run["by_name"]["s1"])
    assert first["matched_tokens"] == 0 and first["written_blocks"] == 3
    second = async_run["by_name"]["s2"]
    stats = tpkv_stats(second)
    # turn 1's three blocks, pushed out to disk by s_filler, loaded by the loader thread
    assert stats["matched_tokens"] == 96 and stats["async_load_blocks"] == 3
    assert stats["disk_loaded_blocks"] == 3 and stats["failed_load_blocks"] == 0
    assert stats["deduplicated_blocks"] == 3 and second["num_cached_tokens"] >= 96


def test_a_returning_turn_loads_while_a_new_prompt_is_computed(async_run: Any) -> None:
    third = tpkv_stats(async_run["by_name"]["s3"])
    assert third["matched_tokens"] == 160 and third["async_load_blocks"] == 5
    assert third["failed_load_blocks"] == 0
    new = tpkv_stats(async_run["by_name"]["s_new"])
    assert new["matched_tokens"] == 0 and new["async_load_blocks"] == 0


def test_a_corrupt_disk_record_under_a_background_load_is_recomputed(
        baseline: Any, async_run: Any) -> None:
    again = async_run["by_name"]["q_again"]
    stats = tpkv_stats(again)
    # block 0 loaded from disk; block 1's record was damaged: vLLM recomputed from it
    assert stats["matched_tokens"] == 96 and stats["async_load_blocks"] == 3
    assert stats["failed_load_blocks"] == 1 and stats["disk_loaded_blocks"] == 1
    assert stats["written_blocks"] == 1  # block 1 again (block 2 is held: deduplicated)
    assert again["tokens"] == baseline["by_name"]["q"]["tokens"]
