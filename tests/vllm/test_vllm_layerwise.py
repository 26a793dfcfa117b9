"""TpkvConnector's layer-wise loads in real vLLM (CPU): a load in the step is copied layer by
layer while vLLM's attention waits for each layer (wait_for_layer_load).

One vLLM process with the connector (tests/vllm/run_llm.py "async" rounds, async_loads "never":
every load runs in the step) keeps 4 blocks in host memory and writes the rest to disk on the
step's path, so its loads read host memory and disk; one disk record is damaged
(sabotage.SabotagedTpkvConnector). Its worker writes how many blocks it loaded layer by layer
(TPKV_TEST_LAYER_LOG). Tokens are compared with vLLM without the connector (the session's
baseline run).
"""

from __future__ import annotations

import json
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
def layer_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-layers")
    extra = {"host_bytes": 4 * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_bytes": 40 * record_bytes(BLOCK_TOKENS, BLOCK_BYTES),
             "disk_queue_bytes": 0, "async_loads": "never"}
    log = root / "layers.json"
    result = run(tiny_llama, root / "layers.json.out", "async", extra,
                 env_extra={"TPKV_TEST_LAYER_LOG": str(log)})
    return result, json.loads(log.read_text())


def test_tokens_equal_vllm_without_the_connector(baseline: Any, layer_run: Any) -> None:
    result, _ = layer_run
    assert len(result["results"]) == 8
    for r in result["results"]:
        ref = baseline["by_name"][r["name"]]
        assert ref["prompt"] == r["prompt"], r["name"]
        assert r["tokens"] == ref["tokens"], r["name"]


def test_every_load_in_the_step_is_copied_layer_by_layer(layer_run: Any) -> None:
    result, layers = layer_run
    stats = [tpkv_stats(r) for r in result["results"]]
    assert sum(s["async_load_blocks"] for s in stats) == 0  # none in the background
    loaded = sum(s["matched_tokens"] // BLOCK_TOKENS - s["failed_load_blocks"] for s in stats)
    assert loaded >= 9
    # the first round has nothing to load: its forward taught the layers' order
    assert layers["order"] == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    assert layers["layer_misses"] == 0
    assert layers["layer_loaded_blocks"] == layers["loaded_blocks"] >= loaded


def test_matched_tokens_come_from_host_memory_and_from_disk(layer_run: Any) -> None:
    result, _ = layer_run
    s2 = tpkv_stats(result["by_name"]["s2"])  # the filler pushed turn 1's oldest blocks out
    assert s2["matched_tokens"] == 96 and s2["failed_load_blocks"] == 0
    assert 0 < s2["disk_loaded_blocks"] < 3  # the others from host memory


def test_a_damaged_disk_record_is_recomputed(baseline: Any, layer_run: Any) -> None:
    result, _ = layer_run
    again = result["by_name"]["q_again"]
    stats = tpkv_stats(again)
    assert stats["matched_tokens"] == 96 and stats["failed_load_blocks"] == 1
    assert again["tokens"] == baseline["by_name"]["q"]["tokens"]
