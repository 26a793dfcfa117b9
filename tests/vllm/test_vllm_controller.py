"""TpkvConnector with its prefix index in a Ray actor (controller "ray"), in real vLLM (CPU): the
actor killed between two turns, every request still completes with vLLM's own tokens, and a
later turn is served again from the disk tier by the actor the scheduler makes anew; then the
actor killed for Ray to restart, and a later turn served by it from the disk tier; then the
actor killed from a thread while vLLM computes six prompts of one generate (for Ray to restart,
then for good), every request still completing with vLLM's tokens, and later turns served
from the disk tier by the restarted actor and by the one made anew.

One vLLM process (tests/vllm/run_llm.py "controller") on a local Ray cluster it starts on
127.0.0.1; its engine core joins it (RAY_ADDRESS). 2 blocks of host memory, 12 more for blocks
on their way to disk, 40 records on disk (more than the run writes: turn 1's stay there).
Tokens are compared with vLLM without the connector (the session's baseline run).
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
QUEUE_BLOCKS = 12
DISK_RECORDS = 40


@pytest.fixture(scope="module")
def controller_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
                   ) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-controller")
    extra = {"host_bytes": (2 + QUEUE_BLOCKS) * BLOCK_BYTES, "disk_dir": str(root / "tier"),
             "disk_bytes": DISK_RECORDS * record_bytes(BLOCK_TOKENS, BLOCK_BYTES),
             "disk_queue_bytes": QUEUE_BLOCKS * BLOCK_BYTES, "controller": "ray"}
    return run(tiny_llama, root / "controller.json", "controller", extra,
               env_extra={"RAY_USAGE_STATS_ENABLED": "0"})


def test_every_request_completes_with_vllms_tokens(baseline: Any, controller_run: Any) -> None:
    results = controller_run["results"]
    midway = [[f"w{at}_{i}" for i in range(6)] for at in (11, 23)]
    assert [r["name"] for r in results] == ["v1", "v_filler", "v2", "v_down", "v3", "v4", "v5",
                                            *midway[0], "v_back", *midway[1], "v_after", "v6"]
    for r in results:
        ref = baseline["by_name"][r["name"]]
        assert ref["prompt"] == r["prompt"] and r["tokens"] == ref["tokens"], r["name"]
    # nothing raised, in this process, its kill thread or vLLM's engine core; one warning an
    # outage (the scheduler may see no outage in the generate Ray's restart raced: it takes
    # the restarted actor's index at its next call)
    assert "Traceback" not in controller_run["stderr"]
    assert controller_run["stderr"].count("tpkv prefix index unavailable") in (3, 4)


def test_without_the_actor_nothing_matches_and_nothing_is_stored(controller_run: Any) -> None:
    by_name = controller_run["by_name"]
    first = tpkv_stats(by_name["v1"])
    assert first["matched_tokens"] == 0 and first["written_blocks"] == 3
    # killed before turn 2: its match came from the scheduler's mirror (the ranks hold those
    # blocks: only the scheduler drops them), its saves found the actor dead
    second = tpkv_stats(by_name["v2"])
    assert second["matched_tokens"] == 96 and second["failed_load_blocks"] == 0
    assert second["written_blocks"] == second["deduplicated_blocks"] == 0
    down = tpkv_stats(by_name["v_down"])  # turn 1 again: the scheduler has no index now
    assert down["matched_tokens"] == down["written_blocks"] == down["deduplicated_blocks"] == 0
    assert down["index_blocks"] == 0


def test_the_new_actor_serves_the_disk_tier(controller_run: Any) -> None:
    assert len(controller_run["index_actor_waited_s"]) == 4
    third = controller_run["by_name"]["v3"]
    stats = tpkv_stats(third)
    # turn 1's three blocks, pushed out to disk before the kill, found there by the new actor
    # (turn 2's load brought some back into memory, so at least one loads from disk)
    assert stats["matched_tokens"] == 96 and stats["disk_loaded_blocks"] >= 1
    assert stats["failed_load_blocks"] == 0 and third["num_cached_tokens"] >= 96
    # the new actor's index: the disk tier's records when it was made, and turn 3's writes
    records = controller_run["disk_used_bytes"][4] // record_bytes(BLOCK_TOKENS, BLOCK_BYTES)
    assert records == 6 and stats["index_blocks"] == records + stats["written_blocks"]


def test_an_actor_ray_restarts_serves_the_disk_tier(controller_run: Any) -> None:
    by_name = controller_run["by_name"]
    # killed before turn 4, restarted by Ray: it rebuilt its index from the disk tier, and
    # the scheduler took that index at its next call
    fifth = tpkv_stats(by_name["v5"])
    assert fifth["matched_tokens"] == 96 and fifth["failed_load_blocks"] == 0
    assert by_name["v5"]["num_cached_tokens"] >= 96


@pytest.mark.parametrize("at,how", [(11, "Ray restarts it"), (12 + 11, "for good")])
def test_a_kill_during_a_generate_leaves_every_request_vllms_tokens(
        baseline: Any, controller_run: Any, at: int, how: str) -> None:
    by_name = controller_run["by_name"]
    batch = [by_name[f"w{at}_{i}"] for i in range(6)]
    kill = batch[0]["kill"]
    # the thread's kill returned while generate ran, before vLLM had finished every request
    assert kill["running"] and kill["requests"] == 6 and kill["finished"] < 6, (how, kill)
    for r in batch:
        ref = baseline["by_name"][r["name"]]
        assert r["tokens"] == ref["tokens"] and len(r["tokens"]) == 8, (how, r["name"])
        assert tpkv_stats(r)["failed_load_blocks"] == 0, (how, r["name"])
    print(f"killed ({how}) with {kill['finished']} of 6 requests done; round "
          f"{batch[0]['round_s']:.2f} s; index blocks at their ends "
          f"{[tpkv_stats(r)['index_blocks'] for r in batch]}")


def test_after_a_kill_during_a_generate_the_actor_serves_the_disk_tier(
        controller_run: Any) -> None:
    # v_back: the actor Ray restarted during the first generate; v6: the one the scheduler
    # made after the second killed it for good (the index was up when that kill came)
    for name in ("v_back", "v6"):
        result = controller_run["by_name"][name]
        stats = tpkv_stats(result)
        assert stats["matched_tokens"] == 96 and stats["failed_load_blocks"] == 0, name
        assert result["num_cached_tokens"] >= 96 and stats["index_blocks"] > 0, name
