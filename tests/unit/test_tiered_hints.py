"""TieredEngine's step hints and the runtime's answers in a TP group of one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _open(l1_blocks: int = 24, l2_blocks: int = 64, ssd_root: str | None = None,
          **policy: Any) -> Any:
    import tpkv
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=l1_blocks, l2_blocks=l2_blocks,
                        ssd_root=ssd_root,
                        policy=PolicyConfig(cooldown_s=0.0, **policy))
    return tpkv.init(cfg, controller="local", device="cpu"), model


@pytest.fixture()
def runtime() -> Any:
    rt, model = _open()
    yield rt, model
    rt.close()


@pytest.fixture()
def runtime_big_l1() -> Any:
    """An L1 that holds every session of _resume_workload: nothing is demoted or resumed."""
    rt, model = _open(l1_blocks=256)
    yield rt, model
    rt.close()


def _spy(rt: Any) -> list[tuple[list[str], Any]]:
    seen: list[tuple[list[str], Any]] = []
    real = rt.run_step

    def run_step(session_ids: Any, tokens: Any, fn: Any, upcoming: Any = None,
                 **kw: Any) -> Any:
        seen.append((list(session_ids), upcoming))
        return real(session_ids, tokens, fn, upcoming, **kw)
    rt.run_step = run_step
    return seen


@pytest.mark.parametrize("hint", [True, False])
def test_a_prefill_names_the_turns_decoding_beside_it_as_upcoming(runtime: Any,
                                                                   hint: bool) -> None:
    """While s0 decodes, s1's prefill step tells the controller s0 runs next (so watermark
    demotions leave it in L1); decode steps of the whole batch name nobody."""
    from tpkv.models.tiered import TieredEngine

    rt, model = runtime
    tiered = TieredEngine(rt, model, report_prefill=False, hint_running=hint, max_batch=2)
    seen = _spy(rt)
    e = tiered.engine
    e.add_turn("s0", list(range(9)), 3)
    e.step()  # s0's prefill: nothing else runs
    e.add_turn("s1", list(range(20, 27)), 3)
    e.step()  # s1's prefill while s0 decodes
    e.step()  # both decode
    assert [s for s, _ in seen] == [["s0"], ["s1"], ["s0", "s1"]]
    assert [u for _, u in seen] == ([None, ["s0"], None] if hint else [None, None, None])


def test_a_group_of_one_gets_a_copy_of_the_controllers_answer(runtime: Any) -> None:
    """No wire in a TP group of one, but nothing the caller holds changes when the controller
    reuses its arrays, and nested containers come back whole."""
    rt, _ = runtime
    buf = np.arange(6)
    got = rt.from_rank0(lambda: {"a": buf, "plans": ({"ids": buf[2:]},), "n": 3}, "test")
    buf[:] = -1
    assert got["a"].tolist() == [0, 1, 2, 3, 4, 5]
    assert got["plans"][0]["ids"].tolist() == [2, 3, 4, 5] and got["n"] == 3
    with pytest.raises(ValueError, match="boom"):
        rt.from_rank0(lambda: (_ for _ in ()).throw(ValueError("boom")), "test")


def test_the_next_schedule_is_sent_while_the_forward_runs(runtime: Any) -> None:
    """TieredEngine's `launched` hook sends the schedule of the batch the engine expects next
    (PagedEngine.predict_next); the next step takes that answer instead of calling the
    controller. After every schedule the controller prepares the next step's eviction orders
    (Controller.prepare) on the link's thread, once."""
    from tpkv.models.tiered import TieredEngine

    rt, model = runtime
    calls: list[str] = []
    ctl = rt.controller
    real_prepare, real_schedule = ctl.prepare, ctl.schedule

    def prepare() -> None:
        calls.append("prepare")
        real_prepare()

    def schedule(*args: Any, **kw: Any) -> Any:
        calls.append("schedule")
        return real_schedule(*args, **kw)
    ctl.prepare, ctl.schedule = prepare, schedule
    used = rt.num_ahead_used
    tiered = TieredEngine(rt, model, report_prefill=False, max_batch=2)
    e = tiered.engine
    e.add_turn("s0", list(range(9)), 3)
    for _ in range(3):
        e.step()
    rt.link.send("slot_map").result()  # after every call sent before it
    assert calls == ["schedule", "prepare"] * 3
    assert rt.num_ahead_used - used == 2  # both decode steps were planned ahead

