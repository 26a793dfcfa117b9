"""Which in-flight L1 -> L2 batch a copy into L1 (or a compute write) must wait for."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpkv.workers.executor import PlanExecutor
from tpkv.workers.pieces import DemotionPieces


@dataclass
class _Handle:
    finished: bool = False

    def done(self) -> bool:
        return self.finished


def _pieces(*batches: tuple[list[int], list[int], bool]
            ) -> tuple[DemotionPieces, list[_Handle]]:
    pieces = DemotionPieces(64, 64)
    handles = [_Handle(done) for _, _, done in batches]
    for h, (l1, l2, _) in zip(handles, batches):
        pieces.track(h, np.asarray(l1, dtype=np.int64), np.asarray(l2, dtype=np.int64))
    return pieces, handles


def _forced_gpu_executor(monkeypatch) -> tuple[PlanExecutor, list, list]:
    """A CPU executor that takes the GPU's paths (demotions in pieces of one block, tracked);
    returns it, the list of what it issues in order (("d2h", L1 slots), ("wait", piece handle
    or None), ("h2d", L1 slots)) and the piece handles it made."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.workers import executor as E

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    monkeypatch.setattr(E, "DEMOTION_PIECE_BYTES", ex.hbm.block_bytes)
    monkeypatch.setattr(E, "REFILL_PIECE_BYTES", ex.hbm.block_bytes)
    monkeypatch.setattr(ex.engine, "on_gpu", True)
    issued: list[tuple[str, object]] = []
    handles: list[_Handle] = []

    def pieces(a, b, step, after=None):
        made = [_Handle() for _ in range(0, len(a), step)]
        issued.extend(("d2h", list(a[k:k + step])) for k in range(0, len(a), step))
        handles.extend(made)
        return made
    monkeypatch.setattr(ex.engine, "d2h_pieces", pieces)
    monkeypatch.setattr(ex, "_mark", lambda direction, prev, after=None:
                        issued.append(("wait", prev)))
    monkeypatch.setattr(ex, "_span", lambda *a: None)
    monkeypatch.setattr(ex, "_h2d", lambda src, dst: issued.append(("h2d", list(dst))))
    return ex, issued, handles


def test_l1_among_finds_any_common_slot():
    ex = PlanExecutor.__new__(PlanExecutor)  # only its scratch mask over L1 is used here
    ex._l1_mark = np.zeros(16, dtype=bool)
    none = np.array([], dtype=np.int64)
    assert ex._l1_among(np.array([7, 9]), np.array([2, 5, 9])).tolist() == [False, True]
    assert not ex._l1_among(np.array([0, 3, 10]), np.array([2, 5, 9])).any()
    assert not ex._l1_among(np.array([1]), none).any()
    assert not ex._l1_among(none, np.array([1])).any()
    assert not ex._l1_mark.any()  # the scratch is all False again


def test_a_copy_into_free_slots_waits_for_no_demotion():
    ex, _ = _pieces(([10, 11, 12], [0, 1, 2], False))
    assert ex.newest_into(np.array([20, 21]), np.array([5, 6])) is None


def test_the_newest_overlapping_demotion_is_the_one_waited_for():
    ex, h = _pieces(([10, 11], [0, 1], False), ([12, 13], [2, 3], False),
                      ([30], [9], False))
    assert ex.newest_into(np.array([11, 40]), None) is h[0]
    assert ex.newest_into(np.array([11, 13]), None) is h[1]  # the d2h stream is in order
    assert ex.newest_into(np.array([50]), np.array([9])) is h[2]  # reads an L2 slot it writes
    assert ex.newest_into(np.array([50]), None) is None


def test_finished_demotions_are_forgotten_oldest_first():
    ex, h = _pieces(([10], [0], True), ([11], [1], False))
    assert ex.newest_into(np.array([10]), None) is None
    assert len(ex.running) == 1 and ex.running[0].handle is h[1]


