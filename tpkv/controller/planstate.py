"""StepNeeds, PlanContext, PreparedOrders: what plan_step reads, and what it keeps across steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tpkv.config import PolicyConfig

_NO_SESSIONS = np.zeros(0, dtype=np.int64)


@dataclass
class StepNeeds:
    """What one step asks of the planner."""

    batch: np.ndarray  # session indices that run this step
    want_l1: np.ndarray  # rows of their blocks on L2/L3 that must end in L1 (demand)
    num_fresh: int  # blocks that get fresh L1 slots after the plans (new tokens, recompute)
    upcoming: np.ndarray  # session indices expected within the prefetch horizon, soonest first


@dataclass
class PlanContext:
    """Policy inputs of a step: knobs, watermarks, clock, and the hysteresis state it updates."""

    policy: PolicyConfig
    marks: dict[int, tuple[float, float]]  # (high, low) per tier
    l3_enabled: bool
    tick: int
    now_s: float  # seconds since the controller started (the cooldown clock)
    pin_threshold: float  # attention mass at or above which a block is auto-pinned
    draining: dict[int, bool] = field(default_factory=dict)
    orders: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # see orders._order
    # Orders prepared between steps (Controller.prepare), for this step's tick, or None; and
    # the sessions whose keys may differ from theirs (the batch, those changed since).
    prepared: PreparedOrders | None = None
    stale: np.ndarray = field(default_factory=lambda: _NO_SESSIONS)
    asked: dict[int, tuple[int, int]] = field(default_factory=dict)  # see orders._order
    rebuilds: dict[str, int] = field(default_factory=dict)  # from a prepared order, scanned
    # the L3 -> L2 prefetch cap RateMeter.stage_blocks measured, for a policy whose
    # prefetch_stage_max_blocks is 0 (step._plan)
    measured_stage_blocks: int = 0


@dataclass
class PreparedOrders:
    """Eviction orders made between steps (Controller.prepare) for the step at `tick`: per
    tier, the coldest sessions with blocks there, as the table was then, in the order
    orders.order ranks them at `tick` (keys of `params`: kind, w_attn, w_recency), with their
    keys, and whether that is every such session. What only the step knows (the sessions it
    forbids, the blocks it wants, counts after its own moves) is applied when the order is
    used: a rebuild in the step walks the prepared prefix (plankernels.walk_prepared) instead
    of scanning every session, and gets the same sessions in the same order, or runs the scan
    when the prefix does not reach. `changed`: sessions whose keys may have changed since
    (attention reported, opened, closed)."""

    tick: int
    params: tuple[int, float, float]
    tiers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]]
    changed: list[int] = field(default_factory=list)
    mark: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
