"""Shared cases for the pool and copy-engine tests: run on CPU in CI and on CUDA (marker gpu)."""

from __future__ import annotations

from typing import Any

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
                method: Any = "auto", arena_blocks: int | None = None,
                kernel_args: dict[str, int] | None = None) -> CopyEngine:
    arena = (arena_blocks or l2_slots) * geometry.block_bytes
    l2 = HostConfig(budget_bytes=max(arena, l2_slots * geometry.block_bytes), arena_bytes=arena)
    return CopyEngine(HbmPool(geometry, l1_slots, device), HostPool(geometry, l2_slots, l2),
                      method=method, kernel_args=kernel_args)


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


def check_tier_round_trip(engine: CopyEngine, store, seed: int, session: str) -> None:  # noqa: ANN001
    """Random blocks L1 -> L2 -> L3 -> L2 -> L1, other slots at every hop: bit-exact end to end."""
    hbm, host = engine.hbm, engine.host
    rng = np.random.default_rng(seed)
    n = min(hbm.num_slots, host.num_slots) // 2
    random_fill(hbm.tensor, seed)
    expected = hbm.tensor.cpu().clone()
    l1_src = rng.choice(hbm.num_slots, size=n, replace=False)
    l2_a = rng.choice(host.num_slots, size=n, replace=False)
    engine.d2h(l1_src, l2_a).wait()
    logical = rng.permutation(n).astype(np.int64)  # logical index of each block in the session
    store.write_blocks(session, logical, [host.block_bytes_view(int(s)) for s in l2_a])
    assert store.commit_manifest(session)
    for arena in host.arenas:
        arena.view(torch.uint8).fill_(0x5A)  # nothing stale can pass for a hit
    l2_b = rng.permutation(host.num_slots)[:n]
    order = rng.permutation(n)  # read back in another order than written
    hits = store.read_blocks(session, logical[order],
                             [host.block_bytes_view(int(l2_b[i])) for i in order])
    assert hits.all(), f"{(~hits).sum()} of {n} blocks missed"
    hbm.tensor.zero_()
    l1_dst = rng.permutation(hbm.num_slots)[:n]
    engine.h2d(l2_b, l1_dst).wait()
    back = hbm.tensor.cpu()
    for i in range(n):
        assert torch.equal(back[int(l1_dst[i])].view(torch.uint8),
                           expected[int(l1_src[i])].view(torch.uint8)), f"block {i} differs"
