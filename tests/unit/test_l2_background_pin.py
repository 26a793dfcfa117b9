"""L2 pinned in the background: the pool is usable at once, copies wait for their arena, the
controller hands out only pinned slots, and a refused arena shrinks L2 instead of failing."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.faults.engine_run import drive, tiny_model_and_reference, tiny_tiers
from tpkv.config import HostConfig, KvGeometry
from tpkv.errors import SlotError
from tpkv.protocol.plan import Tier
from tpkv.workers import cuda_rt
from tpkv.workers.pools import HostPool

GEO = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


class FakePinning:
    """Stands in for cudaHostRegister: each arena takes `delay_s`; arena `fail_at` is refused;
    `gate` (when set) holds every arena after the first until released."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = -1, gate: bool = False) -> None:
        self.delay_s, self.fail_at = delay_s, fail_at
        self.gate = threading.Event()
        if not gate:
            self.gate.set()
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.lock = threading.Lock()
        self.calls = 0

    def register(self, ptr: int, num_bytes: int) -> None:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if not first:
            self.gate.wait(10)
        time.sleep(self.delay_s)
        with self.lock:
            if len(self.registered) == self.fail_at:
                raise cuda_rt.DeviceError("cudaHostRegister: out of memory (fake)")
            self.registered[ptr] = num_bytes

    def unregister(self, ptr: int) -> None:
        with self.lock:
            assert ptr in self.registered, "unregistered an arena that was never registered"
            self.unregistered.append(ptr)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePinning]:
    f = FakePinning()
    monkeypatch.setattr(cuda_rt, "host_register", f.register)
    monkeypatch.setattr(cuda_rt, "host_unregister", f.unregister)
    yield f


def pool(num_slots: int = 40, per_arena: int = 4) -> HostPool:
    return HostPool(GEO, num_slots, HostConfig(budget_bytes=num_slots * GEO.block_bytes,
                                               arena_bytes=per_arena * GEO.block_bytes,
                                               pin="always"))


def test_the_pool_returns_with_one_arena_pinned_and_pins_the_rest_in_order(
        fake: FakePinning) -> None:
    fake.gate.clear()  # every arena after the first waits
    p = pool()
    try:
        assert p.ready_slots == 4 and p.pinning and len(fake.registered) == 1
        p.await_pinned(np.array([0, 3]))  # pinned already: returns at once
        waiter_done = threading.Event()

        def copy_into_arena_5() -> None:
            p.slot_ptrs(np.array([1, 21]))  # a copy's addresses: waits for arena 5
            waiter_done.set()

        t = threading.Thread(target=copy_into_arena_5)
        t.start()
        time.sleep(0.2)
        assert not waiter_done.is_set(), "a copy used an arena before it was pinned"
        fake.gate.set()
        assert p.wait_pinned(10) == 40
        t.join(10)
        assert waiter_done.is_set() and not p.pinning
        assert len(fake.registered) == 10 and p.pinned_bytes == sum(fake.registered.values())
    finally:
        p.close()
    assert sorted(fake.unregistered) == sorted(fake.registered)
    assert p.ready_slots == 0


