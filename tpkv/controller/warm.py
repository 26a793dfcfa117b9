"""Compile (or load from numba's disk cache) every kernel the controller runs, before it serves.

The controller's hot paths are numba kernels compiled on their first call. Without this, the
first step that takes a path no earlier step took (the first demotion, the first promotion
with a kept L2 copy, the first spill...) pays for its compile: up to a second on a fresh
checkout, in the middle of serving (seen in bench/e2e.py: one resume of the second round).
`warm_kernels` runs a short scripted workload on a scratch controller (made by the caller's
`make`, so this module does not import the controller) with the caller's policy and geometry and
tiny tiers, once per process and policy: every kernel gets the
argument types it gets in service. tests/unit/test_warm.py checks that workloads run after it
compile nothing more. tpkv.init runs it on a thread, so that loading numba overlaps the CUDA
context and the pinning of L2: a `warm_kernels` for a policy another thread is warming waits for
it instead of warming again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tpkv import kernel_pool, startup
from tpkv.config import HbmConfig, HostConfig, SsdConfig, TpkvConfig
from tpkv.errors import TpkvError
from tpkv.protocol.digest import plan_digest
from tpkv.protocol.plan import MoveResult, Tier

if TYPE_CHECKING:
    from tpkv.protocol.messages import StepResult

log = logging.getLogger(__name__)

_WARMED: dict[tuple[object, ...], threading.Event] = {}  # policy key -> set once warmed
_WARMED_LOCK = threading.Lock()
# make(config, clock): a Controller that does not warm up itself (the class, partly applied)
MakeController = Callable[[TpkvConfig, Callable[[], float]], Any]


def _key(config: TpkvConfig) -> tuple[object, ...]:
    """What decides which kernels (and argument types) a controller uses."""
    return (dataclasses.astuple(config.policy), config.l3.enabled, config.geometry.tp_size)


def warm_kernels(config: TpkvConfig, make: MakeController) -> float:
    """Run the scripted workload on `make(config, clock)` once per process and policy; returns
    the seconds it took (0.0 when this policy was warmed already). While another thread warms
    this policy, waits for it (and returns 0.0)."""
    key = _key(config)
    with _WARMED_LOCK:
        done = _WARMED.get(key)
        mine = done is None
        if done is None:
            done = _WARMED[key] = threading.Event()
    if not mine:
        done.wait()
        return 0.0
    started = time.perf_counter()
    kernel_pool.ensure(config)  # on a cold cache: compiled in parallel processes first
    try:
        _script(config, make)
    except TpkvError as exc:  # a workload the tiny tiers refuse: warm what ran
        log.debug("kernel warm-up stopped early: %s", exc)
    except Exception:  # an optimisation only: never what stops a controller from starting
        log.warning("kernel warm-up failed; kernels compile on first use", exc_info=True)
    finally:
        done.set()
    took = time.perf_counter() - started
    startup.add("controller_kernels", took)
    log.debug("controller kernels warm in %.2f s", took)
    return took


def _script(config: TpkvConfig, make: MakeController) -> None:
    g = config.geometry
    bt, tp, bb = g.block_tokens, g.tp_size, g.block_bytes
    l3 = (dataclasses.replace(config.l3, budget_bytes=SsdConfig.budget_for(24, g))
          if config.l3.enabled else config.l3)
    small = dataclasses.replace(
        config, l1=HbmConfig(num_blocks=8),
        l2=HostConfig(budget_bytes=10 * tp * bb, arena_bytes=10 * bb, pin="never"), l3=l3)
    now = [0.0]
    c = make(small, lambda: now[0])
    names = [f"warm-{i}" for i in range(6)]
    for n in names:
        c.open_session(n, 2 * bt + 1)  # three blocks, the last part full

    def confirm(res: StepResult | None, miss: bool = False) -> None:
        for p in () if res is None else res.plans:
            reads = p.block_ids[p.src_tier == int(Tier.SSD)]
            lost = reads[:1] if miss else reads[:0]
            c.commit([MoveResult(p.epoch, r, p.num_moves, plan_digest(p, lost),
                                 miss_block_ids=lost) for r in range(tp)])

    for step in range(48):
        now[0] += 7.0
        n, other = names[step % 6], names[(step + 3) % 6]
        batch = [n, other] if step % 5 == 0 else [n]
        upcoming = {names[(step + 1) % 6]: 1} if step % 3 else [names[(step + 2) % 6]]
        res = c.schedule(batch, [1 + step % 3] * len(batch), upcoming)
        confirm(res, miss=step % 11 == 7)
        if step == 0:  # (tiny tiers may stop the script early)
            c.sessions.arena.make_room(1)  # a compaction (arena.compact_extents), due or not
        c.prepare()
        s = c.sessions.lookup(n)
        c.report_attention(n, np.linspace(0.0, 1.0, c.sessions.nblocks(s)))
        if step == 20:
            c.pin(other, 0, 1)
        elif step == 26:
            c.unpin(other)
        elif step == 30:
            c.mark_lost(c.table.ids(c.sessions.rows(s))[:1])
        elif step == 36:
            c.close_session(names[5])
            c.open_session(names[5], bt)
    c.report_prefill(num_tokens=4 * bt, seconds=0.01)
    c.snapshot()
    c.resync()
