"""Shared cases for the pool and copy-engine tests: run on CPU in CI and on CUDA (marker gpu)."""

from __future__ import annotations

import numpy as np
import torch

from tpkv.config import HostConfig, KvGeometry
from tpkv.workers.copy_engine import CopyEngine
from tpkv.workers.pools import HbmPool, HostPool


def random_fill(t: torch.Tensor, seed: int) -> None:
    """Fill with random bits (every byte pattern, NaN payloads included) to catch any conversion."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def make_engine(geometry: KvGeometry, l1_slots: int, l2_slots: int, device: str,
                method: str = "auto", arena_blocks: int | None = None) -> CopyEngine:
    arena = (arena_blocks or l2_slots) * geometry.block_bytes
    l2 = HostConfig(budget_bytes=max(arena, l2_slots * geometry.block_bytes), arena_bytes=arena)
    return CopyEngine(HbmPool(geometry, l1_slots, device), HostPool(geometry, l2_slots, l2),
                      method=method)  # type: ignore[arg-type]


def check_round_trip(engine: CopyEngine, seed: int) -> None:
    """Random blocks L1 -> L2 (scattered, reversed order) -> L1 in other slots: bit-exact."""
    hbm, host = engine.hbm, engine.host
    rng = np.random.default_rng(seed)
    n = min(hbm.num_slots // 2, host.num_slots)
    random_fill(hbm.tensor, seed)
    expected = hbm.tensor.cpu().clone()
    src = rng.choice(hbm.num_slots, size=n, replace=False)
    mid = rng.choice(host.num_slots, size=n, replace=False)
    engine.d2h(src, mid).wait()
    for s, m in zip(src, mid):
        assert torch.equal(host.block(int(m)).view(torch.uint8),
                           expected[int(s)].view(torch.uint8)), f"L1 {s} -> L2 {m} differs"
    free = np.setdiff1d(np.arange(hbm.num_slots), src)
    dst = rng.permutation(np.concatenate([free, src]))[:n]
    hbm.tensor.zero_()
    engine.h2d(mid, dst).wait()
    back = hbm.tensor.cpu()
    for s, d in zip(src, dst):
        assert torch.equal(back[int(d)].view(torch.uint8), expected[int(s)].view(torch.uint8))
