"""TpkvConnector's disk tier in real vLLM (CPU): spills, loads back, survives a restart.

Two vLLM processes with the connector share one disk tier directory, one after the other: the
first ("disk" rounds of tests/vllm/run_llm.py) keeps 2 blocks in host memory, 12 more for
blocks on their way to disk (the background writer's queue: the largest step writes 12 blocks,
so none is given up however slow the disk), and 10 records on disk; the second ("restart")
starts fresh over the same directory. run_llm.py reads the disk tier once its writes have
landed. Tokens are compared with vLLM without the connector (the session's baseline run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import run, skip_without_vllm, tpkv_stats
from tpkv.integrations.disk_format import record_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # two vLLM start-ups
skip_without_vllm()

BLOCK_TOKENS = 32
# the tiny Llama's block on one rank: 2 layers x (K, V) x 32 tokens x 2 heads x 32 x 4 bytes
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 32 * 4
RECORD_BYTES = record_bytes(BLOCK_TOKENS, BLOCK_BYTES)
DISK_RECORDS = 10
DISK_BYTES = DISK_RECORDS * RECORD_BYTES
QUEUE_BLOCKS = 12


@pytest.fixture(scope="module")
def disk_runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
              ) -> tuple[dict[str, Any], dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("vllm-disk")
    extra = {"host_bytes": (2 + QUEUE_BLOCKS) * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_bytes": DISK_BYTES, "disk_queue_bytes": QUEUE_BLOCKS * BLOCK_BYTES}
    first = run(tiny_llama, root / "disk.json", "disk", extra)
    second = run(tiny_llama, root / "restart.json", "restart", extra)
    return first, second, root / "tier"


def test_tokens_equal_vllm_without_the_connector(baseline: Any, disk_runs: Any) -> None:
    first, second, _ = disk_runs
    results = first["results"] + second["results"]
    assert len(results) == 14
    for r in results:
        ref = baseline["by_name"][r["name"].removesuffix("_restart")]
        assert ref["prompt"] == r["prompt"], r["name"]
        assert r["tokens"] == ref["tokens"], r["name"]


def test_blocks_over_the_host_cap_go_to_disk_and_load_back(disk_runs: Any) -> None:
    first, _, _ = disk_runs
    # f, g, h wrote 9 blocks; memory holds 2, so 7 records were on disk after the first round
    assert sum(tpkv_stats(first["by_name"][n])["written_blocks"] for n in "fgh") == 9
    assert first["disk_used_bytes"][:2] == [0, 7 * RECORD_BYTES]
    again = first["by_name"]["f_again"]
    stats = tpkv_stats(again)
    assert stats["matched_tokens"] == 96 and stats["disk_loaded_blocks"] == 3
    assert stats["failed_load_blocks"] == 0 and again["num_cached_tokens"] >= 96


def test_a_new_process_loads_the_prompt_blocks_from_disk(disk_runs: Any) -> None:
    first, second, _ = disk_runs
    m = tpkv_stats(first["by_name"]["m"])
    assert m["written_blocks"] == 2 and m["matched_tokens"] == 0
    restarted = second["by_name"]["m_restart"]
    stats = tpkv_stats(restarted)
    # a fresh vLLM, nothing in its own cache or tpkv's memory: both of m's blocks from disk
    assert stats["matched_tokens"] == 64 and stats["disk_loaded_blocks"] == 2
    assert stats["failed_load_blocks"] == 0 and stats["written_blocks"] == 0
    assert restarted["num_cached_tokens"] == 64
    assert stats["index_blocks"] == DISK_RECORDS  # every record the first process left


def test_a_corrupt_disk_record_is_recomputed(baseline: Any, disk_runs: Any) -> None:
    first, _, _ = disk_runs
    again = first["by_name"]["k_again"]
    stats = tpkv_stats(again)
    # block 0 came from disk; block 1's record was damaged on disk: vLLM recomputed from it
    # (block 2, loaded too, is recomputed and not counted)
    assert stats["matched_tokens"] == 96 and stats["failed_load_blocks"] == 1
    assert stats["disk_loaded_blocks"] == 1 and stats["written_blocks"] == 1
    assert again["tokens"] == baseline["by_name"]["k"]["tokens"]


def test_the_disk_cap_is_never_exceeded(disk_runs: Any) -> None:
    first, second, tier = disk_runs
    used = first["disk_used_bytes"] + second["disk_used_bytes"]
    assert len(used) == 1 + 8 + 1 + 1
    assert max(used) == DISK_BYTES  # filled to the cap (p1..p4 alone write 12 blocks)
    assert all(u <= DISK_BYTES for u in used), used
    files = sorted(p.name for p in (tier / "rank0").iterdir())
    assert len(files) == DISK_RECORDS and all(f.endswith(".blk") for f in files)
