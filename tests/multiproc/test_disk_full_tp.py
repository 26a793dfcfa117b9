"""A full disk on ONE rank of a TP group of two (gloo, CPU, the tiny Llama on tiny tiers): its
failed spills and manifest writes make every rank forget those sessions' L3 records within the
step, and serving goes on (recompute, no RankTimeoutError) with the tokens of a large L1."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive, reference
from tpkv.config import PolicyConfig
from tpkv.errors import SsdIoError
from tpkv.models.llama import build_model
from tpkv.models.tp import apply_tp

WAIT_TIMEOUT_S = 3.0  # small, so that a rank waiting for a manifest fails the test fast


def _full_disk(store: Any, every: int, kind: str) -> dict[str, int]:
    """Make every `every`-th spill write (kind "write") or manifest write ("manifest") of this
    rank's store fail as a full disk does (SsdIoError, ENOSPC, nothing written); counts them."""
    counts = {"calls": 0, "injected": 0}
    name = "write_blocks" if kind == "write" else "commit_manifest"
    real = getattr(store, name)

    def faulty(session_id: str, *args: Any) -> Any:
        counts["calls"] += 1
        if counts["calls"] % every == 0:
            counts["injected"] += 1
            raise SsdIoError(f"L3 rank {store.rank}: {name} of session {session_id}: "
                             "No space left on device (injected)", errno.ENOSPC)
        return real(session_id, *args)

    setattr(store, name, faulty)  # submit_write / submit_commit look the method up per call
    return counts


def enospc_rank(rank: int, world: int, ssd_root: str, victim: int, every: int,
                kind: str) -> dict[str, Any]:
    """One rank: the reference run (large L1), then the tiered run on tiers that need L3,
    where rank `victim`'s store fails every `every`-th write of `kind`."""
    import tpkv
    from tpkv.models.tiered import TieredEngine, tiered_config

    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device="cpu")
    policy = PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0)  # loads beat recompute
    cfg = tiered_config(model, world, block_tokens=BT, l1_blocks=L1_BLOCKS,
                        l2_blocks=L2_BLOCKS, ssd_root=ssd_root, policy=policy,
                        wait_timeout_s=WAIT_TIMEOUT_S)
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        model = apply_tp(model, rank, world)
        want = reference(model)
        counts = ({"calls": 0, "injected": 0} if rank != victim
                  else _full_disk(rt.worker.store, every, kind))
        tiered = TieredEngine(rt, model, report_prefill=False)
        got = drive(tiered.engine)
        rt.worker.executor.synchronize()
        ex = rt.worker.executor
        ledger = getattr(ex.spills, "ledger", None)  # (none before the fix)
        out = {"got": got, "want": want, "injected": counts["injected"],
               "failed_spills": ex.spills.num_failed_spills,
               "forgotten": getattr(ledger, "num_forgotten_elsewhere", 0),
               "agreements": getattr(ledger, "num_agreements", 0),
               "retries": tiered.stats.retries, "moves": dict(tiered.stats.moves),
               "recompute_tokens": tiered.stats.recompute_tokens,
               "mismatches": rt.num_mismatches, "commit_refusals": rt.num_commit_refusals}
        if rank == 0:
            rt.controller.check_integrity()
    except BaseException as exc:
        rt.close(exc)
        raise
    rt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,every,kind", [(1, 3, "write"), (0, 2, "write"),
                                               (1, 2, "manifest")])
def test_a_full_disk_on_one_rank_is_forgotten_by_every_rank_and_serving_goes_on(
        tmp_path, victim, every, kind):
    results = run_ranks(enospc_rank, 2, str(tmp_path / "l3"), victim, every, kind,
                        timeout_s=110)
    assert sorted(results) == [0, 1], results
    failed = {r: (out["error"], out["message"], out["trace"]) for r, out in results.items()
              if not out["ok"]}
    assert not failed, failed
    bad, good = results[victim], results[1 - victim]
    assert bad["injected"] > 0, bad  # the disk did fill up on that rank
    assert bad["failed_spills"] > 0 and good["failed_spills"] == 0, (bad, good)
    # the other rank forgot those sessions too, on the victim's word through the all-gather
    assert good["forgotten"] > 0, good
    for r in (0, 1):
        out = results[r]
        assert out["got"] == out["want"], f"rank {r}: tokens differ from the large-L1 run"
        assert out["moves"]["l2_l3"] > 0 and out["moves"]["l3_l2"] > 0, out["moves"]
        assert out["mismatches"] == 0 and out["commit_refusals"] == 0, out
    assert results[0]["got"] == results[1]["got"]
    assert results[0]["moves"] == results[1]["moves"]
    print(f"\nTP 2, rank {victim} full ({kind} every {every}): injected {bad['injected']}, "
          f"failed spills {bad['failed_spills']}, forgotten on rank {1 - victim} "
          f"{good['forgotten']}, retries {bad['retries']}, recomputed tokens "
          f"{bad['recompute_tokens']}, wrong tokens 0")
