"""The controller lost mid-run at TP 2, in process and as the Ray actor: every rank sends
its slot map for the rebuild, and the tokens equal a large L1's on both ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive, reference
from tests.transport import TRANSPORTS

KILL_AT = (30,)  # engine steps of about 50: mid-turn, with sessions on L2 and L3 (two
# restarts in a row: tests/ray/test_controller_kill_engine.py, TP 1)


def restart_rank(rank: int, world: int, ssd_root: str, controller: str) -> dict[str, Any]:
    """One rank of the tiered engine's workload (tests/multiproc/test_engine_tiered.py); rank 0
    restarts the controller before the engine steps KILL_AT (tests.transport.restart: a fresh
    in-process Controller, or the actor killed and restarted by Ray)."""
    import tpkv
    from tests.transport import restart
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config
    from tpkv.models.tp import apply_tp

    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, world, block_tokens=BT, l1_blocks=L1_BLOCKS,
                        l2_blocks=L2_BLOCKS, ssd_root=ssd_root,
                        policy=PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller=controller, device="cpu")
    try:
        model = apply_tp(model, rank, world)
        want = reference(model)
        tiered = TieredEngine(rt, model, report_prefill=False)
        engine = tiered.engine
        schedule, calls = engine.schedule, [0]

        def schedule_with_restarts(session_ids: Any, num_new_tokens: Any) -> Any:
            calls[0] += 1
            if rank == 0 and calls[0] in KILL_AT:
                restart(rt, KILL_AT.index(calls[0]) + 1)
            return schedule(session_ids, num_new_tokens)

        engine.schedule = schedule_with_restarts  # type: ignore[method-assign]
        got = drive(engine)
        snap = rt.controller.snapshot() if rank == 0 else {}
        out = {"got": got, "want": want, "rebuilds": rt.num_rebuilds, "steps": calls[0],
               "mismatches": rt.num_mismatches, "moves": dict(tiered.stats.moves),
               "from_manifests": snap.get("recovery", {}).get("from_manifests")}
    except BaseException as exc:
        rt.close(exc)
        raise
    rt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("controller", TRANSPORTS)
def test_tp2_tokens_after_a_controller_restart_equal_a_run_without_fault(tmp_path, controller):
    results = run_ranks(restart_rank, 2, str(tmp_path / "l3"), controller, timeout_s=100)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        out = results[r]
        assert out["ok"], out.get("trace")
        assert out["steps"] > max(KILL_AT) and out["rebuilds"] == len(KILL_AT), out["rebuilds"]
        assert out["got"] == out["want"]
        assert out["moves"]["l2_l3"] > 0 and out["moves"]["l3_l2"] > 0, out["moves"]
    assert results[0]["from_manifests"] > 0  # the rebuild found sessions in L3
    assert results[0]["got"] == results[1]["got"]
    assert results[0]["moves"] == results[1]["moves"]
