"""Schedule's `resume`: the caller's load-or-recompute choice for a returning session."""

import pytest

from tests.unit.test_controller_tiers import moves, small_l2_rig
from tpkv.errors import ArgumentError, ArgumentTypeError, BadRequestError
from tpkv.protocol.plan import Tier


def spilled(make_config, fake_clock, **policy):
    """Session "a" has all four blocks on L3."""
    rig = small_l2_rig(make_config, fake_clock, **policy)
    rig.open("a", "b", "c", "d", "e")
    for n in "abcde":
        rig.step([n])
    assert rig.where("a") == ["SSD"] * 4
    return rig


def test_load_overrides_a_cost_model_that_would_recompute(make_config, fake_clock):
    """Its records were read ahead: the disk is no longer on the step's path."""
    rig = spilled(make_config, fake_clock, spill="always")
    rig.c.rates.ssd_read_bytes_per_s, rig.c.rates.prefill_tokens_per_s = 1.0, 1e9
    res = rig.c.schedule(["a"], [0], resume={"a": "load"})
    assert len(res.recompute_session_idx) == 0 and "a" not in res.ssd_dropped_sessions
    assert moves(res, Tier.SSD, Tier.DRAM) == 4
    snap = {s["session"]: s for s in rig.c.snapshot()["sessions"]}
    assert snap["a"]["cost"]["choice"] == "load"


def test_recompute_overrides_a_cost_model_that_would_load(make_config, fake_clock):
    rig = spilled(make_config, fake_clock)
    rig.c.rates.ssd_read_bytes_per_s, rig.c.rates.prefill_tokens_per_s = 1e12, 1.0
    res = rig.c.schedule(["a"], [0], resume={"a": "recompute"})
    assert moves(res, Tier.SSD, Tier.DRAM) == 0 and "a" not in res.ssd_dropped_sessions
    assert res.recompute_session_idx.tolist() == [0]
    assert (res.recompute_start.tolist(), res.recompute_stop.tolist()) == ([0], [4])


def test_a_session_in_l1_is_not_recomputed_whatever_resume_says(make_config, fake_clock):
    rig = spilled(make_config, fake_clock)
    res = rig.step(["e"])
    res = rig.c.schedule(["e"], [1], resume={"e": "recompute"})
    assert len(res.recompute_session_idx) == 0


@pytest.mark.parametrize("resume, error, words", [
    ({"zz": "load"}, BadRequestError, "'zz', which is not in the step's batch of 1"),
    ({"a": "fetch"}, ArgumentError, "'fetch'"),
    (["a"], ArgumentTypeError, "list"),
])
def test_a_bad_resume_is_refused_and_changes_nothing(make_config, fake_clock, resume, error,
                                                     words):
    rig = spilled(make_config, fake_clock)
    tick, before = rig.c.tick, rig.c.slot_map()["digest"]
    with pytest.raises(error, match=words):
        rig.c.schedule(["a"], [0], resume=resume)
    assert rig.c.tick == tick and rig.c.slot_map()["digest"] == before
    rig.step(["a"])  # and the controller goes on
    assert rig.where("a") == ["HBM"] * 4