def test_a_refused_arena_shrinks_l2_with_a_warning(fake: FakePinning,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake.fail_at = 6  # the seventh registration is refused (arenas register several at once)
    with caplog.at_level(logging.WARNING, logger="tpkv.workers.pools"):
        p = pool()
        try:
            ready = p.wait_pinned(10)
            assert p.pin_error is not None
            k = int(re.match(r"arena (\d+):", p.pin_error).group(1))  # type: ignore[union-attr]
            assert 1 <= k <= 6 and ready == 4 * k  # the prefix before the refused arena
            with pytest.raises(SlotError, match=f"arena {k}, not pinned"):
                p.await_pinned(np.array([4 * k + 1]))
            p.await_pinned(np.array([4 * k - 1]))
        finally:
            p.close()
    assert any(f"pinning stopped at arena {k} of 10" in r.getMessage() for r in caplog.records)
    assert sorted(fake.unregistered) == sorted(fake.registered)  # incl. any pinned past it


def test_a_refused_first_arena_leaves_l2_empty_with_a_warning(
        fake: FakePinning, caplog: pytest.LogCaptureFixture) -> None:
    fake.fail_at = 0
    with caplog.at_level(logging.WARNING, logger="tpkv.workers.pools"):
        p = pool()
    try:
        assert p.ready_slots == 0 and not p.pinning and p.wait_pinned(1) == 0
        assert p.pin_error is not None and p.pin_error.startswith("arena 0:")
        assert fake.registered == {} and p.pinned_bytes == 0
        with pytest.raises(SlotError, match="arena 0, not pinned"):
            p.slot_ptrs(np.array([0]))
    finally:
        p.close()
    assert fake.unregistered == []
    assert any("refused the first arena" in r.getMessage() and "0 of 40 slots" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.mark.parametrize("l3", [True, False], ids=["l3", "no-l3"])
def test_a_start_whose_first_arena_is_refused_serves_from_l1(fake: FakePinning, tmp_path: Path,
                                                             l3: bool) -> None:
    """TP 1 tiered engine whose every L2 arena is refused: tpkv.init still returns, the
    controller plans with 0 L2 slots (no move names L2), and the tokens equal a large L1."""
    import tpkv
    from tpkv.config import SsdConfig
    from tpkv.models.tiered import TieredEngine

    fake.fail_at = 0
    model, ref = tiny_model_and_reference()
    cfg = tiny_tiers(model, str(tmp_path / "l3"))
    cfg = dataclasses.replace(cfg, l2=dataclasses.replace(
        cfg.l2, arena_bytes=2 * cfg.geometry.block_bytes, pin="always"),
        l3=cfg.l3 if l3 else SsdConfig())
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        ctl = rt.controller
        tiers: list[np.ndarray] = []  # src and dst tiers of every planned move
        schedule = ctl.schedule

        def watched(*args: Any, **kwargs: Any) -> Any:
            res = schedule(*args, **kwargs)
            for p in () if res is None else res.plans:
                tiers.extend([p.src_tier, p.dst_tier])
            return res

        ctl.schedule = watched  # type: ignore[method-assign]
        assert rt.worker.host.ready_slots == 0
        out = drive(TieredEngine(rt, model, report_prefill=False).engine)
        assert out == ref
        assert ctl.table.slots(Tier.DRAM) == 0 and ctl.event_counts["drop_l1"] > 0
        assert not any((t == int(Tier.DRAM)).any() for t in tiers), tiers
        ctl.check_integrity()
    finally:
        rt.close()
    assert fake.registered == {}


def test_close_while_pinning_stops_and_unpins_what_was_pinned(fake: FakePinning) -> None:
    fake.delay_s = 0.02
    p = pool(num_slots=400)
    p.close()
    assert sorted(fake.unregistered) == sorted(fake.registered)
    assert len(fake.registered) < 100


def test_the_controller_hands_out_only_online_l2_slots(make_config: Any) -> None:
    from tpkv.controller import Controller

    c = Controller(make_config(l1=4, l2=16))
    T = c.table
    assert T.slots(Tier.DRAM) == 16
    assert c.set_l2_online(4) == 4  # nothing used yet: may shrink
    T.check_integrity()
    got = T.free[Tier.DRAM].pop(4)
    assert sorted(got.tolist()) == [0, 1, 2, 3]
    with pytest.raises(Exception, match="L2 needs 1 slots, 0 free of 4"):
        T.free[Tier.DRAM].pop(1)
    T.free[Tier.DRAM].push(got)
    assert c.set_l2_online(10) == 10
    T.check_integrity()
    assert sorted(T.free[Tier.DRAM].pop(10).tolist()) == list(range(10))


def test_a_shrink_over_used_slots_is_refused(make_config: Any) -> None:
    from tpkv.controller import Controller

    c = Controller(make_config(l1=4, l2=16))
    T = c.table
    taken = T.free[Tier.DRAM].pop(8)  # slots 0..7 held (as a plan under construction would)
    assert c.set_l2_online(4) == 16  # slots past 4 are not all free: unchanged
    T.free[Tier.DRAM].push(taken)
    T.check_integrity()


def test_engine_tokens_are_exact_while_l2_comes_online(fake: FakePinning, tmp_path: Path,
                                                       transport: str) -> None:
    """TP 1 tiered engine whose L2 arenas (2 blocks each) are pinned slowly in the background:
    the controller's L2 grows step by step, every L2 slot a plan names is pinned on the rank
    when its copy runs (await_pinned would raise otherwise), and the tokens equal a large L1.
    Through the actor (where the news of L2 goes with the commits, through another client)
    the controller's L2 is read after each step's plans, from its snapshot."""
    import tpkv
    from tpkv.models.tiered import TieredEngine

    fake.delay_s = 0.05
    fake.gate.clear()  # arenas after the first wait until the first schedule
    model, ref = tiny_model_and_reference()
    cfg = tiny_tiers(model, str(tmp_path / "l3"))
    cfg = dataclasses.replace(cfg, l2=dataclasses.replace(
        cfg.l2, arena_bytes=2 * cfg.geometry.block_bytes, pin="always"))
    rt = tpkv.init(cfg, controller=transport, device="cpu")
    try:
        host, ctl = rt.worker.host, rt.controller
        seen: list[int] = []
        if transport == "local":
            schedule = ctl.schedule

            def watched(*args: Any, **kwargs: Any) -> Any:
                seen.append(ctl.table.slots(Tier.DRAM))
                fake.gate.set()
                return schedule(*args, **kwargs)

            ctl.schedule = watched  # type: ignore[method-assign]
        else:
            begin = rt.begin_step

            def begin_watched(*args: Any, **kwargs: Any) -> Any:
                fake.gate.set()
                step = begin(*args, **kwargs)
                seen.append(int(rt.link.call("snapshot")["tiers"]["L2"]["slots"]))
                return step

            rt.begin_step = begin_watched  # type: ignore[method-assign]
        assert host.ready_slots < host.num_slots  # the run starts with L2 still being pinned
        out = drive(TieredEngine(rt, model, report_prefill=False).engine)
        assert out == ref
        assert seen[0] < host.num_slots and seen == sorted(seen)  # grew, never shrank
        assert seen[-1] == host.num_slots == host.ready_slots
        rt.settle_ahead()
        rt.link.call("check_integrity")
    finally:
        rt.close()
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_close_in_the_background_returns_before_the_release(fake: FakePinning) -> None:
    from tpkv.workers.pools import wait_released

    p = pool()
    assert p.wait_pinned(10) == 40
    hold = threading.Event()
    unregister = fake.unregister

    def slow_unregister(ptr: int) -> None:
        hold.wait(10)
        unregister(ptr)

    fake.unregister = slow_unregister  # type: ignore[method-assign]
    cuda_rt.host_unregister = slow_unregister  # the fixture's monkeypatch undoes this too
    t = time.perf_counter()
    p.close(background=True)
    assert time.perf_counter() - t < 1.0 and fake.unregistered == []  # nothing released yet
    assert p.pinned_bytes == 0 and p.ready_slots == 0  # the pool is closed at once
    assert not wait_released(0.1)
    hold.set()
    assert wait_released(10)
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_the_rest_of_l2_is_pinned_once_init_has_loaded_its_kernels(fake: FakePinning) -> None:
    """While tpkv.init loads numba's kernels (startup.hold_quiet), only the first arena is
    pinned; the rest follow once the load is done (startup.end_quiet)."""
    from tpkv import startup

    startup.hold_quiet()
    try:
        p = pool()
        time.sleep(0.3)
        assert p.ready_slots == 4 and len(fake.registered) == 1  # waits for the kernels
    finally:
        startup.end_quiet()
    try:
        assert p.wait_pinned(10) == 40 and len(fake.registered) == 10
    finally:
        p.close()
