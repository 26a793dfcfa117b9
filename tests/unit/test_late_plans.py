"""Steps whose plans only demote other sessions' blocks are applied after their forward is
launched (Worker.apply_step's late_ok) and confirmed at the next step. The tokens are those of
a large L1 where nothing moves, and a late plan the ranks disagree on is repaired by a
resync."""

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


def _run(root: str, skip: bool = False, controller: str = "local") -> dict[str, Any]:
    """The tiered engine test's workload and tiers (L1 of 32 blocks, L2 of 16, L3), returns
    always loaded; a check of every step's application and of the maps at the end. `skip`:
    the first late plan's first move is skipped on the rank (a bug). `controller`: as tpkv.init
    takes it."""
    import tpkv
    from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=L1_BLOCKS, l2_blocks=L2_BLOCKS,
                        ssd_root=root, policy=PolicyConfig(cooldown_s=0.0,
                                                           prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller=controller, device="cpu")
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        worker = rt.worker
        seen: list[bool] = []
        spills: list[int] = []  # L2 -> L3 moves of each late step
        real_apply, real_late = worker.apply_step, worker.apply_late

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
            bug = skip and step is not None and sum(seen) == 1
            if bug:
                worker.fault_skip[step.plans[0].epoch] = 0  # a rank's bug, once
            real_late()
            if step is not None and not bug:
                applied_as_planned(step)

        worker.apply_step, worker.apply_late = apply_step, apply_late
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
                "ahead": rt.num_ahead_used}
    finally:
        rt.close()


def test_late_plans_give_the_tokens_of_a_large_l1(tmp_path, transport) -> None:
    late = _run(str(tmp_path / "b"), controller=transport)
    assert late["late"] > 0 and late["ahead"] > 0
    assert late["moves"]["l1_l2"] > 0 and late["moves"]["l2_l1"] > 0
    assert late["late_spills"] > 0 and late["moves"]["l3_l2"] > 0  # spills waited too
    assert late["tokens"] == _whole()
    assert late["mismatches"] == 0


def test_a_late_plan_the_rank_got_wrong_is_resynced_and_the_tokens_stay(tmp_path,
                                                                        transport) -> None:
    bad = _run(str(tmp_path / "b"), skip=True, controller=transport)
    assert bad["late"] > 0 and bad["mismatches"] == 1
    assert bad["tokens"] == _whole()
