"""Turns queued for the batch are named to the controller as upcoming (TieredEngine._upcoming),
which prefetches their blocks in the steps before they join; those plans move only blocks of
sessions outside the batch, so the worker applies them once the step's forward is launched
(Worker._may_wait). The tokens are those of an L1 that holds everything."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SESSIONS, TURNS, MAX_BATCH = 6, 3, 2


def _drive(engine: Any, seed: int = 0) -> dict[str, list[tuple[int, ...]]]:
    """Every session's turn comes at once each round: with a batch of two, four wait in line
    while two decode."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[tuple[int, ...]]] = {}
    for turn in range(TURNS):
        for i in range(SESSIONS):
            n = int(rng.integers(12, 21)) if turn == 0 else int(rng.integers(3, 9))
            engine.add_turn(f"s{i}", rng.integers(0, 512, n).tolist(), int(rng.integers(6, 10)))
        for f in engine.run():
            out.setdefault(f.session, []).append(f.token_ids)
    for i in range(SESSIONS):
        engine.close_session(f"s{i}")
    return out


def _reference() -> dict[str, list[tuple[int, ...]]]:
    from tests.multiproc.test_engine_tiered import BT
    from tpkv.models.engine import PagedEngine
    from tpkv.models.llama import build_model

    model = build_model("tiny", seed=0, device="cpu")
    g = model.kv_geometry(tp_size=1, block_tokens=BT)
    heads = model.blocks[0].attn.wk.out_features // model.config.head_dim
    pool = torch.full((256, g.num_layers, 2, BT, heads, g.head_dim), float("nan"))
    return _drive(PagedEngine(model, pool, scheduler_seed=3, max_batch=MAX_BATCH))


def _run(root: str, hint: bool, controller: str) -> dict[str, Any]:
    import tpkv
    from tests.multiproc.test_engine_tiered import BT
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config
    from tpkv.protocol.plan import Tier

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=40, l2_blocks=16, ssd_root=root,
                        policy=PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller=controller, device="cpu")
    try:
        tiered = TieredEngine(rt, model, report_prefill=False, hint_running=hint,
                              max_batch=MAX_BATCH, scheduler_seed=3)
        worker, real_apply = rt.worker, rt.worker.apply_step
        late_ups = 0  # moves into L1 (or L2 from L3) of plans applied after the forward
        joined_loading: list[int] = []  # blocks a joining turn's own step moved up

        def apply_step(step: Any, late_ok: bool = False) -> Any:
            nonlocal late_ok_seen, late_ups
            applied = real_apply(step, late_ok)
            late_ok_seen |= late_ok
            batch = set(step.session_ids)
            for plan in step.plans:
                up = (plan.dst_tier < plan.src_tier)
                if applied.late:
                    late_ups += int(up.sum())
                    # a plan that waits moves nothing of the batch's sessions
                    assert batch.isdisjoint(plan.session_names[i]
                                            for i in set(plan.session_idx.tolist()))
            ups = sum(int(((p.dst_tier < p.src_tier)
                           & np.isin(p.session_idx, [j for j, n in enumerate(p.session_names)
                                                     if n in batch])).sum())
                      for p in step.plans)
            joined_loading.append(ups)
            return applied

        real_late, reads_running = worker.apply_late, 0

        def apply_late() -> None:
            nonlocal reads_running
            real_late()
            if worker._rest is not None:  # its reads run on: the map has them on L3 still
                plan = worker._rest[0].plan
                tier, _ = worker.mirror.where(plan.block_ids)
                assert (tier[plan.mask(Tier.SSD, Tier.DRAM)] == int(Tier.SSD)).all()
                reads_running += 1

        late_ok_seen = False
        worker.apply_step, worker.apply_late = apply_step, apply_late
        tokens = _drive(tiered.engine)
        return {"tokens": tokens, "late_ups": late_ups, "moves": dict(tiered.stats.moves),
                "demand_ups": sum(joined_loading), "mismatches": rt.num_mismatches,
                "late_ok": late_ok_seen, "by_tier": dict(tiered.stats.resume_s),
                "reads_later": worker.num_reads_later, "reads_running": reads_running}
    finally:
        rt.close()


