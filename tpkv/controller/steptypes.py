"""The step's interface: what it reads of the controller, what it accepted, what it leaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.config import TpkvConfig
from tpkv.controller.autopin import AutoPin
from tpkv.controller.batchtable import BatchTable
from tpkv.controller.builder import PlanBuilder
from tpkv.controller.cost import RateMeter
from tpkv.controller.epochs import Epochs
from tpkv.controller.planstate import PreparedOrders
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import BlockTable

NamesCache = tuple[np.ndarray, tuple[str, ...]]  # the last batch's handles and their names


@dataclass(slots=True)
class StepContext:
    """What a step reads of the controller, made by it for each step. The table, sessions,
    batch table, auto-pin threshold and the planner's caches (draining, eviction_orders,
    order_asks, order_rebuilds) are changed in place by the step; the rest is read only."""

    config: TpkvConfig
    table: BlockTable
    sessions: SessionTable
    epochs: Epochs
    batch_table: BatchTable
    rates: RateMeter
    autopin: AutoPin
    marks: dict[int, tuple[float, float]]
    l3_enabled: bool
    draining: dict[int, bool]
    eviction_orders: dict[int, tuple[int, np.ndarray]]
    order_asks: dict[int, tuple[int, int]]
    order_rebuilds: dict[str, int]
    prepared: PreparedOrders | None
    move_buffers: list[np.ndarray] | None
    names_cache: NamesCache
    check_invariants: bool
    now_s: Callable[[], float]


@dataclass(slots=True)
class CheckedStep:
    """A step check_step accepted: the batch as session indices and its block counts."""

    batch: np.ndarray
    tokens: np.ndarray  # after the step
    nb_before: np.ndarray
    n_new: np.ndarray
    nb_after: np.ndarray
    missing: np.ndarray  # positions in the batch of sessions with blocks outside L1
    new_total: int
    sum_after: int
    upcoming: np.ndarray
    rewrite: np.ndarray  # [B] tokens before the step's that it writes again (credits)
    resume: np.ndarray  # [B] int8: 0 the cost model chooses, 1 load, 2 recompute (schedule's)


@dataclass(slots=True)
class StepOutcome:
    """What a step that ran leaves for the controller: the StepResult's fields but what
    Controller.finish_step adds from `builder` (plans, drops, outbox), and its names cache."""

    fields: dict[str, Any]
    builder: PlanBuilder
    names_cache: NamesCache
