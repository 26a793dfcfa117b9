"""A block recomputed from tokens its L3 record holds keeps that record as its L3 copy."""

import numpy as np

from tests.unit.test_controller_tiers import Rig
from tpkv.protocol.plan import Tier


def _rig(make_config, fake_clock, **policy):
    """Five sessions of 14 tokens (4 blocks, the last part full) through L1 8 / L2 8 / L3 64:
    after one step each, a, b and c are in L3."""
    rig = Rig(make_config(l1=8, l2=8, l3=64, **policy), fake_clock, l1=8, l2=8)
    rig.open(*"abcde", tokens=14)
    for n in "abcde":
        rig.step([n])
    assert rig.where("a") == ["SSD"] * 4
    return rig


def _step(rig, batch, tokens, resume=None, misses=None):
    """Rig.step with schedule's `resume`: applied by both replicas (which check every kept
    spill against the version of the record it keeps), committed."""
    res = rig.c.schedule(batch, tokens, None, resume=resume)
    reports = [r.apply_step(res, misses) for r in rig.reps]
    for i in range(len(res.plans)):
        assert rig.c.commit([rep[i] for rep in reports]).committed
    assert rig.reps[0].digest() == rig.c.slot_map()["digest"]
    return res


def _spills(res, name):
    """(logical, kept) of the step's L2 -> L3 moves of session `name`."""
    return sorted((int(lg), bool(k)) for p in res.plans
                  for si, lg, k, d in zip(p.session_idx, p.logical_idx, p.kept_mask(), p.dst_tier)
                  if d == Tier.SSD and p.session_names[si] == name)


def _until_spilled(rig, name, others="bcde"):
    """Run the others, one a step, until `name` is in L3 again; (logical, kept) of its
    spills."""
    out = []
    for n in others * 3:
        out += _spills(rig.step([n]), name)
        if rig.where(name) == ["SSD"] * len(rig.where(name)):
            return sorted(out)
    raise AssertionError(f"{name} never went back to L3: {rig.where(name)}")


def test_a_session_recomputed_from_l3_is_spilled_again_writing_only_its_written_block(
        make_config, fake_clock):
    """Recomputed (the caller's choice) with one token more: its three full blocks keep their
    records; when it leaves L2 again they are kept spills (nothing written), and only the
    block the token went into is written. Before, the segment was deleted at the recompute
    and all four blocks were written again."""
    rig = _rig(make_config, fake_clock)
    S, T = rig.c.sessions, rig.c.table
    res = _step(rig, ["a"], [1], resume={"a": "recompute"})
    assert (res.recompute_start.tolist(), res.recompute_stop.tolist()) == ([0], [4])
    assert "a" not in res.ssd_dropped_sessions
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 1, 0]
    assert int(S.l3_other[S.lookup("a")]) == 4  # 3 copies and the dead record of block 3
    rig.c.check_integrity()
    assert _until_spilled(rig, "a") == [(0, True), (1, True), (2, True), (3, False)]
    assert rig.reps[0].num_records["a"] == 5  # 4 from the first spill, block 3 again
    rig.c.check_integrity()


def test_the_cost_model_s_recompute_keeps_the_records_too(make_config, fake_clock):
    """The same with no `resume`: a disk slower than the prefill makes the cost model
    recompute; the session comes back unchanged, so its second spill writes nothing."""
    rig = _rig(make_config, fake_clock)
    rig.c.rates.ssd_read_bytes_per_s, rig.c.rates.prefill_tokens_per_s = 1.0, 1e9
    res = _step(rig, ["a"], [0])
    assert (res.recompute_start.tolist(), res.recompute_stop.tolist()) == ([0], [4])
    assert rig.c.snapshot()["events"][-1]["kind"] != "drop_l3_copies"
    rig.c.rates.ssd_read_bytes_per_s, rig.c.rates.prefill_tokens_per_s = 1e9, 1.0
    assert _until_spilled(rig, "a") == [(j, True) for j in range(4)]
    assert rig.reps[0].num_records["a"] == 4