def test_a_plan_issues_its_promotions_before_its_demotions() -> None:
    """A resume waits for the promotions; the demotions (in pieces on their own stream) follow
    at once, and a next plan's promotions into the slots they empty wait for each piece."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.protocol.plan import MovePlan, Tier

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    calls: list[str] = []
    for name in ("h2d", "d2h_pieces"):
        real = getattr(ex.engine, name)
        setattr(ex.engine, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    H, D = int(Tier.HBM), int(Tier.DRAM)
    # block 0 L1 slot 0 -> L2 slot 0, block 1 L2 slot 1 -> L1 slot 1
    import torch

    l1 = ex.hbm.tensor.view(ex.hbm.num_slots, -1).view(torch.uint8)
    l1[0] = 7
    ex.host.block_bytes_view(1)[:] = 9
    b, st, ss, dt, ds = (np.array(c) for c in zip((0, H, 0, D, 0), (1, D, 1, H, 1)))
    out = ex.run(MovePlan(1, b, st, ss, dt, ds, np.zeros(2), b, ("s",)), np.ones(2, dtype=bool))
    assert calls == ["h2d", "d2h_pieces"] and out.done.all()
    assert (l1[1] == 9).all() and (ex.host.block_bytes_view(0) == 7).all()


def test_copies_into_l1_are_grouped_by_the_piece_they_wait_for():
    """Each copy waits for the newest running piece that empties its L1 slot or writes its L2
    slot; groups come oldest piece first, copies that wait for none before them."""
    ex, h = _pieces(([14], [4], True), ([10, 11], [0, 1], False), ([12, 13], [2, 3], False))
    l1 = np.array([12, 40, 10, 13, 41, 14])
    l2 = np.array([50, 51, 52, 53, 0, 54])  # L2 slot 0: written by the second piece
    groups = ex.groups(l1, l2)
    assert [g[0] for g in groups] == [None, h[1], h[2]]  # the finished first piece is gone
    assert [sorted(g[1].tolist()) for g in groups] == [[1, 5], [2, 4], [0, 3]]
    ex2, _ = _pieces()
    assert [(a, b.tolist()) for a, b in ex2.groups(np.array([1, 2]), np.array([3, 4]))] \
        == [(None, [0, 1])]


def test_a_demotion_goes_out_in_pieces_each_waited_for_alone(monkeypatch) -> None:
    """On the GPU an L1 -> L2 batch is split into DEMOTION_PIECE_BYTES pieces (here, forced
    on a CPU engine: one block each); a promotion into slot 3 waits for the piece of slot 3."""
    from tpkv.protocol.plan import MovePlan, Tier

    ex, issued, _ = _forced_gpu_executor(monkeypatch)
    H, D = int(Tier.HBM), int(Tier.DRAM)
    moves = [(0, H, 1, D, 0), (1, H, 2, D, 1), (2, H, 3, D, 2)]
    b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
    ex.run(MovePlan(1, b, st, ss, dt, ds, np.zeros(3), b, ("s",)), np.ones(3, dtype=bool))
    assert [x for x in issued if x[0] == "d2h"] == [("d2h", [1]), ("d2h", [2]), ("d2h", [3])]
    pieces = [d.handle for d in ex.demotions.running]
    assert len(pieces) == 3
    issued.clear()
    up = MovePlan(2, np.array([5, 6]), np.array([D, D]), np.array([5, 6]), np.array([H, H]),
                  np.array([3, 7]), np.zeros(2), np.array([5, 6]), ("s",))
    ex.run(up, np.ones(2, dtype=bool))
    assert issued == [("wait", None), ("h2d", [7]), ("wait", pieces[2]), ("h2d", [3])]


def test_deferred_demotions_go_out_at_flush_or_before_anything_that_needs_them() -> None:
    """PlanExecutor(defer_d2h=True): a plan of demotions only is applied (done) but copied at
    flush(); a later plan with other moves, a step writing into their L1 slots, or synchronize()
    flushes first; with the default (off) they are copied at once. Bytes are checked after each
    (on the CPU a copy happens when issued)."""
    import torch

    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.protocol.plan import MovePlan, Tier

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False,
                      defer_d2h=True)
    l1 = ex.hbm.tensor.view(ex.hbm.num_slots, -1).view(torch.uint8)
    for slot in range(8):
        l1[slot] = 10 + slot
        ex.host.block_bytes_view(slot)[:] = 0
    H, D = int(Tier.HBM), int(Tier.DRAM)

    def plan(epoch: int, moves: list[tuple[int, int, int, int, int]]) -> MovePlan:
        b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
        return MovePlan(epoch, b, st, ss, dt, ds, np.zeros(len(moves)), b, ("s",))

    def run(p: MovePlan) -> np.ndarray:
        return ex.run(p, np.ones(p.num_moves, dtype=bool)).done

    assert run(plan(1, [(0, H, 0, D, 0), (1, H, 1, D, 1)])).all()
    assert len(ex.deferred) == 1 and (ex.host.block_bytes_view(0) == 0).all()
    ex.flush()
    assert not ex.deferred
    assert (ex.host.block_bytes_view(0) == 10).all() and (ex.host.block_bytes_view(1) == 11).all()

    run(plan(2, [(2, H, 2, D, 2)]))  # deferred, then a plan that promotes: flushed first
    run(plan(3, [(5, D, 5, H, 6)]))
    assert not ex.deferred and (ex.host.block_bytes_view(2) == 12).all()

    run(plan(4, [(3, H, 3, D, 3)]))
    ex.fence_compute(np.array([7]))  # fresh slot 7: not the deferred one's
    assert len(ex.deferred) == 1
    ex.fence_compute(np.array([3, 7]))  # new K/V into L1 slot 3: its demotion goes out first
    assert not ex.deferred and (ex.host.block_bytes_view(3) == 13).all()

    run(plan(5, [(4, H, 4, D, 4)]))
    ex.synchronize()
    assert not ex.deferred and (ex.host.block_bytes_view(4) == 14).all()
    off = PlanExecutor(ex.engine, None, timeout_s=5.0, layer_events=False)  # the default
    assert off.run(plan(6, [(7, H, 7, D, 7)]), np.ones(1, dtype=bool)).done.all()
    assert not off.deferred and (ex.host.block_bytes_view(7) == 17).all()  # issued at once


def _marking_executor(monkeypatch) -> tuple[PlanExecutor, list, list]:
    """A CPU executor on the GPU's paths whose copies are not issued: returns it, the stream
    marks it makes in order ((direction, the handle that stream waits for)) and the handles of
    its L2 -> L1 batches (each the last H2D when made)."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    monkeypatch.setattr(ex.engine, "on_gpu", True)
    marks: list[tuple[str, object]] = []
    promotions: list[_Handle] = []

    def h2d(src, dst):
        promotions.append(_Handle())
        ex.last["h2d"] = promotions[-1]
    monkeypatch.setattr(ex, "_h2d", h2d)
    monkeypatch.setattr(ex, "_mark", lambda direction, prev, after=None:
                        marks.append((direction, prev)))
    monkeypatch.setattr(ex, "_span", lambda *a: None)
    monkeypatch.setattr(ex.engine, "d2h_pieces", lambda a, b, step, after=None: [_Handle()])
    return ex, marks, promotions