def test_turns_in_line_come_up_before_they_join_with_the_same_tokens(tmp_path,
                                                                     transport) -> None:
    want = _reference()
    ahead = _run(str(tmp_path / "a"), True, transport)
    plain = _run(str(tmp_path / "p"), False, transport)
    assert ahead["tokens"] == want and plain["tokens"] == want
    assert ahead["mismatches"] == plain["mismatches"] == 0
    assert plain["late_ups"] == 0  # nothing named: promotions are the batch's own
    assert ahead["late_ups"] > 0
    # staged from L3 after the forward's launch, their reads waited for at the next step
    assert ahead["reads_running"] == ahead["reads_later"] > 0
    # the joining turns' own steps load less: part of it came up in the steps before
    assert ahead["demand_ups"] < plain["demand_ups"]


def test_a_turn_whose_spill_runs_is_not_named_in_line(tmp_path, monkeypatch) -> None:
    """A turn read ahead is named in line, but not while a spill of its session runs: its
    load would wait for that write (a disk seconds behind blocked steps for 6 s on the H200)."""
    import time

    import tpkv
    from tests.multiproc.test_engine_tiered import BT
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=24, l2_blocks=8,
                        ssd_root=str(tmp_path), policy=PolicyConfig(cooldown_s=0.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        tiered = TieredEngine(rt, model, report_prefill=False, max_batch=MAX_BATCH,
                              scheduler_seed=3)
        rng = np.random.default_rng(1)
        for _ in range(2):
            for i in range(SESSIONS):
                tiered.engine.add_turn(f"s{i}", rng.integers(0, 512, 16).tolist(), 8)
            list(tiered.engine.run())
        worker = rt.worker
        worker.executor.wait_spills(time.monotonic() + 60, every=True)
        on3 = [f"s{i}" for i in range(SESSIONS) if worker.returning.on_l3(f"s{i}")]
        assert on3, "no session went to L3: the test needs smaller tiers"
        name = on3[0]
        assert worker.returning.start(name) == "started"
        worker.store.ahead.wait_any([name], 30.0)
        assert worker.returning.done(name)
        seq = tiered.engine.seqs[name]
        tiered.engine.waiting.append(seq)  # its turn queued for the batch
        try:
            assert name in tiered._next_in_line()
            monkeypatch.setattr(worker.executor.spills, "busy", lambda n: n == name)
            assert not worker.returning.done(name)
            assert name not in tiered._next_in_line()
        finally:
            tiered.engine.waiting.remove(seq)
    finally:
        rt.close()


@contextlib.contextmanager
def _sessions_on_l3(tmp_path: Any) -> Iterator[tuple[Any, list[str]]]:
    """A runtime (tiny model, small tiers, local controller) whose eight sessions of 4 blocks
    each have gone down to L2 and the first ones on to L3, every spill written."""
    import time

    import tpkv
    from tests.multiproc.test_engine_tiered import BT
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=12, l2_blocks=12,
                        ssd_root=str(tmp_path), policy=PolicyConfig(cooldown_s=0.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        names = [f"s{i}" for i in range(8)]
        for name in names:  # the first ones go down to L2, then to L3
            rt.open_session(name)
            rt.run_step([name], [4 * BT], lambda step: None)
        rt.worker.executor.wait_spills(time.monotonic() + 60, every=True)
        yield rt, names
    finally:
        rt.close()


def test_a_turn_in_line_staged_from_l3_gives_its_read_ahead_back(tmp_path) -> None:
    """Once a prefetch has brought a turn in line's last L3 block into L2, the rank gives its
    read-ahead buffers back (the budget takes the next turn's sooner); its tokens stay those of
    an all-L1 run (the first test of this file)."""
    with _sessions_on_l3(tmp_path) as (rt, names):
        worker = rt.worker
        on3 = [n for n in names if worker.returning.on_l3(n) == 4]
        assert on3, "no whole session on L3: the test needs smaller tiers"
        name = on3[0]
        assert worker.returning.start(name) == "started"
        worker.store.ahead.wait_any([name], 30.0)
        assert worker.returning.done(name) and worker.store.ahead.held_bytes > 0
        other = next(n for n in names if n != name and worker.returning.on_l3(n) == 0)
        for _ in range(3):
            rt.run_step([other], [0], lambda step: None, upcoming=[name])
            if not worker.returning.on_l3(name):
                break
        assert worker.returning.on_l3(name) == 0, "the prefetch did not stage it"
        assert worker.store.ahead.done(name) is None  # given back
        assert worker.store.ahead.held_bytes == 0
        assert worker.store.ahead.num_served == 4  # its blocks came from the buffers


def test_a_read_ahead_that_misses_blocks_now_on_l3_reads_them_before_it_is_done(
        tmp_path) -> None:
    """A read ahead holding only some of the blocks the rank's map now places on L3 (the
    others came there without a write since it began) is not done until it has read the rest
    too; the prefetch then stages every block from the buffers, none from the disk."""
    from tpkv.protocol.plan import Tier

    with _sessions_on_l3(tmp_path) as (rt, names):
        worker = rt.worker
        name = next(n for n in names if worker.returning.on_l3(n) == 4)
        logical = worker.mirror.session_logical(name, int(Tier.SSD))
        assert worker.store.read_ahead(name, logical[:2])  # as begun before two came to L3
        worker.store.ahead.wait_any([name], 30.0)
        assert worker.store.ahead.done(name)
        assert not worker.returning.done(name)  # the other two are being read now
        worker.store.ahead.wait_any([name], 30.0)
        assert worker.returning.done(name) and worker.store.ahead.covers(name, logical)
        other = next(n for n in names if n != name and worker.returning.on_l3(n) == 0)
        disk = worker.store.step_disk_blocks
        for _ in range(3):
            rt.run_step([other], [0], lambda step: None, upcoming=[name])
            if not worker.returning.on_l3(name):
                break
        assert worker.returning.on_l3(name) == 0, "the prefetch did not stage it"
        assert worker.store.ahead.num_served == 4 and worker.store.step_disk_blocks == disk


def test_a_late_plans_reads_left_running_are_waited_for_at_close(tmp_path) -> None:
    """Closing after a failure with a late plan's L3 reads still running (their wait left to
    the next step) waits for them before L2 goes, and applies nothing of that plan."""
    import tpkv
    from tests.multiproc.test_engine_tiered import BT
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    class _Stop(Exception):
        pass

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=40, l2_blocks=16,
                        ssd_root=str(tmp_path), policy=PolicyConfig(cooldown_s=0.0,
                                                                    prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    worker, left = rt.worker, []
    real_late = worker.apply_late

    def apply_late() -> None:
        real_late()
        if worker._rest is not None:
            left.append(worker._rest[0])
            raise _Stop

    stopped: BaseException | None = None
    try:
        tiered = TieredEngine(rt, model, report_prefill=False, max_batch=MAX_BATCH,
                              scheduler_seed=3)
        worker.apply_late = apply_late
        with pytest.raises(_Stop) as info:
            _drive(tiered.engine)
        stopped, epoch = info.value, worker.epoch
    finally:
        rt.close(stopped)  # as an app that fails: nothing more is applied or confirmed
    assert len(left) == 1 and worker._rest is None
    assert all(job.done() for _, job in left[0].jobs)
    assert worker.epoch == epoch == left[0].plan.epoch - 1  # the plan itself was not applied
