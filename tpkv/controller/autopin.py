"""AutoPin: the attention mass over which L1 blocks are kept, recomputed at most every N steps."""

from __future__ import annotations

import math

import numpy as np

from tpkv.config import PolicyConfig
from tpkv.controller.policy import auto_pin_threshold
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

    def refresh(self, tick: int, table: BlockTable, sessions: SessionTable,
                orders: dict[int, tuple[int, np.ndarray]]) -> float:
        """Recompute the threshold over L1 if due; -> the threshold. A new one makes every
        session's eviction key stale (sessions.clean) and the cached eviction `orders`."""
        pol = self.policy
        if not self.dirty or tick - self.tick < pol.auto_pin_refresh_steps:
            return self.threshold
        owner = table.owner[HBM]
        attn = table.attn[owner[owner >= 0]]
        threshold = auto_pin_threshold(attn, pol.auto_pin_fraction, pol.max_auto_pin_blocks)
        if threshold != self.threshold:
            sessions.clean[:] = False
            orders.clear()
        self.threshold, self.dirty, self.tick = threshold, False, tick
        return threshold

    def rebase(self, shift: int) -> None:
        """The controller's ticks moved down by `shift`."""
        self.tick -= shift
