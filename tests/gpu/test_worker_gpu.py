"""Worker on CUDA: per-layer H2D events, copy-stream ordering across plans, NCCL confirmation."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import numpy as np
import pytest
import torch

from tests.multiproc.harness import make_config, pattern, run_ranks
from tests.multiproc.rank_fns import consistency_rank
from tpkv.config import KvGeometry
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.worker import Worker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)


def big_worker(tmp_path, layer_events: bool, chunk: int = 0) -> Worker:
    """32 layers x 8 KiB per layer (256 KiB blocks, as Llama-3-8B at TP 8)."""
    cfg = make_config(1, str(tmp_path), l1=64, l2=64)
    g = KvGeometry(num_layers=32, num_kv_heads=1, head_dim=128, dtype="bfloat16",
                   block_tokens=16, tp_size=1)
    l2 = dataclasses.replace(cfg.l2, budget_bytes=64 * g.block_bytes, arena_bytes=16 << 20)
    cfg = dataclasses.replace(cfg, geometry=g, l2=l2, layer_events=layer_events,
                              layer_chunk_bytes=chunk)
    return Worker(cfg, rank=0, device="cuda")


def fill(w: Worker, blocks: range) -> None:
    w.mirror.put(np.array(blocks), np.full(len(blocks), H), np.array(blocks),
                 ["s"] * len(blocks), np.array(blocks))
    for b in blocks:
        w.hbm.tensor[b].reshape(-1).view(torch.uint8).copy_(
            torch.from_numpy(pattern(b, 0, w.hbm.block_bytes)).cuda())


def y_in_l1(w: Worker) -> list[int]:
    """Blocks Y = 100..131 in L1 slots 32..63, their bytes pattern(b, 0)."""
    y = list(range(100, 132))
    w.mirror.put(np.array(y), np.full(32, H), np.arange(32, 64), ["s"] * 32, np.array(y))
    for i, b in enumerate(y):
        w.hbm.tensor[32 + i].reshape(-1).view(torch.uint8).copy_(
            torch.from_numpy(pattern(b, 0, w.hbm.block_bytes)).cuda())
    return y


def plan(epoch: int, block_ids, src_tier, src_slots, dst_tier, dst_slots) -> MovePlan:
    n = len(block_ids)
    return MovePlan(epoch, np.asarray(block_ids), np.full(n, src_tier), np.asarray(src_slots),
                    np.full(n, dst_tier), np.asarray(dst_slots), np.zeros(n),
                    np.asarray(block_ids), ("s",))


def l1(w: Worker, slot: int) -> np.ndarray:
    return w.hbm.tensor[slot].reshape(-1).view(torch.uint8).cpu().numpy()


@pytest.mark.parametrize("layer_events,chunk", [(True, 0), (True, 64 << 10), (False, 0)])
def test_h2d_by_layer_keeps_every_byte(tmp_path, layer_events, chunk):
    w = big_worker(tmp_path, layer_events, chunk)
    fill(w, range(32))
    bb = w.hbm.block_bytes
    w.apply_plan(plan(1, range(32), H, range(32), D, range(32, 0, -1)))
    w.apply_plan(plan(2, range(32), D, range(32, 0, -1), H, range(63, 31, -1)))
    for layer in range(32):
        w.wait_layer(layer)
        # a kernel queued after wait_layer(l) sees layer l of every block
        got = w.hbm.tensor[63 - 5, layer].reshape(-1).view(torch.uint8).clone()
        want = pattern(5, 0, bb).reshape(32, -1)[layer]
        assert np.array_equal(got.cpu().numpy(), want)
    for b in range(32):
        assert np.array_equal(l1(w, 63 - b), pattern(b, 0, bb))
    w.close()


def test_slots_emptied_by_one_plan_and_filled_by_the_next_are_ordered(tmp_path):
    """No host wait between plans: an H2D into L1 slots the previous plan's D2H empties must
    run after that D2H read them, and a D2H into L2 slots the previous H2D read must run after
    it; otherwise bytes of two blocks get mixed."""
    w = big_worker(tmp_path, True)
    bb = w.hbm.block_bytes
    fill(w, range(32))  # X: blocks 0..31 in L1 slots 0..31
    w.mirror.put(np.arange(100, 132), np.full(32, D), np.arange(32, 64), ["s"] * 32,
                 np.arange(100, 132))  # Y: blocks 100..131 in L2 slots 32..63
    for i in range(32):
        w.host.block_bytes_view(32 + i)[:] = pattern(100 + i, 0, bb)
    x, y, p, q = list(range(32)), list(range(100, 132)), list(range(32, 64)), list(range(32))
    for rnd in range(20):
        w.apply_plan(plan(2 * rnd + 1, x, H, range(32), D, q))  # X: L1 -> L2 slots q
        w.apply_plan(plan(2 * rnd + 2, y, D, p, H, range(32)))  # Y: L2 slots p -> L1
        w.executor.synchronize()
        for i in range(32):
            assert np.array_equal(l1(w, i), pattern(y[i], 0, bb)), f"round {rnd} L1 slot {i}"
            assert np.array_equal(w.host.block_bytes_view(q[i]), pattern(x[i], 0, bb))
        x, y, p, q = y, x, q, p
    w.close()


@pytest.mark.parametrize("clash", [True, False])
def test_copies_after_a_load_plan_keep_every_byte(tmp_path, clash):
    """A plan loads X (L2 slots 0..31 -> L1 0..31) while the next plan demotes Y (L1 32..63)
    into L2: into X's old slots (clash: they must wait for X's copies, which read them) or
    into other slots (they run beside them). Both keep every byte."""
    w = big_worker(tmp_path, False)
    bb = w.hbm.block_bytes
    y = y_in_l1(w)
    x = list(range(32))
    w.mirror.put(np.array(x), np.full(32, D), np.arange(32), ["s"] * 32, np.array(x))
    for rnd in range(10):
        for i, b in enumerate(x):
            w.host.block_bytes_view(i)[:] = pattern(b, rnd, bb)
        epoch = w.epoch
        w.apply_plan(plan(epoch + 1, x, D, range(32), H, range(32)))
        into = range(32) if clash else range(32, 64)
        w.apply_plan(plan(epoch + 2, y, H, range(32, 64), D, into))
        w.executor.synchronize()
        for i, b in enumerate(x):
            assert np.array_equal(l1(w, i), pattern(b, rnd, bb)), f"round {rnd} L1 slot {i}"
        for i, b in enumerate(y):
            assert np.array_equal(w.host.block_bytes_view(into[i]), pattern(b, 0, bb))
        # back where they were for the next round (X to L2 0..31, Y to L1 32..63)
        w.apply_plan(plan(epoch + 3, y, D, into, H, range(32, 64)))
        w.apply_plan(plan(epoch + 4, x, H, range(32), D, range(32)))
        w.executor.synchronize()
    w.close()


def test_nccl_confirmation_of_one_rank(tmp_path):
    import torch.distributed as dist

    from tpkv.launch.bootstrap import free_port
    from tpkv.workers.confirm import BoundedGroup, Confirmer

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=30))
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    try:
        pg = dist.new_group(backend="nccl")
        conf = Confirmer(BoundedGroup(pg, 0, 1, 30.0, None, "confirm", torch.device("cuda")))
        rows = np.array([[5, 3, -123456789, 0], [6, 1, 42, 1]], dtype=np.int64)
        got = conf.wait(conf.start(lambda: (rows, rows)))
        assert np.array_equal(got[0], rows)
        conf.close()
    finally:
        dist.destroy_process_group()


def test_tp2_on_one_gpu_agrees_with_the_controller(tmp_path):
    out = run_ranks(consistency_rank, 2, 300, 11, str(tmp_path))
    assert sorted(out) == [0, 1]
    for rank, o in out.items():
        assert o["ok"], f"rank {rank}: {o.get('message')}\n{o.get('trace')}"
    assert out[0]["mismatches"] == 0


def _read_ahead_x(w: Worker) -> list[int]:
    """Blocks X = 0..31 (session "s", logical = id) on L3 only, read ahead into pinned buffers."""
    import time

    from tpkv.protocol.messages import StepResult

    store = w.store
    assert store is not None
    bb = w.hbm.block_bytes
    x = list(range(32))
    store.write_blocks("s", np.array(x), [pattern(b, 3, bb) for b in x])
    assert store.commit_manifest("s")
    w.mirror.put(np.array(x), np.full(32, S), np.full(32, -1), ["s"] * 32, np.array(x))
    assert store.read_ahead("s", np.array(x))
    deadline = time.monotonic() + 60
    while not store.ahead.done("s"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    empty = np.zeros(0, dtype=np.int64)
    loads = plan(1, x, S, [-1] * 32, D, range(32, 64))
    ups = plan(2, x, D, range(32, 64), H, range(32))
    w.apply_step(StepResult(tick=1, session_ids=(), num_tokens=empty,
                            block_offsets=np.zeros(1, dtype=np.int64),
                            block_table=np.zeros(0, dtype=np.int32), plans=(loads, ups),
                            drops=(empty,) * 3))
    assert w.executor.direct is not None and w.executor.direct.num_blocks == 32
    return x


@pytest.mark.parametrize("layer_events", [True, False])
def test_blocks_read_ahead_go_straight_into_l1_and_fill_l2_from_there(tmp_path, layer_events):
    w = big_worker(tmp_path, layer_events)
    bb = w.hbm.block_bytes
    x = _read_ahead_x(w)
    w.executor.synchronize()
    for b in x:
        assert np.array_equal(l1(w, b), pattern(b, 3, bb)), f"L1 slot {b}"
        assert np.array_equal(w.host.block_bytes_view(32 + b), pattern(b, 3, bb)), f"L2 {b}"
    assert w.store is not None and w.store.ahead.held_bytes == 0  # lease given back
    w.close()


def test_a_demotion_into_l2_slots_a_direct_load_fills_runs_after_that_fill(tmp_path):
    """Right after the direct loads, with no host wait, a plan demotes Y (L1 32..63) into the
    L2 slots X's fill from L1 writes: Y's bytes are what those slots hold once both are done."""
    w = big_worker(tmp_path, False)
    bb = w.hbm.block_bytes
    y = y_in_l1(w)
    x = _read_ahead_x(w)
    w.apply_plan(plan(3, y, H, range(32, 64), D, range(32, 64)))
    w.executor.synchronize()
    for i, b in enumerate(y):
        assert np.array_equal(w.host.block_bytes_view(32 + i), pattern(b, 0, bb)), f"L2 {i}"
    for b in x:
        assert np.array_equal(l1(w, b), pattern(b, 3, bb)), f"L1 slot {b}"
    w.close()
