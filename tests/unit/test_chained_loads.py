"""Chained loads (chain.find_chain, PlanExecutor.run's `chain`): a step's L2 -> L1 moves of blocks
its plan before loads from L3 go as soon as each block's read job is done with a hit, beside the
plan's later reads, instead of after all of them; the next plan takes them as done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.unit.test_ssd_faults import PAGE, files  # noqa: E402
from tpkv.protocol.messages import StepResult  # noqa: E402
from tpkv.protocol.plan import MovePlan, Tier  # noqa: E402
from tpkv.workers import reads as reads_mod  # noqa: E402
from tpkv.workers.chain import find_chain  # noqa: E402
from tpkv.workers.confirm import STATUS_DIVERGED  # noqa: E402

H, D, S = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
EMPTY = np.zeros(0, dtype=np.int64)


def plan(epoch: int, rows: list[tuple[int, int, int, int, int]]) -> MovePlan:
    """rows: (block, src tier, src slot, dst tier, dst slot); one session "s", logical = block."""
    a = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    return MovePlan(epoch, a[:, 0], a[:, 1].astype(np.int8), a[:, 2], a[:, 3].astype(np.int8),
                    a[:, 4], np.zeros(len(a), dtype=np.int32), a[:, 0], ("s",))


def step(plans: tuple[MovePlan, ...], drops: tuple[np.ndarray, ...] | None = None
         ) -> StepResult:
    return StepResult(tick=1, session_ids=(), num_tokens=EMPTY,
                      block_offsets=np.zeros(1, dtype=np.int64),
                      block_table=np.zeros(0, dtype=np.int32), plans=plans,
                      drops=drops or (EMPTY,) * (len(plans) + 1))


def l1_bytes(w: Any, slot: int) -> np.ndarray:
    return w.hbm.block(slot).contiguous().view(torch.uint8).numpy().reshape(-1).copy()


class Rig:
    """One CPU worker whose session "s" has blocks 0..n-1 in L3 (bytes known), every L1 and
    L2 slot free; each read job of a load carries one block (the executor's chunk shrunk)."""

    def __init__(self, root: Path, n: int = 4) -> None:
        from tests.multiproc.harness import make_config
        from tpkv.workers.worker import Worker

        self.root = root
        self.w = Worker(make_config(1, str(root)), rank=0, device="cpu")
        bb = self.w.hbm.block_bytes
        rng = np.random.default_rng(7)
        self.truth = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]
        store = self.w.store
        assert store is not None
        store.write_blocks("s", np.arange(n), self.truth)
        assert store.commit_manifest("s")
        self.w.mirror.put(np.arange(n), np.full(n, S), np.full(n, -1), ["s"] * n, np.arange(n))
        self.h2d_calls: list[int] = []
        real = self.w.executor._h2d

        def h2d(host_slots: np.ndarray, hbm_slots: np.ndarray) -> None:
            self.h2d_calls.append(len(hbm_slots))
            real(host_slots, hbm_slots)
        self.w.executor._h2d = h2d  # type: ignore[method-assign]

    def resume(self, n: int = 4) -> list[Any]:
        """One step: load blocks 0..n-1 into L2 slots 4.., then promote them into L1 0..n-1."""
        loads = plan(1, [(b, S, -1, D, 4 + b) for b in range(n)])
        ups = plan(2, [(b, D, 4 + b, H, b) for b in range(n)])
        self.w.apply_step(step((loads, ups)))
        return self.w.last_applied

    def close(self) -> None:
        self.w.close()


@pytest.fixture
def one_block_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reads_mod, "READ_CHUNK_BYTES", 1)


