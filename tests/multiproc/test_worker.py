"""One worker on its own (TP 1, CPU): plan order, refused moves, layer copies, misses, resync."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multiproc.harness import make_config, pattern
from tpkv.errors import PlanOrderError, RankMismatchError, RankTimeoutError
from tpkv.protocol.digest import plan_digest
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.confirm import STATUS_DIVERGED, STATUS_MISSES
from tpkv.workers.worker import Worker

H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
pytestmark = pytest.mark.timeout(60)


def plan(epoch: int, moves: list[tuple[int, int, int, int, int]], logical: list[int] | None = None
         ) -> MovePlan:
    """moves: (block, src tier, src slot, dst tier, dst slot), all of session "s"."""
    b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
    n = len(moves)
    return MovePlan(epoch, b, st, ss, dt, ds, np.zeros(n), np.array(logical or list(b)), ("s",))


def l1_bytes(w: Worker, slot: int) -> np.ndarray:
    return w.hbm.tensor[slot].reshape(-1).view(torch.uint8).numpy().copy()


@pytest.fixture
def worker(tmp_path):
    w = Worker(make_config(1, str(tmp_path)), rank=0, device="cpu")
    ids = np.arange(4)
    w.mirror.put(ids, np.full(4, H), ids, ["s"] * 4, ids)  # blocks 0..3 in L1 slots 0..3
    for b in range(4):
        w.hbm.tensor[b].reshape(-1).view(torch.uint8).copy_(
            torch.from_numpy(pattern(b, 0, w.hbm.block_bytes)))
    yield w
    w.close()


def test_plans_apply_in_epoch_order_only(worker):
    worker.apply_plan(plan(1, [(0, H, 0, D, 0)]))
    with pytest.raises(PlanOrderError, match="plan 3 arrived after plan 1"):
        worker.apply_plan(plan(3, [(1, H, 1, D, 1)]))


def test_round_trip_through_all_tiers_keeps_bytes_layer_by_layer(worker):
    bb = worker.hbm.block_bytes
    assert worker.executor.layers.layers_per_copy == 1  # make_config: a copy (and event) a layer
    worker.apply_plan(plan(1, [(0, H, 0, D, 5), (1, H, 1, D, 6)]))
    worker.apply_plan(plan(2, [(0, D, 5, S, -1)]))
    worker.apply_plan(plan(3, [(0, S, -1, D, 7)]))
    worker.apply_plan(plan(4, [(0, D, 7, H, 9), (1, D, 6, H, 8)]))
    for layer in range(worker.hbm.geometry.num_layers):
        worker.wait_layer(layer)
    assert np.array_equal(l1_bytes(worker, 9), pattern(0, 0, bb))
    assert np.array_equal(l1_bytes(worker, 8), pattern(1, 0, bb))
    tier, slot = worker.mirror.where(np.array([0, 1, 2]))
    assert tier.tolist() == [H, H, H] and slot.tolist() == [9, 8, 2]
    assert worker.hbm.slots.num_used == 4 and worker.host.slots.num_used == 0


def test_a_move_that_does_not_start_where_this_rank_says_is_refused(worker):
    applied = worker.apply_plan(plan(1, [(0, H, 0, D, 0), (1, H, 3, D, 1)]))  # block 1 is in 1
    assert applied.moves_applied == 1 and applied.status & STATUS_DIVERGED
    rows = np.asarray([applied.row()])
    expected = [1, 2, plan_digest(applied.plan), 0]
    assert rows[0, 1] != expected[1] and rows[0, 2] != expected[2]
    assert worker.mirror.where(np.array([1]))[0].tolist() == [H]  # nothing changed for it


def test_a_mismatch_in_a_step_is_reported_with_its_epoch(worker):
    from tpkv.protocol.messages import StepResult

    e = np.zeros(0, dtype=np.int64)
    step = StepResult(1, (), e, np.zeros(1, dtype=np.int64), e.astype(np.int32),
                      plans=(plan(1, [(0, H, 2, D, 0)]),), drops=(e, e))
    report = worker.finish(worker.apply_step(step))
    assert report.mismatches == [(1, (0,))]
    with pytest.raises(RankMismatchError, match="plan 1 applied differently on rank 0") as info:
        report.raise_if_mismatch()
    assert (info.value.epoch, info.value.ranks) == (1, (0,))


def test_a_bad_l3_record_is_a_miss_never_wrong_bytes(worker):
    worker.apply_plan(plan(1, [(0, H, 0, D, 0)]))
    worker.apply_plan(plan(2, [(0, D, 0, S, -1)]))
    worker.executor.synchronize()  # the spill ran in the background
    seg = next(Path(worker.store.root).rglob("*.seg"))
    data = bytearray(seg.read_bytes())
    at = data.find(pattern(0, 0, worker.hbm.block_bytes).tobytes())
    assert at > 0
    data[at + 10] ^= 0xFF  # inside the record's payload: its CRC32C fails
    seg.write_bytes(bytes(data))
    applied = worker.apply_plan(plan(3, [(0, S, -1, D, 3)]))
    assert applied.misses.tolist() == [0] and applied.status & STATUS_MISSES
    assert not worker.host.block_bytes_view(3).any()  # zeros, not the damaged bytes
    result = applied.result(worker.rank, None)
    assert result.slot_map_digest == plan_digest(applied.plan, result.miss_block_ids)


def test_resync_moves_bytes_to_where_the_controller_says(worker):
    bb = worker.hbm.block_bytes
    truth = worker.slot_map()
    truth["tiers"] = np.array([D, H, H, H], dtype=np.int8)  # block 0 belongs in L2 slot 4
    truth["slots"] = np.array([4, 1, 2, 3])
    truth["epoch"] = 7
    lost = worker.resync(truth)
    assert len(lost) == 0 and worker.epoch == 7
    assert np.array_equal(worker.host.block_bytes_view(4), pattern(0, 0, bb))
    assert worker.slot_map()["digest"] == worker.mirror.export()["digest"]
    assert worker.hbm.slots.num_used == 3 and worker.host.slots.num_used == 1


def test_typed_errors_survive_pickling():
    err = pickle.loads(pickle.dumps(RankMismatchError("plan 3 differs", 3, (1,))))
    assert (str(err), err.epoch, err.ranks) == ("plan 3 differs", 3, (1,))
    err2 = pickle.loads(pickle.dumps(RankTimeoutError("rank 2 did not answer", (2,))))
    assert err2.ranks == (2,)


def test_importing_tpkv_and_the_controller_pulls_in_neither_torch_nor_ray():
    code = ("import sys, tpkv, tpkv.controller; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"
