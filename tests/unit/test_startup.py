"""tpkv.init's start-up: it reports where its time goes (tpkv.startup), and numba's kernels load
on a thread while the tiers are set up (the first L2 arena's pinning waits in C on the GPU
machine: 0.4-0.6 s a GiB), not before them."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tpkv.config import HbmConfig, HostConfig, KvGeometry, TpkvConfig
from tpkv.workers import cuda_rt

GEO = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def _config(pin: str = "auto") -> TpkvConfig:
    return TpkvConfig(geometry=GEO, l1=HbmConfig(num_blocks=8),
                      l2=HostConfig(budget_bytes=16 * GEO.block_bytes,
                                    arena_bytes=4 * GEO.block_bytes, pin=pin))


def test_init_reports_where_its_time_goes() -> None:
    import tpkv
    from tpkv import startup

    t = time.perf_counter()
    rt = tpkv.init(_config(), controller="local", device="cpu")
    wall = time.perf_counter() - t
    try:
        times = startup.times()
    finally:
        rt.close()
    foreground = ("cuda_context", "process_groups", "worker", "controller", "runtime")
    assert set(foreground) | {"l1_alloc", "l2_map"} <= set(times), times
    assert all(v >= 0.0 for v in times.values()), times
    assert sum(times[k] for k in foreground) <= wall + 1e-3, (times, wall)
    assert times["l1_alloc"] <= times["worker"], times


def test_kernels_load_while_the_first_l2_arena_is_pinned(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    """The controller's warm-up waits (up to 20 s) for the first arena's pinning to start, and
    that pinning waits for the warm-up to end: both finish only if they run at the same time
    (before, the Controller warmed its kernels before the Worker pinned anything)."""
    import tpkv
    from tpkv.controller import warm

    monkeypatch.setattr(warm, "_WARMED", type(warm._WARMED)())  # this process may have warmed it
    pin_started, warm_done = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}
    script = warm._script

    def slow_script(*args: Any) -> None:
        seen["pin started during the warm-up"] = pin_started.wait(20)
        try:
            script(*args)
        finally:  # also when the tiny tiers refuse the script part-way (warm_kernels logs it)
            warm_done.set()

    registered: list[int] = []

    def register(ptr: int, num_bytes: int) -> None:
        pin_started.set()
        if not registered:  # the first arena, pinned inside tpkv.init
            seen["warm-up ended during the pin"] = warm_done.wait(20)
        registered.append(ptr)

    monkeypatch.setattr(warm, "_script", slow_script)
    monkeypatch.setattr(cuda_rt, "host_register", register)
    monkeypatch.setattr(cuda_rt, "host_unregister", lambda ptr: None)
    rt = tpkv.init(_config(pin="always"), controller="local", device="cpu")
    try:
        rt.worker.host.wait_pinned(10)
    finally:
        rt.close()
    assert seen == {"pin started during the warm-up": True,
                    "warm-up ended during the pin": True}, seen
    assert len(registered) == 4
