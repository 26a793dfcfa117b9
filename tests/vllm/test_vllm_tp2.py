"""TpkvConnector in real vLLM (CPU) at tensor parallel 2: each rank stores and loads its own shard.

Two vLLM processes at tensor_parallel_size=2 (one core a worker: VLLM_CPU_OMP_THREADS_BIND),
one without the connector and one with it (tests/vllm/run_llm.py tp2_baseline / tp2), run the
same rounds. The connector keeps 2 blocks a rank in host memory and the rest in each rank's
disk tier directory; sabotage.SabotagedRankConnector damages rank 1's disk record of one block,
once, and fills the vLLM block it failed to load with noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import run, skip_without_vllm, tp2_cpu_bind, tpkv_stats
from tpkv.integrations.disk_format import record_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # two vLLM start-ups
skip_without_vllm()

BLOCK_TOKENS = 32
# the tiny Llama's block on one of 2 ranks: 2 layers x (K, V) x 32 tokens x 1 head x 32 x 4 B
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 1 * 32 * 4
RECORD_BYTES = record_bytes(BLOCK_TOKENS, BLOCK_BYTES)


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    bind = {"VLLM_CPU_OMP_THREADS_BIND": tp2_cpu_bind()}
    root = tmp_path_factory.mktemp("vllm-tp2")
    extra = {"host_bytes": 2 * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_bytes": 40 * RECORD_BYTES, "disk_queue_bytes": 0}
    base = run(tiny_llama, root / "base.json", "tp2_baseline", env_extra=bind)
    tpkv = run(tiny_llama, root / "tpkv.json", "tp2", extra, env_extra=bind)
    return base, tpkv


def test_tokens_equal_vllm_at_tp2_without_the_connector(tp2_runs: Any) -> None:
    base, tpkv = tp2_runs
    assert [r["name"] for r in tpkv["results"]] == [r["name"] for r in base["results"]]
    assert len(tpkv["results"]) == 6
    for r in tpkv["results"]:
        ref = base["by_name"][r["name"]]
        assert r["prompt"] == ref["prompt"] and r["tokens"] == ref["tokens"], r["name"]


def test_the_second_turn_is_served_from_both_ranks_stores(tp2_runs: Any) -> None:
    _, tpkv = tp2_runs
    first, second = (tpkv_stats(tpkv["by_name"][n]) for n in ("turn1", "turn2"))
    assert first["matched_tokens"] == 0 and first["written_blocks"] == 3
    # turn 1's three blocks, from host memory and disk of each rank; the last token computed
    assert second["matched_tokens"] == 96 and second["failed_load_blocks"] == 0
    assert second["async_load_blocks"] == 3  # block 0 was on disk: loaded in the background
    assert second["written_blocks"] == 2 and second["deduplicated_blocks"] == 3
    assert tpkv["by_name"]["turn2"]["num_cached_tokens"] >= 96
    files = tpkv["rank_files"]
    assert sorted(files) == ["rank0", "rank1"]
    # each rank's own records, of the same blocks (blocks only one rank held were dropped)
    assert files["rank0"] == files["rank1"] and len(files["rank0"]) > 0


def test_a_record_damaged_on_one_rank_is_recomputed_on_both(tp2_runs: Any) -> None:
    base, tpkv = tp2_runs
    k2 = tpkv_stats(tpkv["by_name"]["k2"])
    # rank 1's record of block 1 failed its check: one failed block over both ranks, vLLM
    # recomputed from it; block 0 came from disk on both; blocks 1, 3 and 4 written again
    assert k2["matched_tokens"] == 96 and k2["failed_load_blocks"] == 1
    assert k2["async_load_blocks"] == 3  # a background load, finished once both ranks did
    assert k2["disk_loaded_blocks"] == 1
    assert tpkv["by_name"]["k2"]["tokens"] == base["by_name"]["k2"]["tokens"]
    k3 = tpkv_stats(tpkv["by_name"]["k3"])
    # k2's five blocks load on both ranks, 3 and 4 as computed after vLLM recomputed block 1
    # (no copy made over rank 1's failed block is ever served)
    assert k3["matched_tokens"] == 160 and k3["failed_load_blocks"] == 0
    assert tpkv["by_name"]["k3"]["tokens"] == base["by_name"]["k3"]["tokens"]
