"""TpkvConnector's dashboard in real vLLM (CPU): two turns of one conversation with
dashboard_port set; /api/snapshot, read over 127.0.0.1 with the token by the process that runs
vLLM (tests/vllm/run_llm.py "dashboard"), shows the second turn's hit and saved prefill and the
tiers the store holds (its disk tier's record files counted on disk)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import run, skip_without_vllm, tpkv_stats
from tpkv.integrations.disk_format import record_bytes

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # one vLLM start-up
skip_without_vllm()

BLOCK_TOKENS = 32
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 32 * 4  # the tiny Llama's block on one rank
QUEUE_BLOCKS = 4
TOKEN = "dash-t0ken"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dash_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-dash")
    extra = {"host_bytes": (2 + QUEUE_BLOCKS) * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_queue_bytes": QUEUE_BLOCKS * BLOCK_BYTES, "dashboard_port": free_port(),
             "dashboard_token": TOKEN}
    return run(tiny_llama, root / "dash.json", "dashboard", extra)


def test_the_dashboard_shows_hits_saved_prefill_and_the_tiers(dash_run: Any) -> None:
    dash = dash_run["dashboard"]
    assert dash["status_without_token"] == 401
    snap = dash["snapshot"]
    assert snap["kind"] == "vllm"
    v, turn1, turn2 = snap["vllm"], *(tpkv_stats(dash_run["by_name"][n]) for n in ("turn1",
                                                                                   "turn2"))
    c = v["counters"]
    # turn 2 loaded turn 1's three blocks from tpkv: the hit and the prefill it saved
    assert turn2["matched_tokens"] == 96 and turn2["failed_load_blocks"] == 0
    assert c["hit_tokens"] == 96 == c["saved_prefill_tokens"] and c["recomputed_tokens"] == 0
    assert c["lookups"] == 3 and c["prompt_tokens"] == 100 + 160 + 5  # and the short prompt
    assert c["hit_rate"] == pytest.approx(96 / 265)
    assert c["disk_hit_tokens"] == turn2["disk_loaded_blocks"] * BLOCK_TOKENS > 0
    assert c["disk_queue_dropped_blocks"] == 0
    # the index holds the 5 blocks the turns wrote; rank 0's tiers hold them all
    written = turn1["written_blocks"] + turn2["written_blocks"]
    assert written == 5 == v["index"]["blocks"] == v["index"]["written"]
    (rank,) = v["ranks"]
    assert rank["rank"] == 0 and rank["queued_blocks"] == 0  # the disk tier had settled
    assert rank["disk_blocks"] == dash["rank0_files"] > 0
    assert rank["disk_bytes"] == dash["rank0_bytes"] == rank["disk_blocks"] * record_bytes(
        BLOCK_TOKENS, BLOCK_BYTES)
    assert 0 < rank["host_blocks"] <= 2 + QUEUE_BLOCKS
    assert rank["host_bytes"] == rank["host_blocks"] * BLOCK_BYTES
    assert rank["host_blocks"] + rank["disk_blocks"] >= written  # a block may be in both
