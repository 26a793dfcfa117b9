"""Early promotions (PolicyConfig.early_min_bytes): a step's loads from L2 that fit L1's free
slots reach the ranks as the step's first plan before the rest of the step is planned."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.unit.test_controller_tiers import Rig
from tpkv.protocol.plan import MovePlan, Tier


class EarlyRig(Rig):
    """Rig whose steps hand their early plan to both replicas at once (as the runtime does)."""

    def __init__(self, config: Any, clock: Any, **kw: Any) -> None:
        super().__init__(config, clock, **kw)
        self.handed: list[MovePlan] = []

    def step(self, batch, tokens=None, upcoming=None, misses=None, commit=True, early=None):
        def hand(plan: MovePlan) -> None:
            self.handed.append(plan)
            for r in self.reps:
                r.apply_early(plan)
        return super().step(batch, tokens, upcoming, misses, commit, early=early or hand)

    def demote_a(self) -> None:
        """a, b, c, d of 4 blocks each in an L1 of 16 (high mark 14.4, low 12): d's step
        demotes a, the coldest, to L2; L1 keeps 4 free slots."""
        self.open("a", "b", "c", "d")
        for n in "abcd":
            self.step([n])
        assert self.where("a") == ["DRAM"] * 4 and self.c.table.num_free(Tier.HBM) == 4


@pytest.fixture
def rig(make_config, fake_clock):
    return EarlyRig(make_config(early_min_bytes=0), fake_clock)


def test_a_resume_hands_its_loads_into_free_l1_first(rig):
    rig.demote_a()
    free = set(np.flatnonzero(rig.c.table.owner[Tier.HBM] < 0).tolist())
    rig.handed.clear()
    res = rig.step(["a"])
    assert len(rig.handed) == 1
    plan = rig.handed[0]
    assert res.plans[0] is plan and plan.num_moves == 4  # the step's first plan, all of a
    assert (plan.src_tier == Tier.DRAM).all() and (plan.dst_tier == Tier.HBM).all()
    assert set(plan.session_names) == {"a"} and set(plan.dst_slot.tolist()) <= free
    # the rest of the step (the watermark's demotion of the next coldest) came after it
    assert sum(int(p.mask(Tier.HBM, Tier.DRAM).sum()) for p in res.plans[1:]) == 4
    assert rig.where("a") == ["HBM"] * 4 and rig.where("b") == ["DRAM"] * 4
    _no_write_into_early_sources(res)
    snap = rig.c.snapshot()
    assert snap["event_counts"]["early"] == 1
    assert [e for e in snap["events"] if e["kind"] == "early"][-1]["blocks"] == 4


def _no_write_into_early_sources(res: Any) -> None:
    """The step's later plans write no L2 slot its early plan reads (PlanBuilder.end_phase's
    hold_l2): the ranks need not wait for the early copies before those writes."""
    early = set(res.plans[0].src_slot.tolist())
    for p in res.plans[1:]:
        assert not early & set(p.dst_slot[p.dst_tier == Tier.DRAM].tolist())


@pytest.mark.parametrize("l2", [32, 9])
def test_later_plans_write_no_l2_slot_the_early_plan_reads(make_config, fake_clock, l2):
    """Also with an L2 so full that a promoted block's copy is given back at once (l2=9: the
    early plan's sources would be the only free slots for the demotions after it)."""
    rig = EarlyRig(make_config(l2=l2, l3=0, early_min_bytes=0), fake_clock, l2=l2)
    rig.open("a", "b", "c", "d", "e")
    for n in "abcde":
        rig.step([n])
    for n in "abcdeabcde":
        rig.handed.clear()
        res = rig.step([n])
        if rig.handed and len(res.plans) > 1:
            _no_write_into_early_sources(res)


