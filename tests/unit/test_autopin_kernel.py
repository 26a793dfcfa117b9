"""AutoPin's compiled threshold (kernels.pin_mass) is policy.auto_pin_threshold's, bit for bit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tpkv.config import PolicyConfig
from tpkv.controller.autopin import AutoPin
from tpkv.controller.policy import auto_pin_threshold
from tpkv.controller.table import HBM


def _masses(rng: np.random.Generator, kind: int, rows: int) -> np.ndarray:
    """Attention masses: spread, few distinct (ties), packed into a narrow range (one bucket
    of the kernel's top bits), with negatives and infinities, with NaNs and huge ones."""
    if kind == 0:
        return rng.random(rows, dtype=np.float32)
    if kind == 1:
        return rng.integers(0, 4, rows).astype(np.float32)
    if kind == 2:
        return (rng.random(rows) * 1e-3).astype(np.float32) + np.float32(1.0)
    if kind == 3:
        return np.where(rng.random(rows) < 0.3, np.float32(np.inf),
                        rng.standard_normal(rows).astype(np.float32))
    return np.where(rng.random(rows) < 0.2, np.float32(np.nan),
                    rng.random(rows, dtype=np.float32) * np.float32(1e30))


@pytest.mark.parametrize("kind", range(5))
def test_compiled_threshold_is_the_policy_threshold(kind: int) -> None:
    rng = np.random.default_rng(kind)
    for _ in range(300):
        rows, slots = int(rng.integers(1, 300)), int(rng.integers(1, 200))
        attn = _masses(rng, kind, rows)
        owner = np.full(slots, -1, dtype=np.int32)
        held = rng.choice(slots, int(rng.integers(0, min(slots, rows) + 1)), replace=False)
        owner[held] = rng.choice(rows, len(held), replace=False)
        fraction = float(rng.choice([0.0, 0.1, 0.25, 0.5, 1.0, rng.random()]))
        cap = int(rng.choice([0, 1, 3, 1000]))
        pin = AutoPin(PolicyConfig(auto_pin_fraction=fraction, max_auto_pin_blocks=cap))
        got = pin.compute(SimpleNamespace(owner={HBM: owner}, attn=attn))  # type: ignore[arg-type]
        with np.errstate(invalid="ignore"):
            want = auto_pin_threshold(attn[owner[owner >= 0]], fraction, cap)
        assert got == want or (math.isinf(got) and math.isinf(want)), (got, want)
        assert type(got) is float


def test_compiled_threshold_ties_at_the_edge() -> None:
    """Five blocks of mass 2.0 where the share is three: pinned strictly above 2.0."""
    attn = np.array([1, 2, 2, 2, 2, 2, 3], dtype=np.float32)
    owner = np.arange(7, dtype=np.int32)
    pin = AutoPin(PolicyConfig(auto_pin_fraction=0.5, max_auto_pin_blocks=100))
    got = pin.compute(SimpleNamespace(owner={HBM: owner}, attn=attn))  # type: ignore[arg-type]
    assert got == float(np.nextafter(np.float32(2.0), np.float32(np.inf)))
    assert got == auto_pin_threshold(attn, 0.5, 100)