def test_demotions_nothing_later_in_the_step_needs_wait_for_the_plans_promotions(
        monkeypatch) -> None:
    """A resume's plan promotes into free slots and demotes to make room for later steps: the
    demotions that empty no L1 slot a later plan of the step (or its new K/V) fills wait for
    the plan's promotions (the resume's copies then have the link alone); those that empty one
    go first and wait only for the batch before the plan, as all do when the caller does not
    say (later_l1 None)."""
    from tpkv.protocol.plan import MovePlan, Tier

    ex, marks, promotions = _marking_executor(monkeypatch)
    H, D = int(Tier.HBM), int(Tier.DRAM)

    def resume(epoch: int) -> MovePlan:  # block 1 up into free L1 slot 5; block 0 down from 2
        moves = [(0, H, 2, D, 0), (1, D, 1, H, 5)]
        b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
        return MovePlan(epoch, b, st, ss, dt, ds, np.zeros(2), b, ("s",))

    before = _Handle()
    ex.last["h2d"] = before
    ex.run(resume(1), np.ones(2, dtype=bool), later_l1=np.array([6, 7]))
    assert marks == [("h2d", None), ("d2h", promotions[-1])]
    for later in (np.array([2, 7]), None):  # slot 2 is filled later in the step / not known
        marks.clear()
        ex.last["h2d"] = before
        ex.demotions.running.clear()
        ex.run(resume(2), np.ones(2, dtype=bool), later_l1=later)
        assert marks == [("h2d", None), ("d2h", before)]
    # Both kinds in one plan: those a later plan needs go first, beside the promotions.
    issued: list[list[int]] = []
    monkeypatch.setattr(ex.engine, "d2h_pieces", lambda a, b, step, after=None:
                        issued.append(a.tolist()) or [_Handle()])
    moves = [(0, H, 2, D, 0), (2, H, 3, D, 2), (1, D, 1, H, 5)]
    b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
    marks.clear()
    ex.last["h2d"] = before
    ex.run(MovePlan(3, b, st, ss, dt, ds, np.zeros(3), b, ("s",)), np.ones(3, dtype=bool),
           later_l1=np.array([3]))
    assert issued == [[3], [2]]
    assert marks == [("h2d", None), ("d2h", before), ("d2h", promotions[-1])]