def test_only_what_fits_the_free_slots_goes_early(make_config, fake_clock):
    rig = EarlyRig(make_config(early_min_bytes=0), fake_clock)
    rig.open("a", tokens=24)  # 6 blocks
    rig.open("b", "c")
    for n in "abc":
        rig.step([n])
    rig.open("d", tokens=8)
    rig.step(["d"])  # 16 blocks > 14.4: a (the coldest, 6 blocks) goes to L2
    assert rig.where("a") == ["DRAM"] * 6
    rig.step(["b"], [4])  # b grows by a block: 5 of L1's slots stay free
    free = rig.c.table.num_free(Tier.HBM)
    assert free == 5
    rig.handed.clear()
    res = rig.step(["a"])
    assert [p.num_moves for p in rig.handed] == [free]
    # the other loads of a follow in the step's later plan, into slots its demotions empty
    later = sum(int(p.mask(Tier.DRAM, Tier.HBM).sum()) for p in res.plans[1:])
    assert later == 6 - free and rig.where("a") == ["HBM"] * 6
    _no_write_into_early_sources(res)


def test_no_early_plan_after_blocks_were_released(rig):
    """Blocks released since the last step (a closed session) are applied before the step's
    first plan (their slots may be its destinations): no plan goes early then."""
    rig.demote_a()
    rig.c.close_session("c")
    rig.handed.clear()
    res = rig.step(["a"])
    assert not rig.handed and res.plans and rig.where("a") == ["HBM"] * 4


def test_no_early_plan_below_early_min_bytes(make_config, fake_clock):
    cfg = make_config()
    rig = EarlyRig(make_config(early_min_bytes=5 * cfg.geometry.block_bytes), fake_clock)
    rig.demote_a()
    res = rig.step(["a"])  # 4 blocks would fit
    assert not rig.handed and rig.where("a") == ["HBM"] * 4
    assert res.plans[0].mask(Tier.DRAM, Tier.HBM).sum() == 4


def test_an_early_plan_stays_pending_when_the_step_fails(rig, monkeypatch):
    """Handed out means pending: the ranks applied it, so the controller keeps it (and its
    epoch) even if the rest of the step raises; its table is then half-changed, so it plans
    nothing more until it is rebuilt from the ranks' maps."""
    from tpkv.controller import step as step_mod
    from tpkv.errors import ControllerRecoveringError

    rig.demote_a()
    epoch = rig.c.next_epoch

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("planner bug")
    monkeypatch.setattr(step_mod, "_plan", broken)
    with pytest.raises(RuntimeError):
        rig.c.schedule(["a"], [0], early=rig.handed.append)
    assert [p.epoch for p in rig.handed] == [epoch]
    assert rig.c.next_epoch == epoch + 1 and rig.c.pending[-1].plan is rig.handed[0]
    with pytest.raises(ControllerRecoveringError, match="half-changed by RuntimeError"):
        rig.c.schedule(["a"], [0])
    assert rig.c.snapshot()["event_counts"]["broken"] == 1
    rep = rig.reps[0]  # (both hold the early plan's moves)
    rig.c.rebuild([rep.export() | {"rank": r} for r in range(2)], rep.manifests())
    for r in rig.reps:
        r.restore(rig.c.slot_map())
    monkeypatch.undo()
    res = rig.step(["a"])
    assert rig.where("a") == ["HBM"] * 4 and res.tick > 0


def _runtime(**policy: Any) -> Any:
    import tpkv
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=24, l2_blocks=64,
                        policy=PolicyConfig(cooldown_s=0.0, **policy))
    return tpkv.init(cfg, controller="local", device="cpu"), model


def _turns(rt: Any, model: Any, fail_at: int = -1) -> tuple[list[Any], Any]:
    """Four sessions, two at a time in a 24-block L1, three turns each: sessions go to L2 and
    come back. `fail_at`: the planner raises (once) in the step after the fail_at-th early
    plan was handed out, which the engine then runs again."""
    from tpkv.controller import step as step_mod
    from tpkv.models.tiered import TieredEngine

    real_plan, real_early = step_mod._plan, rt.worker.apply_early
    real_schedule = rt.controller.schedule
    handed: list[int] = []
    failed: list[int] = []
    now: list[int] = []  # the plan handed out in the schedule() running

    def schedule(*a: Any, **k: Any) -> Any:
        now.clear()
        return real_schedule(*a, **k)

    def apply_early(plan: MovePlan) -> None:
        handed.append(plan.epoch)
        now.append(plan.epoch)
        real_early(plan)

    def plan(*a: Any, **k: Any) -> Any:
        if now and len(handed) == fail_at + 1 and not failed:
            failed.append(now[0])
            raise RuntimeError("planner bug")
        return real_plan(*a, **k)
    rt.controller.schedule, rt.worker.apply_early = schedule, apply_early
    step_mod._plan = plan
    done = []
    try:
        e = TieredEngine(rt, model, report_prefill=False, max_batch=2).engine
        for _turn in range(3):
            for s in range(4):
                e.add_turn(f"s{s}", list(range(10 * s, 10 * s + 20)), 2)
                while e.has_work:
                    try:
                        done += [(f.session, f.token_ids) for f in e.step()]
                    except RuntimeError:
                        assert failed  # the step failed before its forward: run it again
    finally:
        step_mod._plan = real_plan
    return done, (handed, failed)