def test_loaded_blocks_reach_l1_bit_exact_as_each_read_is_done(tmp_path: Path, one_block_jobs:
                                                                None) -> None:
    rig = Rig(tmp_path / "l3")
    try:
        loads, ups = rig.resume()
        for b in range(4):
            np.testing.assert_array_equal(l1_bytes(rig.w, b), rig.truth[b])
        assert loads.outcome.done.all() and ups.outcome.done.all()
        assert ups.outcome.bytes_h2d == 4 * rig.w.hbm.block_bytes
        tier, slot = rig.w.mirror.where(np.arange(4))
        assert tier.tolist() == [H] * 4 and slot.tolist() == [0, 1, 2, 3]
        # one copy per read job, all during the loads' plan
        assert rig.h2d_calls == [1, 1, 1, 1]
        assert ups.outcome.num_ahead == 4 and rig.w.executor.num_chained == 4
        assert rig.w.executor.chained is None
    finally:
        rig.close()


def test_a_block_whose_read_misses_is_not_chained(tmp_path: Path, one_block_jobs: None) -> None:
    """Block 2's record is damaged: its read is a miss, so its promotion is left to the next
    plan (as without chaining); the other three go ahead, bit-exact."""
    rig = Rig(tmp_path / "l3")
    try:
        seg = files(tmp_path / "l3", "s")["seg0"]
        data = bytearray(seg.read_bytes())
        data[PAGE + 2 * rig.w.store.record_bytes + PAGE + 5] ^= 0x5A  # block 2's payload
        seg.write_bytes(bytes(data))
        loads, ups = rig.resume()
        assert loads.outcome.misses.tolist() == [2]
        assert ups.outcome.num_ahead == 3 and ups.outcome.done.all()
        assert rig.h2d_calls == [1, 1, 1, 1]  # three ahead, then block 2 with its plan
        for b in (0, 1, 3):
            np.testing.assert_array_equal(l1_bytes(rig.w, b), rig.truth[b])
    finally:
        rig.close()


def test_the_chain_takes_only_moves_the_next_check_passes(tmp_path: Path) -> None:
    """find_chain against a map: blocks 0..5 in L3, block 10 in L1 slot 5 (the loads' plan demotes
    it), block 11 in L1 slot 6 (stays), block 12 in L2 slot 12 (not loaded by the plan)."""
    rig = Rig(tmp_path / "l3", n=6)
    w = rig.w
    try:
        w.mirror.put(np.array([10, 11, 12, 13]), np.array([H, H, D, H]),
                     np.array([5, 6, 12, 9]), ["s"] * 4, np.array([10, 11, 12, 13]))
        p = plan(1, [*[(b, S, -1, D, 4 + b) for b in range(6)], (10, H, 5, D, 13)])
        ok = w.mirror.check(p)
        assert ok.all()
        nxt = plan(2, [
            (0, D, 4, H, 0),    # into a free slot: chained
            (1, D, 5, H, 5),    # into the slot the plan's demotion empties: chained
            (2, D, 6, H, 6),    # into a slot block 11 keeps: not (the check refuses it)
            (3, D, 7, H, 7),    # slot 7 named twice: neither
            (4, D, 8, H, 7),
            (5, D, 9, H, 9),    # into the slot the next plan's own demotion empties: not
            (13, H, 9, D, 14),
            (12, D, 12, H, 10),  # from L2, not loaded by the plan: not
        ])
        chain = find_chain(p, ok, nxt, EMPTY, w.mirror, w.hbm.num_slots)
        assert chain is not None
        assert chain.rows.tolist() == [0, 1] and chain.loads.tolist() == [0, 1]
        # a block dropped between the two plans is not chained
        chain = find_chain(p, ok, nxt, np.array([0]), w.mirror, w.hbm.num_slots)
        assert chain is not None and chain.rows.tolist() == [1]
        # a load this rank refused is not chained, nor is a move whose block differs
        refused = ok & (np.arange(len(ok)) != 0)
        assert find_chain(p, refused, nxt, EMPTY, w.mirror, w.hbm.num_slots).rows.tolist() == [1]
        other = plan(2, [(7, D, 4, H, 0)])
        assert find_chain(p, ok, other, EMPTY, w.mirror, w.hbm.num_slots) is None
    finally:
        rig.close()