def test_a_kept_demotion_copies_nothing() -> None:
    """MovePlan.kept: the L2 slot holds the block's bytes already (its copy from the promotion,
    unchanged since), so the executor issues no copy for it; the move counts as done."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.protocol.plan import MovePlan, Tier

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    import torch

    l1 = ex.hbm.tensor.view(ex.hbm.num_slots, -1).view(torch.uint8)
    l1[0], l1[1] = 7, 8
    ex.host.block_bytes_view(0)[:] = 5  # the kept copy (here different, to see a copy)
    H, D = int(Tier.HBM), int(Tier.DRAM)
    b, st, ss, dt, ds = (np.array(c) for c in zip((0, H, 0, D, 0), (1, H, 1, D, 1)))
    plan = MovePlan(1, b, st, ss, dt, ds, np.zeros(2), b, ("s",), kept=np.array([True, False]))
    out = ex.run(plan, np.ones(2, dtype=bool))
    ex.flush()
    ex.engine.synchronize()
    assert out.done.all() and out.bytes_d2h == ex.hbm.block_bytes  # one block copied
    assert (ex.host.block_bytes_view(0) == 5).all()  # the kept slot was not written
    assert (ex.host.block_bytes_view(1) == 8).all()


def test_demotions_out_of_slots_the_plan_refills_go_before_its_promotions() -> None:
    """A plan may promote into the L1 slot its own demotion empties (PlanBuilder.free_vacated):
    the promotions into other slots go first, then that demotion, then the promotion into its
    slot, so the block's bytes reach L2 before the promotion's bytes replace them; the other
    demotions still follow the promotions."""
    from tests.pool_cases import make_engine
    from tpkv.config import KvGeometry
    from tpkv.protocol.plan import MovePlan, Tier

    geo = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=16)
    ex = PlanExecutor(make_engine(geo, 8, 8, "cpu"), None, timeout_s=5.0, layer_events=False)
    calls: list[tuple[str, list[int]]] = []
    real_h2d, real_d2h = ex.engine.h2d, ex.engine.d2h_pieces
    ex.engine.h2d = lambda src, dst, **k: calls.append(("h2d", dst.tolist())) or real_h2d(src, dst,
                                                                                           **k)
    ex.engine.d2h_pieces = lambda src, dst, *a: (calls.append(("d2h", src.tolist()))
                                                 or real_d2h(src, dst, *a))
    import torch

    l1 = ex.hbm.tensor.view(ex.hbm.num_slots, -1).view(torch.uint8)
    l1[0], l1[1] = 7, 8
    ex.host.block_bytes_view(2)[:] = 9
    ex.host.block_bytes_view(3)[:] = 6
    H, D = int(Tier.HBM), int(Tier.DRAM)
    # block 0: L1 0 -> L2 0; block 1: L1 1 -> L2 1; block 2: L2 2 -> L1 0 (the slot 0 emptied);
    # block 3: L2 3 -> L1 5 (free)
    b, st, ss, dt, ds = (np.array(c) for c in zip((0, H, 0, D, 0), (1, H, 1, D, 1),
                                                   (2, D, 2, H, 0), (3, D, 3, H, 5)))
    out = ex.run(MovePlan(1, b, st, ss, dt, ds, np.zeros(4), b, ("s",)), np.ones(4, dtype=bool),
                 later_l1=np.zeros(0, dtype=np.int64))
    ex.engine.synchronize()
    assert calls == [("h2d", [5]), ("d2h", [0]), ("h2d", [0]), ("d2h", [1])]
    assert out.done.all() and out.bytes_d2h == 2 * ex.hbm.block_bytes
    assert out.bytes_h2d == 2 * ex.hbm.block_bytes
    assert (ex.host.block_bytes_view(0) == 7).all() and (ex.host.block_bytes_view(1) == 8).all()
    assert (l1[0] == 9).all() and (l1[5] == 6).all()


def test_a_promotion_into_a_slot_its_plan_empties_waits_for_that_piece(monkeypatch) -> None:
    """On the GPU (forced here, one block a piece): the plan's promotion into a free slot waits
    for nothing and goes first; the one into the slot its demotion empties waits for the
    piece that copies that slot out."""
    from tpkv.protocol.plan import MovePlan, Tier

    ex, issued, handles = _forced_gpu_executor(monkeypatch)
    H, D = int(Tier.HBM), int(Tier.DRAM)
    moves = [(0, H, 1, D, 0), (1, D, 1, H, 1), (2, D, 2, H, 6)]  # block 1 refills L1 slot 1
    b, st, ss, dt, ds = (np.array(c) for c in zip(*moves))
    ex.run(MovePlan(1, b, st, ss, dt, ds, np.zeros(3), b, ("s",)), np.ones(3, dtype=bool))
    assert issued == [("wait", None), ("h2d", [6]), ("wait", None), ("d2h", [1]),
                      ("wait", handles[0]), ("h2d", [1])]


def test_an_l3_read_or_spill_waits_only_for_the_pieces_that_write_its_l2_slots():
    """An L3 read fills L2 slots and a spill reads them: each waits for the newest running
    piece that writes one of its slots, not for the whole last batch (a resume's reads run
    beside the demotion that makes its L1 room)."""
    ex, h = _pieces(([10, 11], [0, 1], False), ([12, 13], [2, 3], False), ([14], [4], True))
    assert ex.newest_writing(np.array([7, 8])) is None
    assert ex.newest_writing(np.array([1, 7])) is h[0]
    assert ex.newest_writing(np.array([3, 0])) is h[1]
    assert ex.newest_writing(np.array([], dtype=np.int64)) is None
    h[0].finished = h[1].finished = True
    assert ex.newest_writing(np.array([0, 3, 4])) is None and not ex.running