def test_the_engine_gives_the_same_tokens_with_early_plans() -> None:
    """Same tokens with early plans as with none (the default early_min_bytes, which the tiny
    model's loads never reach), and the ranks' map is the controller's."""
    outs = []
    for policy in (dict(), dict(early_min_bytes=0)):
        rt, model = _runtime(**policy)
        try:
            done, (handed, _) = _turns(rt, model)
            outs.append((done, handed))
            rt.end_step()
            assert rt.worker.slot_map()["digest"] == rt.controller.slot_map()["digest"]
        finally:
            rt.close()
    (off, none), (on, handed) = outs
    assert not none and len(handed) > 2 and on == off


def test_a_step_that_fails_after_its_early_plan_rebuilds_the_controller() -> None:
    """The planner fails after the step's early plan was applied: the step is not run, the
    controller (its table half-changed) is rebuilt from the rank's map, which holds the early
    plan's moves, and the engine's tokens are those of a run without failure."""
    rt, model = _runtime(early_min_bytes=0)
    try:
        done, (handed, failed) = _turns(rt, model, fail_at=1)
        assert failed == [handed[1]]
        assert rt.num_rebuilds == 1 and not rt.worker.early
        rt.end_step()
        assert rt.worker.slot_map()["digest"] == rt.controller.slot_map()["digest"]
    finally:
        rt.close()
    rt, model = _runtime()  # (no early plan: the default early_min_bytes)
    try:
        assert _turns(rt, model)[0] == done
    finally:
        rt.close()


def test_a_step_of_an_early_plan_alone_still_commits_done_spills(tmp_path) -> None:
    """An early plan commits no spill manifest (their fsyncs would hold the rest of its step
    back); when its step has no other plan, apply_step commits them once the step's copies are
    issued, not a later decode step."""
    from tests.multiproc.harness import make_config
    from tpkv.protocol.messages import StepResult
    from tpkv.workers.worker import Worker

    w = Worker(make_config(1, str(tmp_path / "l3")), rank=0, device="cpu")
    H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)

    def plan(epoch: int, block: int, src: int, src_slot: int, dst: int, dst_slot: int
             ) -> MovePlan:
        return MovePlan(epoch, np.array([block]), np.array([src]), np.array([src_slot]),
                        np.array([dst]), np.array([dst_slot]), np.zeros(1), np.array([block]),
                        ("s",))
    try:
        w.mirror.put(np.array([7, 8]), np.array([H, D]), np.array([0, 1]), ["s", "s"],
                     np.array([7, 8]))
        w.apply_plan(plan(1, 7, H, 0, D, 0))
        w.apply_plan(plan(2, 7, D, 0, S, -1))  # a spill, in the background
        w.executor.spills[0].future.result(10)
        commits: list[str] = []
        real = w.store.commit_manifest
        w.store.commit_manifest = lambda name: commits.append(name) or real(name)
        early = plan(3, 8, D, 1, H, 1)
        w.apply_early(early)
        assert commits == [] and len(w.executor.spills) == 1
        empty = np.zeros(0, dtype=np.int64)
        w.apply_step(StepResult(tick=1, session_ids=(), num_tokens=empty,
                                block_offsets=np.zeros(1, dtype=np.int64),
                                block_table=np.zeros(0, dtype=np.int32), plans=(early,),
                                drops=(empty, empty)))
        assert commits == ["s"] and not w.executor.spills
        assert [a.plan.epoch for a in w.last_applied] == [3]
    finally:
        w.close()