def test_a_chained_move_the_check_refuses_is_reported_not_done(tmp_path: Path,
                                                               one_block_jobs: None) -> None:
    """Never expected (the chain takes only moves the check passes): were the check of the next
    plan to refuse one, that move is not done, its plan is marked diverged, and a block the map
    kept in its L1 slot is dropped here (its bytes were overwritten)."""
    rig = Rig(tmp_path / "l3")
    w = rig.w
    real = w.mirror.check

    def check(p: MovePlan) -> np.ndarray:
        ok = real(p)
        if p.epoch == 2:
            w.mirror.put(np.array([50]), np.array([H]), np.array([1]), ["s"], np.array([50]))
            ok[1] = False
        return ok
    w.mirror.check = check  # type: ignore[method-assign]
    try:
        _, ups = rig.resume()
        assert not ups.outcome.done[1] and ups.outcome.done[[0, 2, 3]].all()
        assert ups.status & STATUS_DIVERGED
        assert w.mirror.where(np.array([50]))[0].tolist() == [int(Tier.NONE)]
    finally:
        rig.close()


def _placed(m: dict[str, Any]) -> dict[int, tuple[int, int]]:
    return dict(zip(np.asarray(m["block_ids"]).tolist(),
                    zip(np.asarray(m["tiers"]).tolist(), np.asarray(m["slots"]).tolist())))


def engine_run(root: Path) -> tuple[Any, Any]:
    """The tiered engine test's workload and tiers, returns always loaded from L3: its tokens
    and the rank's PlanExecutor (its counters). Checks the rank's map against the
    controller's before the first close (both whole then), and that blocks came back from L3
    with no mismatch."""
    import tpkv
    from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=L1_BLOCKS, l2_blocks=L2_BLOCKS,
                        ssd_root=str(root), policy=PolicyConfig(cooldown_s=0.0,
                                                                prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        maps: list[tuple[Any, Any]] = []
        real_close = tiered.engine.close_session

        def close_session(name: str) -> None:
            if not maps:
                maps.append((_placed(rt.controller_slot_map()), _placed(rt.worker.slot_map())))
            real_close(name)
        tiered.engine.close_session = close_session  # type: ignore[method-assign]
        tokens = drive(tiered.engine)
        theirs, here = maps[0]
        assert len(theirs) > 0 and here == theirs
        assert rt.num_mismatches == 0 and tiered.stats.moves["l3_l2"] > 0
        return tokens, rt.worker.executor
    finally:
        rt.close()


def test_the_engine_gives_the_tokens_of_a_large_l1_with_chained_loads(tmp_path: Path) -> None:
    """The tiered engine's workload with returns loaded from L3: the tokens of a large L1
    where nothing moves, moves chained, and the rank's map the controller's."""
    from tests.multiproc.test_engine_tiered import reference
    from tpkv.models.llama import build_model

    on, ex_on = engine_run(tmp_path / "on")
    assert ex_on.num_chained > 0
    assert ex_on.direct.num_blocks > 0  # blocks read ahead went straight into L1
    assert on == reference(build_model("tiny", seed=0, device="cpu"))


def test_a_chain_left_for_a_plan_that_never_ran_is_dropped(tmp_path: Path,
                                                           one_block_jobs: None) -> None:
    """The loads' plan chained the next plan's moves, but that plan never ran (its step failed
    half-way); another plan of the same epoch takes none of them as done: it copies its own."""
    rig = Rig(tmp_path / "l3")
    w = rig.w
    try:
        loads = plan(1, [(b, S, -1, D, 4 + b) for b in range(4)])
        ups = plan(2, [(b, D, 4 + b, H, b) for b in range(4)])
        w.apply_plan(loads, then=(ups, EMPTY))
        assert w.executor.chained is not None and w.executor.chained.issued.all()
        again = plan(2, [(b, D, 4 + b, H, 8 + b) for b in range(4)])  # other L1 slots
        applied = w.apply_plan(again)
        assert applied.outcome.num_ahead == 0 and applied.outcome.done.all()
        assert w.executor.chained is None and rig.h2d_calls == [1, 1, 1, 1, 4]
        for b in range(4):
            np.testing.assert_array_equal(l1_bytes(w, 8 + b), rig.truth[b])
    finally:
        rig.close()