def test_a_block_appended_to_after_the_recompute_is_written_not_kept(make_config, fake_clock):
    """Recomputed with no new token, then a later step writes into its last block: that
    block's copy is void (the replicas would refuse a kept spill onto its old record), and
    a new block is written from scratch."""
    rig = _rig(make_config, fake_clock)
    S, T = rig.c.sessions, rig.c.table
    _step(rig, ["a"], [0], resume={"a": "recompute"})
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 1, 1]
    _step(rig, ["a"], [3])  # 17 tokens: block 3 filled, block 4 opened
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 1, 0, 0]
    assert _until_spilled(rig, "a") == [(0, True), (1, True), (2, True), (3, False),
                                        (4, False)]


def test_a_recompute_after_a_failed_record_keeps_nothing_of_it(make_config, fake_clock):
    """Block 1's record fails to read while the session is loaded: it is lost (Tier.NONE)
    and recomputed at the next run (the caller asks for a recompute), and its record is never
    kept: its next spill writes it. Blocks 2 and 3, fed again after it, lose their copies as
    before (only blocks recomputed by choice keep records); block 0 keeps its copy. (A guard:
    it passes on f58c2b4 too.)"""
    rig = _rig(make_config, fake_clock)
    c, S, T = rig.c, rig.c.sessions, rig.c.table
    res = c.schedule(["a"], [0])
    first = res.plans[0]
    a_idx = first.session_names.index("a")
    bad = int(first.block_ids[(first.session_idx == a_idx) & (first.logical_idx == 1)][0])
    reports = [r.apply_step(res, {first.epoch: [bad]}) for r in rig.reps]
    for i in range(len(res.plans)):
        assert c.commit([rep[i] for rep in reports]).committed
    assert rig.where("a")[1] == "NONE"
    res = _step(rig, ["a"], [0], resume={"a": "recompute"})
    assert (res.recompute_start.tolist(), res.recompute_stop.tolist()) == ([1], [2])
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 0, 0, 0]
    assert _until_spilled(rig, "a") == [(0, True), (1, False), (2, False), (3, False)]


def test_a_lost_block_recomputed_beside_blocks_in_l3_keeps_no_record(make_config, fake_clock):
    """A session with blocks in L3 and one lost (mark_lost: no rank holds it), recomputed:
    the blocks in L3 keep their records, the lost one is written when it goes down again."""
    rig = _rig(make_config, fake_clock)
    S, T = rig.c.sessions, rig.c.table
    rows = S.rows(S.lookup("a"))
    assert rig.c.mark_lost(T.ids(rows[2:3])) == 1
    _step(rig, ["a"], [0], resume={"a": "recompute"})
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 0, 1]
    assert _until_spilled(rig, "a") == [(0, True), (1, True), (2, False), (3, True)]


def test_blocks_with_l3_copies_leave_l2_as_kept_spills_when_the_rest_is_dropped(
        make_config, fake_clock):
    """spill="cost" with a disk that falls behind (it writes nothing in spill_queue_s): what
    leaves L2 is dropped rather than waited for, but a block whose record is on disk already
    goes to L3 for free: a kept spill, its record still its copy for the next return."""
    rig = _rig(make_config, fake_clock)
    S, T = rig.c.sessions, rig.c.table
    _step(rig, ["a"], [1])  # loaded back (the disk is fast yet): copies of blocks 0..2
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 1, 0]
    T.pace.rate = 1.0  # bytes/s: from now on every spill in flight holds a copy too long
    rig.c.rates.ssd_read_bytes_per_s, rig.c.rates.prefill_tokens_per_s = 1.0, 1e9
    spilled = []
    for n in "bcde" * 2:
        spilled += _spills(rig.step([n]), "a")
        if "DRAM" not in rig.where("a") and "HBM" not in rig.where("a"):
            break
    assert sorted(spilled) == [(0, True), (1, True), (2, True)]
    assert rig.where("a") == ["SSD", "SSD", "SSD", "NONE"]
    drops = [e for e in rig.c.snapshot()["events"] if e["kind"] == "drop_l2"]
    assert any(e["kept_spills"] for e in drops)
    rig.c.check_integrity()
    # back: recomputed (the disk is slow), the three records kept once more
    res = _step(rig, ["a"], [0])
    assert (res.recompute_start.tolist(), res.recompute_stop.tolist()) == ([0], [4])
    assert T.l3copy[S.rows(S.lookup("a"))].tolist() == [1, 1, 1, 0]
    assert np.count_nonzero(T.l3copy) >= 3
