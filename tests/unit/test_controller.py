"""Controller API: sessions, steps, block tables, typed errors that leave the table unchanged."""

import json

import msgpack
import numpy as np
import pytest

from tpkv.controller import Controller, SlotMapReplica
from tpkv.errors import (
    BadRequestError,
    ConfigError,
    ControllerRecoveringError,
    DuplicateSessionError,
    InvalidSessionIdError,
    PlanOrderError,
    SessionClosedError,
    TierFullError,
    UnknownSessionError,
    WireFormatError,
)
from tpkv.protocol.messages import (
    CommitOutcome,
    StepResult,
    move_result_from_dict,
    move_result_to_dict,
)
from tpkv.protocol.plan import MoveResult, Tier
from tpkv.protocol.wire import decode, encode


def state(c: Controller) -> tuple:
    """Everything a rejected call must leave as it was."""
    m = c.slot_map()
    S = c.sessions
    return (m["digest"], c.tick, c.next_epoch, c.committed_epoch, len(c.pending),
            tuple(sorted(S.index)), tuple(S.tokens[S.open_indices()].tolist()),
            tuple(S.pending[S.open_indices()].tolist()),
            tuple(c.table.num_free(t) for t in (Tier.HBM, Tier.DRAM, Tier.SSD)))


def run(c, reps, batch, tokens, upcoming=None):
    res = c.schedule(batch, tokens, upcoming)
    reports = [r.apply_step(res) for r in reps]
    for i in range(len(res.plans)):
        assert c.commit([rep[i] for rep in reports]).committed
    assert reps[0].digest() == c.slot_map()["digest"]
    return res


@pytest.fixture
def ctl(make_config, fake_clock):
    return Controller(make_config(), fake_clock, check_invariants=True)


@pytest.fixture
def reps(ctl):
    return [SlotMapReplica(r, 16, 32) for r in range(2)]


def test_first_steps_allocate_fresh_slots(ctl, reps):
    ctl.open_session("a", num_tokens=10)  # 3 blocks of 4 tokens
    ctl.open_session("b")
    res = run(ctl, reps, ["a", "b"], [0, 5])
    assert res.plans == () and res.num_tokens.tolist() == [10, 5]
    assert np.diff(res.block_offsets).tolist() == [3, 2]
    assert len(set(res.block_table.tolist())) == 5
    assert res.fresh_logical.tolist() == [0, 1, 2, 0, 1]
    assert res.fresh_session_idx.tolist() == [0, 0, 0, 1, 1]
    res = run(ctl, reps, ["a"], [2])  # 12 tokens: still 3 blocks
    assert len(res.fresh_block_ids) == 0 and res.session_slots(0).tolist() == [0, 1, 2]
    res = run(ctl, reps, ["a"], [1])
    assert res.fresh_logical.tolist() == [3] and len(res.session_slots(0)) == 4


def test_extend_and_handles(ctl, reps):
    h = ctl.open_session("a")
    ctl.extend_session("a", 9)
    res = run(ctl, reps, np.array([h], dtype=np.int64), [1])
    assert res.num_tokens.tolist() == [10] and len(res.fresh_block_ids) == 3
    ctl.close_session("a")
    with pytest.raises(UnknownSessionError, match="stale"):
        ctl.schedule(np.array([h], dtype=np.int64), [1])


def test_bad_session_ids(ctl):
    with pytest.raises(InvalidSessionIdError):
        ctl.open_session("has space")
    with pytest.raises(InvalidSessionIdError):
        ctl.open_session("x" * 257)
    ctl.open_session("a")
    with pytest.raises(DuplicateSessionError):
        ctl.open_session("a")


