"""TP ranks (gloo on CPU) apply 1000 random plans of the real controller and agree with it."""

from __future__ import annotations

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.rank_fns import consistency_rank

pytestmark = pytest.mark.timeout(150)


def _assert_all_ok(out: dict, tp: int) -> None:
    assert sorted(out) == list(range(tp)), f"reports from ranks {sorted(out)}"
    for rank, o in out.items():
        assert o["ok"], f"rank {rank}: {o.get('error')}: {o.get('message')}\n{o.get('trace')}"


@pytest.mark.parametrize("tp", [2, 4])
def test_1000_random_plans_every_slot_map_equals_the_controllers(tp, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("l3", numbered=True))
    out = run_ranks(consistency_rank, tp, 1000, 7, root, None, None, 4)
    _assert_all_ok(out, tp)
    first = out[0]
    assert first["plans"] >= 1000
    assert first["mismatches"] == 0 and first["retries"] == 0
    # every kind of move happened, and the checks (one every 250 plans: how full each tier is
    # at one instant depends on the disk's measured rate, which paces the spills) saw blocks
    # on every tier
    assert all(n > 0 for n in first["moves"].values()), first["moves"]
    assert first["l1"] > 0 and first["l2"] > 0 and first["l3"] > 0
    for o in out.values():  # the same steps and plans everywhere
        assert (o["steps"], o["plans"], o["moves"]) == (first["steps"], first["plans"],
                                                        first["moves"])


@pytest.mark.parametrize("tp,bad_rank", [(2, 1), (4, 3)])
def test_a_skipped_move_is_caught_at_its_plan_and_resynced(tp, bad_rank, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("l3", numbered=True))
    epoch = 57
    out = run_ranks(consistency_rank, tp, 200, 3, root, (bad_rank, epoch))
    _assert_all_ok(out, tp)  # including: slot maps and bytes match the controller at the end
    for o in out.values():
        assert o["mismatches"] == 1 and o["retries"] >= 1
        assert o["mismatch"]["epoch"] == epoch
        assert o["mismatch"]["ranks"] == [bad_rank]
        assert f"plan {epoch} applied differently on rank {bad_rank}" in o["mismatch"]["message"]


def test_an_l3_miss_on_one_rank_is_committed_and_the_step_retried(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("l3", numbered=True))
    out = run_ranks(consistency_rank, 2, 150, 3, root, None, (1, 40))
    _assert_all_ok(out, 2)  # maps and bytes match the controller: the block was dropped
    assert out[1]["misses_injected"]
    assert out[0]["mismatches"] == out[1]["mismatches"] == 0
    assert out[0]["retries"] == out[1]["retries"]  # both ranks retried the same steps
    assert out[0]["commit_refusals"] == out[1]["commit_refusals"] == 0
