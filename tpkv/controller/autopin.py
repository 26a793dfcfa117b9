"""AutoPin: the attention mass over which L1 blocks are kept, recomputed at most every N steps."""

from __future__ import annotations

import math

import numpy as np

from tpkv.config import PolicyConfig
from tpkv.controller.kernels import pin_mass
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import HBM, BlockTable


class AutoPin:
    """The auto-pin threshold (policy.auto_pin_fraction of L1 by mass, at most
    max_auto_pin_blocks; inf: none pinned), refreshed when attention was reported since and
    auto_pin_refresh_steps have passed since the last refresh."""

    def __init__(self, policy: PolicyConfig) -> None:
        self.policy = policy
        self.threshold = math.inf
        self.dirty = False  # attention reported since the last refresh
        self.tick = -(1 << 40)  # of the last refresh
        self.scratch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # pin_mass's

    def refresh(self, tick: int, table: BlockTable, sessions: SessionTable,
                orders: dict[int, tuple[int, np.ndarray]]) -> float:
        """Recompute the threshold over L1 if due; -> the threshold. A new one makes every
        session's eviction key stale (sessions.clean) and the cached eviction `orders`."""
        pol = self.policy
        if not self.dirty or tick - self.tick < pol.auto_pin_refresh_steps:
            return self.threshold
        threshold = self.compute(table)
        if threshold != self.threshold:
            sessions.clean[:] = False
            orders.clear()
        self.threshold, self.dirty, self.tick = threshold, False, tick
        return threshold

    def compute(self, table: BlockTable) -> float:
        """policy.auto_pin_threshold(attention of L1's blocks, ...), the same float, in one
        compiled pass over L1's owner map (kernels.pin_mass: 0.3 ms at 131K L1 slots where the
        gather and np.partition took 0.9, each refresh inside a step)."""
        pol, owner = self.policy, table.owner[HBM]
        if self.scratch is None or len(self.scratch[0]) != len(owner):
            self.scratch = (np.empty(len(owner), dtype=np.int32),
                            np.empty(1 << 15, dtype=np.int32), np.empty(1 << 16, dtype=np.int32))
        bits, ties = pin_mass(owner, table.attn, table.attn.view(np.int32),
                              float(pol.auto_pin_fraction), int(pol.max_auto_pin_blocks),
                              *self.scratch)
        if bits < 0:
            return math.inf
        threshold = float(np.array(bits, dtype=np.int32).view(np.float32))
        if ties:  # more blocks than the share at the edge: pin strictly above it
            threshold = float(np.nextafter(np.float32(threshold), np.float32(np.inf)))
        return threshold

    def rebase(self, shift: int) -> None:
        """The controller's ticks moved down by `shift`."""
        self.tick -= shift
