"""Unit-test fixtures: Ray may not start here (ray.init raises), a fake clock, small configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fakes import FakeClock
from tpkv.config import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, TpkvConfig


@pytest.fixture(autouse=True, scope="module")
def _forbid_ray_init() -> Iterator[None]:
    """Unit tests start no Ray of their own: any ray.init() fails loudly (tests/ray has the
    real thing), but for the one cluster of the `transport` fixture (tests/conftest.py), which
    calls `ray.init.real_init`."""
    import ray  # imported here so that collecting unit tests never needs it

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ray.init() called from a unit test; put it under tests/ray")

    refuse.real_init = ray.init  # type: ignore[attr-defined]
    patcher = pytest.MonkeyPatch()
    patcher.setattr(ray, "init", refuse)
    yield
    patcher.undo()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_config(tmp_path: Any) -> Callable[..., TpkvConfig]:
    """Small tiers counted in blocks: make_config(l1=16, l2=32, l3=64, tp=2, kind="heat", ...).
    l3=0 disables L3. Extra keyword arguments go to PolicyConfig."""

    def make(l1: int = 16, l2: int = 32, l3: int = 64, tp: int = 2, block_tokens: int = 4,
             l1_marks: tuple[float, float] = (0.90, 0.75),
             l2_marks: tuple[float, float] = (0.85, 0.70), **policy: Any) -> TpkvConfig:
        g = KvGeometry(num_layers=1, num_kv_heads=2 * tp, head_dim=8, dtype="float16",
                       block_tokens=block_tokens, tp_size=tp)
        l3_cfg = (SsdConfig(root=str(tmp_path / "ssd"), budget_bytes=SsdConfig.budget_for(l3, g))
                  if l3 else SsdConfig())
        return TpkvConfig(
            geometry=g,
            l1=HbmConfig(num_blocks=l1, high_watermark=l1_marks[0], low_watermark=l1_marks[1]),
            l2=HostConfig(budget_bytes=l2 * tp * g.block_bytes, arena_bytes=1 << 20,
                          high_watermark=l2_marks[0], low_watermark=l2_marks[1]),
            l3=l3_cfg, policy=dataclasses.replace(PolicyConfig(), **policy))

    return make