def test_each_plan_is_told_the_l1_slots_the_rest_of_its_step_fills(tmp_path: Any) -> None:
    """Worker.apply_step gives each plan the L1 slots that later plans of the step promote into
    and the step's new K/V slots (PlanExecutor.run then lets demotions nobody later in the step
    waits for follow the plan's promotions). Sessions are pushed out of a 24-block L1 and an
    8-block L2 and resumed from L3 (a load into L2, then a promotion), so some steps carry
    more than one plan."""
    from tpkv.models.tiered import TieredEngine
    from tpkv.protocol.plan import Tier

    rt, model = _open(l2_blocks=8, ssd_root=str(tmp_path))
    try:
        ex, worker = rt.worker.executor, rt.worker
        calls: list[tuple[Any, Any]] = []
        real_run, real_apply = ex.run, worker.apply_step
        steps: list[Any] = []

        def run(plan: Any, ok: Any, later_l1: Any = None, chain: Any = None) -> Any:
            calls.append((plan, later_l1))
            return real_run(plan, ok, later_l1, chain=chain)

        def apply_step(step: Any, late_ok: bool = False) -> Any:
            steps.append((step, len(calls)))
            return real_apply(step, late_ok)
        ex.run, worker.apply_step = run, apply_step
        tiered = TieredEngine(rt, model, report_prefill=False, max_batch=2)
        e = tiered.engine
        for _turn in range(3):
            for s in range(4):
                e.add_turn(f"s{s}", list(range(10 * s, 10 * s + 20)), 2)
                while e.has_work:
                    e.step()
        multi = 0
        for step, first in steps:
            plans = calls[first:first + len(step.plans)]
            assert [p for p, _ in plans] == list(step.plans)
            for i, (_, later) in enumerate(plans):
                want = set(np.asarray(step.fresh_slots).tolist())
                for p in step.plans[i + 1:]:
                    want |= set(p.dst_slot[p.mask(Tier.DRAM, Tier.HBM)].tolist())
                assert set(np.asarray(later).tolist()) == want
            multi += len(step.plans) > 1 and any(
                p.mask(Tier.DRAM, Tier.HBM).any() for p in step.plans[1:])
        assert multi > 0  # some step promoted in a later plan
        assert tiered.stats.resume_s["l3"]  # and sessions did come back from L3
    finally:
        rt.close()


def _resume_workload(rt: Any, model: Any) -> tuple[list[tuple[str, tuple[int, ...]]], int, int]:
    """Sessions pushed out of a 24-block L1 and resumed: (every finished turn, steps whose
    promotions span more than one plan, promotions in all)."""
    from tpkv.models.tiered import TieredEngine
    from tpkv.protocol.plan import Tier

    split = promoted = 0
    real = rt.worker.apply_step

    def apply_step(step: Any, late_ok: bool = False) -> Any:
        nonlocal split, promoted
        ups = [int(p.mask(Tier.DRAM, Tier.HBM).sum()) for p in step.plans]
        split += sum(n > 0 for n in ups) > 1
        promoted += sum(ups)
        return real(step, late_ok)
    rt.worker.apply_step = apply_step
    e = TieredEngine(rt, model, report_prefill=False, max_batch=2).engine
    done = []
    for _turn in range(3):
        for s in range(4):
            e.add_turn(f"s{s}", list(range(10 * s, 10 * s + 20)), 2)
            while e.has_work:
                done += [(f.session, f.token_ids) for f in e.step()]
    return done, split, promoted


def test_a_resume_into_a_full_l1_is_one_plan_with_the_same_outputs(
        runtime: Any, runtime_big_l1: Any) -> None:
    """The promotions of a resume fill the L1 slots the same plan's demotions empty, so no
    step spreads its promotions over two plans; the model's tokens are those of a run whose
    L1 holds every session (no demotion, no resume)."""
    one, split_one, up_one = _resume_workload(*runtime)
    big, _, up_big = _resume_workload(*runtime_big_l1)
    assert split_one == 0 and up_one > 0  # the workload does resume into a full L1
    assert up_big == 0
    assert one == big


def test_the_engine_feeds_returns_the_l2_room_new_sessions_and_decode_work(tmp_path: Any
                                                                          ) -> None:
    """TieredEngine hands Returns the last step's l2_room (paced spills to L3: a room, not
    -1), a new session's prompt tokens (none once it holds K/V), the decode tokens left to
    the turns in the batch and queued for it, and the measured seconds a decoded token
    takes."""
    from tpkv.models.tiered import TieredEngine

    rt, model = _open(l2_blocks=8, ssd_root=str(tmp_path))
    try:
        tiered = TieredEngine(rt, model, report_prefill=False, max_batch=2)
        e, r = tiered.engine, tiered.returns
        rooms: list[int] = []
        real = tiered.schedule

        def schedule(ids: Any, new: Any) -> Any:
            step = real(ids, new)
            rooms.append(step.l2_room)
            assert r.l2_room == step.l2_room
            return step
        e.schedule = schedule
        e.add_turn("s0", list(range(20)), 3)
        assert r.new_session_tokens("s0") == 20
        e.admit_pending()
        assert r.decode_ahead() == 3  # s0 queued for the batch: 3 tokens to make
        e.step()  # its prefill makes the first
        assert r.new_session_tokens("s0") == 0 and r.decode_ahead() == 2
        while e.has_work:
            e.step()
        assert r.decode_token_s > 0
        assert rooms and min(rooms) >= 0, rooms
    finally:
        rt.close()
