"""Returning turns wait outside the batch while their L3 records are read ahead (models/returns.py):
the batch never waits for the disk, and the tokens are those of an engine without tiers."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

SLOW_S = 1.0  # each read job on the slowed disk
PROMPTS = {f"s{i}": list(range(7 * i, 7 * i + 40)) for i in range(6)}


def _open(ssd_root: str | None, controller: str = "local", **policy: Any) -> tuple[Any, Any]:
    import tpkv
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    # a prefill speed that makes every resume a load (never a recompute)
    cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=36, l2_blocks=16,
                        ssd_root=ssd_root,
                        policy=PolicyConfig(cooldown_s=0.0, **{"prefill_tokens_per_s": 10.0,
                                                               **policy}))
    return tpkv.init(cfg, controller=controller, device="cpu"), model


def _script(engine: Any, between: Any = None) -> dict[str, list[tuple[int, ...]]]:
    """Six sessions take a turn each, one after another; then s5 decodes a long turn and s0
    returns beside it (`between(engine)` runs in between: the caller times the steps)."""
    got: dict[str, list[tuple[int, ...]]] = {}

    def finish(done: list[Any]) -> None:
        for f in done:
            got.setdefault(f.session, []).append(f.token_ids)

    for name, prompt in PROMPTS.items():
        engine.add_turn(name, prompt, 2)
        finish(engine.run())
    engine.add_turn("s5", [3, 1, 4], 24)
    finish(engine.step())  # its prefill
    engine.add_turn("s0", [2, 7, 1], 4)
    if between is not None:
        finish(between(engine))
    finish(engine.run())
    return got


def test_a_turn_back_from_l3_never_stalls_the_batch(tmp_path: Any, transport: str) -> None:
    from tpkv.models.engine import PagedEngine
    from tpkv.models.tiered import TieredEngine
    from tpkv.protocol.plan import Tier

    rt_ref, model = _open(None)
    rt_ref.close()
    big = torch.zeros(256, *rt_ref.worker.hbm.tensor.shape[1:])
    want = _script(PagedEngine(model, big))

    rt, model = _open(str(tmp_path), transport)
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        store = rt.worker.store
        real_read = store._sessions.read

        def slow_read(*args: Any) -> Any:
            time.sleep(SLOW_S)
            return real_read(*args)

        timeline: list[tuple[float, bool]] = []  # (step seconds, s0 still outside the batch)

        def between(engine: Any) -> list[Any]:
            on_l3 = rt.worker.mirror.session_logical("s0", int(Tier.SSD))
            assert len(on_l3) > 0, "the set-up should have spilled s0 to L3"
            store._sessions.read = slow_read  # every disk read from now on is slow
            done: list[Any] = []
            began = time.perf_counter()
            while any(s.session == "s0" for s in engine.returning + engine.arrived):
                t0 = time.perf_counter()
                done += engine.step()
                timeline.append((time.perf_counter() - t0,
                                 any(s.session == "s0" for s in engine.returning)))
                assert time.perf_counter() - began < 30
            return done

        got = _script(tiered.engine, between)
        outside = [t for t, out in timeline if out]
        # s5 decoded while s0's records were read, and no step waited for the disk
        assert len(outside) >= 2 and max(outside) < SLOW_S / 2, timeline
        assert sum(t for t, _ in timeline) >= SLOW_S
        # the step that loaded s0 took its blocks from memory, not from the slow disk
        assert store.ahead.num_served > 0 and tiered.returns.num_read_ahead >= 1
        assert store.ahead.held_bytes == 0
        assert got == want
    finally:
        rt.close()


def test_a_turn_the_gpu_recomputes_sooner_than_the_disk_reads_goes_straight_in(
        tmp_path: Any) -> None:
    """A disk (as first estimated) far slower than prefill: s0 is recomputed at once, beside
    s5's decode, and nothing is read ahead."""
    from tpkv.models.engine import PagedEngine
    from tpkv.models.tiered import TieredEngine

    rt, model = _open(str(tmp_path), ssd_read_bytes_per_s=1e3, prefill_tokens_per_s=1e9,
                      spill="always")
    try:
        big = torch.zeros(256, *rt.worker.hbm.tensor.shape[1:])
        want = _script(PagedEngine(model, big))
        tiered = TieredEngine(rt, model, report_prefill=False)
        got = _script(tiered.engine)
        r = tiered.returns
        assert r.num_recomputed >= 1 and r.num_read_ahead == 0, (r.num_recomputed,
                                                                 r.num_read_ahead)
        assert tiered.stats.recompute_tokens > 0 and not r.recompute
        assert got == want
    finally:
        rt.close()


def test_a_turn_with_nothing_on_l3_goes_straight_in(tmp_path: Any) -> None:
    from tpkv.models.tiered import TieredEngine

    rt, model = _open(str(tmp_path))
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        e = tiered.engine
        e.add_turn("a", list(range(10)), 2)
        e.step()
        assert [s.session for s in e.running] == ["a"] and not e.returning
        assert tiered.returns.num_read_ahead == 0
        e.run()
    finally:
        rt.close()


def test_a_busy_session_is_refused_wherever_its_turn_waits() -> None:
    from tpkv.errors import BadRequestError
    from tpkv.models.engine import PagedEngine
    from tpkv.models.llama import build_model

    model = build_model("tiny", seed=0, device="cpu")
    kv = model.kv_geometry(tp_size=1, block_tokens=4)
    pool = torch.zeros(64, kv.num_layers, 2, 4, kv.num_kv_heads, kv.head_dim)
    engine = PagedEngine(model, pool, admit=lambda new, back, idle: [])  # lets nobody in
    engine.add_turn("a", [1, 2, 3], 2)
    with pytest.raises(BadRequestError, match="in progress"):
        engine.add_turn("a", [4], 1)
    assert engine.step() == [] and [s.session for s in engine.returning] == ["a"]
    with pytest.raises(BadRequestError, match="in progress"):
        engine.close_session("a")
    engine.admit = lambda new, back, idle: [*back, *new]
    [done] = engine.run()
    assert done.session == "a" and len(done.token_ids) == 2 and not engine.returning
