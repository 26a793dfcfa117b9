"""Steps whose plans only demote other sessions' blocks are applied after their forward is
launched (Worker.apply_step's late_ok), and steps that would plan only for the L1 watermark
have the controller plan those demotions then (defer_marks, Controller.plan_deferred); both are
confirmed at the next step. The tokens are those of a large L1 where nothing moves, and a late
or deferred plan the ranks disagree on is repaired by a resync."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tpkv.protocol.plan import Tier  # noqa: E402


def _whole() -> Any:
    """The tokens of the workload below with an L1 that holds everything (nothing moves)."""
    from tests.multiproc.test_engine_tiered import reference
    from tpkv.models.llama import build_model

    return reference(build_model("tiny", seed=0, device="cpu"))


def _run(root: str, skip: str | None = None, defer: bool = True) -> dict[str, Any]:
    """The tiered engine test's workload and tiers (L1 of 32 blocks, L2 of 16, L3), returns
    always loaded; a check of every step's application and of the maps at the end. `skip`:
    "late" or "deferred": the first such plan's first move is skipped on the rank (a bug).
    `defer=False`: the engine's steps run without defer_marks, as with a Ray controller (no
    plan_deferred), so the watermark demotions come with the step and are applied late."""
    import tpkv
    from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=L1_BLOCKS, l2_blocks=L2_BLOCKS,
                        ssd_root=root, policy=PolicyConfig(cooldown_s=0.0,
                                                           prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        if not defer:
            real_run_step = rt.run_step

            def run_step(*args: Any, **kw: Any) -> Any:
                return real_run_step(*args, **{**kw, "defer_marks": False})
            rt.run_step = run_step
        worker = rt.worker
        seen: list[bool] = []
        spills: list[int] = []  # L2 -> L3 moves of each late step
        deferred: list[int] = []  # moves of each deferred step
        real_apply, real_late = worker.apply_step, worker.apply_late
        real_deferred = worker.apply_deferred

        def apply_step(step: Any, late_ok: bool = False) -> Any:
            applied = real_apply(step, late_ok)
            seen.append(applied.late)
            if applied.late:  # nothing of the plans is applied yet
                assert applied.waiting and not applied.plans and worker.last_applied == []
                assert all((p.mask(Tier.HBM, Tier.DRAM) | p.mask(Tier.DRAM, Tier.SSD)).all()
                           for p in step.plans)
                spills.append(sum(int(p.mask(Tier.DRAM, Tier.SSD).sum()) for p in step.plans))
            return applied

        def applied_as_planned(step: Any) -> None:
            for plan in step.plans:
                tier, slot = worker.mirror.where(plan.block_ids)
                np.testing.assert_array_equal(tier, plan.dst_tier)
                np.testing.assert_array_equal(slot, plan.dst_slot)

        def apply_late() -> None:
            step = None if worker.late is None else worker.late.step
            bug = skip == "late" and step is not None and sum(seen) == 1
            if bug:
                worker.fault_skip[step.plans[0].epoch] = 0  # a rank's bug, once
            real_late()
            if step is not None and not bug:
                applied_as_planned(step)

        def apply_deferred(step: Any) -> Any:
            assert not step.session_ids and not len(step.fresh_block_ids)  # plans only
            assert all((p.mask(Tier.HBM, Tier.DRAM) | p.mask(Tier.DRAM, Tier.SSD)).all()
                       for p in step.plans)  # only down
            bug = skip == "deferred" and not deferred
            if bug:
                worker.fault_skip[step.plans[0].epoch] = 0
            deferred.append(step.num_moves)
            out = real_deferred(step)
            if not bug:
                applied_as_planned(step)
            return out
        worker.apply_step, worker.apply_late = apply_step, apply_late
        worker.apply_deferred = apply_deferred
        maps: list[tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]] = []
        real_close = tiered.engine.close_session

        def close_session(name: str) -> None:  # before the first close: both maps whole
            if not maps:
                m, mine = rt.controller_slot_map(), worker.slot_map()
                maps.append(tuple(  # type: ignore[arg-type]
                    dict(zip(np.asarray(x["block_ids"]).tolist(),
                             zip(np.asarray(x["tiers"]).tolist(),
                                 np.asarray(x["slots"]).tolist()))) for x in (m, mine)))
            real_close(name)
        tiered.engine.close_session = close_session  # type: ignore[method-assign]
        tokens = drive(tiered.engine)
        theirs, here = maps[0]
        assert len(theirs) > 0 and here == theirs
        return {"tokens": tokens, "late": sum(seen), "mismatches": rt.num_mismatches,
                "moves": dict(tiered.stats.moves), "late_spills": sum(spills),
                "deferred": len(deferred), "deferred_moves": sum(deferred)}
    finally:
        rt.close()


def test_late_plans_give_the_tokens_of_a_large_l1(tmp_path) -> None:
    late = _run(str(tmp_path / "b"), defer=False)
    assert late["late"] > 0 and late["deferred"] == 0
    assert late["moves"]["l1_l2"] > 0 and late["moves"]["l2_l1"] > 0
    assert late["late_spills"] > 0 and late["moves"]["l3_l2"] > 0  # spills waited too
    assert late["tokens"] == _whole()
    assert late["mismatches"] == 0


def test_deferred_watermark_plans_give_the_tokens_of_a_large_l1(tmp_path) -> None:
    both = _run(str(tmp_path / "b"))
    assert both["deferred"] > 0 and both["deferred_moves"] > 0
    assert both["tokens"] == _whole() and both["mismatches"] == 0


@pytest.mark.parametrize("kind", ["late", "deferred"])
def test_a_late_plan_the_rank_got_wrong_is_resynced_and_the_tokens_stay(tmp_path, kind) -> None:
    bad = _run(str(tmp_path / "b"), skip=kind, defer=kind == "deferred")
    assert bad[kind] > 0 and bad["mismatches"] == 1
    assert bad["tokens"] == _whole()


def test_deferred_plans_wait_for_the_steps_own_moves_to_be_confirmed(tmp_path) -> None:
    """run_step whose fn is the forward (it calls apply_late before run_step's end_step): a
    step that loads keeps its watermarks' moves for a later step instead of applying them
    beside its own unconfirmed ones; steps without moves of their own apply them in fn."""
    import tpkv
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=16, l2_blocks=64)
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        got: list[Any] = []

        def forward(step: Any) -> Any:
            got.append(rt.apply_late())
            return step

        def run(name: str, tokens: int) -> Any:
            return rt.run_step([name], [tokens], forward, late_ok=True, defer_marks=True)

        for name in "abcd":  # 4 blocks each: L1 of 16 goes past its high mark (14.4) at 'd'
            rt.open_session(name)
            run(name, 16)
        down = got[-1]  # 'd' loads nothing: the demotion of 'a' (the coldest) came in fn
        assert down is not None and not down.session_ids
        assert set(down.plans[0].session_names) == {"a"}
        assert down.num_moves == 4 and all(p.mask(Tier.HBM, Tier.DRAM).all() for p in down.plans)
        step = run("a", 0)  # loads 'a' back: L1 full again, but its own moves come first
        assert step.num_moves == 4 and got[-1] is None
        run("b", 0)  # no load: the watermark's demotion now (the coldest session not running)
        assert got[-1] is not None and got[-1].num_moves == 4
        rt.end_step()
        m, mine = rt.controller_slot_map(), rt.worker.slot_map()
        assert np.array_equal(np.asarray(m["tiers"]), np.asarray(mine["tiers"]))
        assert np.array_equal(np.asarray(m["slots"]), np.asarray(mine["slots"]))
    finally:
        rt.close()