def test_rejected_calls_leave_table_unchanged(ctl, reps):
    for n in ("a", "b", "c"):
        ctl.open_session(n, 12)
    run(ctl, reps, ["a", "b"], [0, 0])
    before = state(ctl)
    with pytest.raises(UnknownSessionError, match="unknown session 'zz'"):
        ctl.schedule(["a", "zz"], [1, 1])
    with pytest.raises(DuplicateSessionError, match="'a' appears twice"):
        ctl.schedule(["a", "a"], [1, 1])
    with pytest.raises(BadRequestError, match="got -1"):
        ctl.schedule(["a", "b"], [1, -1])
    with pytest.raises(BadRequestError, match="needs 2 integers"):
        ctl.schedule(["a", "b"], [1])
    with pytest.raises(TierFullError, match="needs 19 L1 slots; L1 holds 16"):
        ctl.schedule(["a", "b", "c"], [0, 0, 40])
    with pytest.raises(UnknownSessionError):
        ctl.schedule(["a"], [1], upcoming={"nope": 1})
    with pytest.raises(BadRequestError):
        ctl.report_attention("a", [1.0] * 9)
    with pytest.raises(BadRequestError):
        ctl.report_attention("a", [float("nan")])
    assert state(ctl) == before
    ctl.close_session("c")
    before = state(ctl)
    with pytest.raises(SessionClosedError, match="'c' was closed at tick 1"):
        ctl.close_session("c")
    with pytest.raises(SessionClosedError):
        ctl.schedule(["c"], [1])
    assert state(ctl) == before


def test_pins_count_against_l1(ctl, reps):
    ctl.open_session("sys", 40)  # 10 blocks
    ctl.open_session("u", 0)
    run(ctl, reps, ["sys"], [0])
    assert ctl.pin("sys", 0, 10) == 10
    before = state(ctl)
    with pytest.raises(TierFullError, match="10 of L1's 16 hold pinned blocks"):
        ctl.schedule(["u"], [28])
    assert state(ctl) == before
    assert ctl.unpin("sys", 4) == 6
    run(ctl, reps, ["u"], [28])  # 7 blocks: the unpinned part of sys makes room


def test_epoch_order_and_commit_checks(make_config, fake_clock):
    c = Controller(make_config(l1=8, l2=16), fake_clock, check_invariants=True)
    reps = [SlotMapReplica(r, 8, 16) for r in range(2)]
    for n in "abc":
        c.open_session(n, 16)
    run(c, reps, ["a"], [0])
    run(c, reps, ["b"], [0])  # L1 full at 8: 'a' goes to L2
    res1 = c.schedule(["a"], [0])  # 'a' back, 'b' down: one plan
    res2 = c.schedule(["c"], [0])
    assert len(res1.plans) == 1 and len(res2.plans) >= 1
    r1 = [r.apply_step(res1) for r in reps]
    r2 = [r.apply_step(res2) for r in reps]
    before = state(c)
    with pytest.raises(PlanOrderError, match=f"epoch {res2.plans[0].epoch} confirmed out of order"):
        c.commit([x[0] for x in r2])
    with pytest.raises(BadRequestError, match=r"ranks \[0\], need one from each of 0..1"):
        c.commit([r1[0][0]])
    stray = MoveResult(r1[0][0].epoch, 0, 1, 0, miss_block_ids=np.array([123456789]))
    with pytest.raises(BadRequestError, match="not in the plan"):
        c.commit([stray, r1[1][0]])
    assert state(c) == before
    assert c.commit([x[0] for x in r1]).committed
    for i in range(len(res2.plans)):
        assert c.commit([x[i] for x in r2]).committed
    with pytest.raises(PlanOrderError, match="no plan awaits confirmation"):
        c.commit([x[0] for x in r2])


def test_register_rank(ctl):
    g = ctl.config.geometry
    assert ctl.register_rank(1, g)["l1_slots"] == 16
    with pytest.raises(BadRequestError):
        ctl.register_rank(2, g)
    with pytest.raises(ConfigError, match="differs"):
        ctl.register_rank(0, {**g.__dict__, "head_dim": 16})


def test_awaiting_rebuild_refuses_work(make_config, fake_clock):
    c = Controller(make_config(), fake_clock, restarts=1, awaiting_rebuild=True)
    with pytest.raises(ControllerRecoveringError, match="restart 1"):
        c.open_session("a")
    snap = c.snapshot()
    assert snap["restarts"] == 1 and snap["awaiting_rebuild"] is True


def test_wire_round_trips(ctl, reps):
    ctl.open_session("a", 20)
    res = ctl.schedule(["a"], [1])
    back = StepResult.from_dict(decode(encode(res.to_dict())))
    assert back.session_ids == ("a",) and back.block_table.tolist() == res.block_table.tolist()
    assert back.fresh_block_ids.tolist() == res.fresh_block_ids.tolist()
    out = CommitOutcome(3, False, (1,), 2, -5, True)
    assert CommitOutcome.from_dict(decode(encode(out.to_dict()))) == out
    mr = MoveResult(4, 1, 2, -7, miss_block_ids=np.array([9]))
    again = move_result_from_dict(decode(encode(move_result_to_dict(mr))))
    assert again.epoch == 4 and again.miss_block_ids.tolist() == [9]
    with pytest.raises(WireFormatError, match="unknown msgpack extension type 7"):
        decode(msgpack.packb({"x": msgpack.ExtType(7, b"\x00")}))
    with pytest.raises(WireFormatError):
        StepResult.from_dict({"tick": 1})


def test_snapshot_is_json(ctl, reps, fake_clock):
    ctl.open_session("a", 8)
    run(ctl, reps, ["a"], [1])
    ctl.report_attention("a", [0.5, 0.25, 0.25])
    snap = ctl.snapshot()
    json.dumps(snap)
    assert snap["tiers"]["L1"]["used"] == 3 and snap["tiers"]["L1"]["high_watermark"] == 0.9
    (s,) = snap["sessions"]
    assert s["session"] == "a" and s["tiers"]["L1"] == 3 and s["mean_attention"] == pytest.approx(
        1 / 3)
    assert snap["plan_latency_us"]["count"] == 1 and snap["epoch"]["next"] == 1
    blocks = ctl.session_blocks("a")
    assert blocks["access_count"] == [1, 1, 1] and blocks["tier"] == ["L1"] * 3
    json.dumps(blocks)


def test_access_history_folds_lazily(ctl, reps):
    ctl.open_session("a", 4)
    ctl.open_session("b", 4)
    run(ctl, reps, ["a"], [0])  # tick 1: block 0 created
    run(ctl, reps, ["b"], [0])  # tick 2
    run(ctl, reps, ["a"], [4])  # tick 3: block 1 created
    run(ctl, reps, ["a"], [1])  # tick 4
    blocks = ctl.session_blocks("a")
    assert blocks["last_tick"] == [4, 4, 4]
    assert blocks["lru_k_tick"] == [3, 3, -1]  # second-latest access (K=2)
    assert blocks["access_count"] == [3, 2, 1]


def test_tick_rebase_keeps_order(ctl, reps):
    ctl.open_session("a", 4)
    ctl.open_session("b", 4)
    run(ctl, reps, ["a"], [0])
    ctl.tick = (1 << 30) + 5
    run(ctl, reps, ["b"], [0])
    assert ctl.tick == (1 << 20) + 1
    hist = ctl.sessions.run_hist[0]
    assert hist[ctl.sessions.lookup("b")] > hist[ctl.sessions.lookup("a")]


def test_policy_knobs_checked(make_config, fake_clock):
    with pytest.raises(ConfigError, match="max_moves_per_step"):
        Controller(make_config(max_moves_per_step=0), fake_clock)


def test_handles_name_the_right_sessions_after_reuse(ctl, reps):
    ha, hb = ctl.open_session("a", 4), ctl.open_session("b", 4)
    assert run(ctl, reps, np.array([ha, hb]), [0, 0]).session_ids == ("a", "b")
    ctl.close_session("b")
    hc = ctl.open_session("c", 4)  # takes the index 'b' had, with a new handle
    assert hc != hb
    assert run(ctl, reps, np.array([ha, hc]), [1, 0]).session_ids == ("a", "c")


def test_a_detached_step_equals_its_wire_form_and_shares_no_array(make_config, fake_clock):
    """StepResult.detached (how a group of one takes a step from its in-process controller)
    gives what encode + decode would, with arrays the controller never touches again."""
    c = Controller(make_config(l1=8, l2=32), fake_clock)
    for n in "abc":
        c.open_session(n, 12)
        c.schedule([n], [0])
    res = c.schedule(["a"], [1])  # back from L2: plans, drops, fresh blocks
    assert res.plans
    own = res.detached()
    wire = StepResult.from_dict(decode(encode(res.to_dict())))
    assert encode(own.to_dict()) == encode(wire.to_dict())
    for name, value in own.__dict__.items():
        if isinstance(value, np.ndarray):
            assert not np.shares_memory(value, getattr(res, name)), name
    assert all(not np.shares_memory(a, b) for a, b in zip(own.drops, res.drops))
    assert own.plans == res.plans and all(not p.block_ids.flags.writeable for p in own.plans)
