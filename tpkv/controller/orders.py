"""Eviction orders: the coldest sessions on a tier, cached across steps or prepared between them."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from tpkv.config import PolicyConfig
from tpkv.controller.builder import PlanBuilder
from tpkv.controller.kernels import gave_up, walk_coldest
from tpkv.controller.plankernels import (
    HEAT,
    LRU,
    LRUK,
    candidates,
    coldest_candidates,
    still_cold,
    unit_keys,
    walk_prepared,
)
from tpkv.controller.planstate import PlanContext, PreparedOrders
from tpkv.controller.policy import select_victims
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import DRAM, HBM, SSD

_NO_SESSIONS = np.zeros(0, dtype=np.int64)
_TIER_COL = {HBM: 1, DRAM: 2, SSD: 3}

Picked = tuple[np.ndarray, np.ndarray, np.ndarray]  # rows, their sessions, rows per session
Forbid = tuple[np.ndarray, np.ndarray, np.ndarray]  # flags over sessions; empty: not used
NOTHING: Picked = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64),
                     np.zeros(0, dtype=np.int64))  # read only
_NO_ROWS = np.zeros(0, dtype=np.int32)
_NO_FLAGS = np.zeros(0, dtype=bool)
_KIND = {"heat": HEAT, "lru": LRU, "lruk": LRUK}
ORDER_TTL = 16  # steps an eviction order is reused (minus sessions that ran since) for a tier


def allowed(*forbid: np.ndarray) -> Forbid:
    """Sessions may give blocks up where none of the 1..3 `forbid` flags is set (read when the
    order is made or filtered, as they are then)."""
    f = (*forbid, _NO_FLAGS, _NO_FLAGS)
    return f[0], f[1], f[2]


def _order(ctx: PlanContext, b: PlanBuilder, tier: int, need: int, forbid: Forbid,
           cache: bool) -> np.ndarray:
    """Sessions with blocks on `tier` that `forbid` allows, coldest first, holding at least
    `need` blocks there when that many exist. With `cache`, an order made for ORDER_TTL steps'
    worth is kept and reused, less sessions that ran since or left: choosing victims then
    costs O(victims) a step, not O(sessions)."""
    s, p, count = b.s, ctx.policy, b.s.counts[_TIER_COL[tier]]
    if cache:  # the step and blocks it asked for (what prepare_orders goes by)
        ctx.asked[tier] = (ctx.tick, need)
    if cache and tier in ctx.orders:
        built, units = ctx.orders[tier]
        if ctx.tick - built <= ORDER_TTL:
            units, held = still_cold(units, *forbid, count, s.run_hist[0], built)
            ctx.orders[tier] = (built, units)
            if held >= need:
                return units
    keys: _Keys = (*forbid, count, _KIND[p.kind], s.attn_sum, s.arena.length, s.run_hist[0],
            s.run_hist[-1], ctx.tick, p.w_attn, p.w_recency)
    want = need * (ORDER_TTL if cache else 1)
    units, ok = _prepared_walk(ctx, b, tier, keys, want)
    how = "prepared" if ok else "scanned"
    ctx.rebuilds[how] = ctx.rebuilds.get(how, 0) + 1
    if not ok:
        units, ok = coldest_candidates(*keys, want)
    if not ok:  # a NaN key: numpy's order of it
        cand, primary, secondary, sizes = candidates(*keys)
        units = cand[select_victims(primary, secondary, sizes, want)]
    if cache:
        ctx.orders[tier] = (ctx.tick, units)
    return units


def _params(p: PolicyConfig) -> tuple[int, float, float]:
    return _KIND[p.kind], float(p.w_attn), float(p.w_recency)


# coldest_candidates' arguments but the last: forbid flags, counts, kind, attention sums,
# lengths, latest and K-th latest runs, tick, w_attn, w_recency
_Keys = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray,
              np.ndarray, np.ndarray, int, float, float]


def _prepared_walk(ctx: PlanContext, b: PlanBuilder, tier: int, keys: _Keys,
                   want: int) -> tuple[np.ndarray, bool]:
    """coldest_candidates(*keys, want) from the prepared order of `tier`, if there is one for
    this step; (_, False) where the caller must scan (no order, or one that does not reach)."""
    prep = ctx.prepared
    if (prep is None or prep.tick != ctx.tick or tier not in prep.tiers
            or prep.params != _params(ctx.policy)):
        return _NO_SESSIONS, False
    units, primary, secondary, complete = prep.tiers[tier]
    stale = np.concatenate([ctx.stale, b.moved_sessions()])
    if len(prep.mark) < b.s.capacity:
        prep.mark = np.zeros(b.s.capacity, dtype=np.uint8)
    return walk_prepared(units, primary, secondary, complete, stale, prep.mark, *keys, want)


def l1_likely(used: int, slots: int, high: float, seen: tuple[int, int], tick: int
              ) -> tuple[bool, tuple[int, int]]:
    """Whether the step at `tick` will likely ask L1 for victims though the last did not: L1
    holds `used` blocks now, and grew by as many in the last step as it did since `seen` (tick,
    used at the last call); a step that asked nothing of L1 demoted nothing, so it grew by what
    it brought in, and the next step brings in about as much. -> (likely, the new `seen`)."""
    grew = used - seen[1] if seen[0] == tick - 1 else 0
    return used + max(grew, 0) > high * slots, (tick, used)


def likely_tiers(l1: tuple[int, int, float], l2: tuple[int, int, float],
                 seen: tuple[int, int], asked: Mapping[int, tuple[int, int]], tick: int,
                 budget: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """The tiers the step after `tick` will likely ask for victims though the step at `tick`
    did not, for prepare_orders; `l1`, `l2`: (blocks used, slots, high mark) of each. L1 where
    l1_likely says so, or where twice its growth in the last step would cross its mark (a
    step's growth varies by half: in bench/controller.py at 1M blocks one cycle's first
    demotion came 17 blocks short of l1_likely's estimate); L2 where L1 was asked at `tick`
    or is likely now and twice a step's move `budget` (what L1 demotes into it, and what L3
    stages in it besides) would take L2 over its mark (the first L2 spill of 2 cycles in
    1000 steps scanned every session).
    -> (tiers, the new `seen` of l1_likely)."""
    (used1, slots1, high1), (used2, slots2, high2) = l1, l2
    likely1, now = l1_likely(used1, slots1, high1, seen, tick)
    grew = used1 - seen[1] if seen[0] == tick - 1 else 0
    likely1 = likely1 or used1 + 2 * max(grew, 0) > high1 * slots1
    likely2 = ((likely1 or asked.get(HBM, (-1, 0))[0] == tick)
               and used2 + 2 * budget > high2 * slots2)
    return tuple(t for t, on in ((HBM, likely1), (DRAM, likely2)) if on), now


def prepare_orders(ctx: PlanContext, s: SessionTable, prepared: PreparedOrders | None,
                   force: Mapping[int, int] | None = None,
                   likely: tuple[int, ...] = ()) -> PreparedOrders:
    """The orders the step at ctx.tick is likely to rebuild (see PreparedOrders): a tier's,
    where the step before it asked that tier for victims (ctx.asked: they come in runs of
    steps, while a tier drains) and its cached order will be past ORDER_TTL then, or what is
    left of it (sessions with blocks there that did not run since) is under twice the blocks
    that step asked for. Each prefix holds 2 * ORDER_TTL times those blocks, twice what a
    rebuild for as many wants; also a tier in `likely` (predicted to be asked though the step
    before did not ask it: likely_tiers; it was asked before), sized by
    policy.max_moves_per_step (its last ask may be a bulk drain's, long ago). As a step asks
    up to that budget while a tier drains, even where its last ask was smaller (and a step
    asking more than its cached order holds scans), a cached order is enough only if it holds
    that many blocks too, and a prefix is sized by at least that many. Keeps what `prepared`
    holds for this tick already. `force` (tests): prepare these tiers, prefixes of at least
    this many blocks, whatever the step before asked."""
    p = ctx.policy
    params = _params(p)
    if prepared is None or prepared.tick != ctx.tick or prepared.params != params:
        prepared = PreparedOrders(ctx.tick, params, {})
    first, kth = s.run_hist[0], s.run_hist[-1]
    todo = ({t: (ctx.tick - 1, n) for t, n in force.items()} if force is not None
            else {**ctx.asked, **{t: (ctx.tick - 1, p.max_moves_per_step) for t in likely
                                  if t in ctx.asked}})
    for tier, (asked, need) in todo.items():
        if tier in prepared.tiers or asked != ctx.tick - 1 or need <= 0:
            continue
        count = s.counts[_TIER_COL[tier]]
        enough = 2 * need  # held by the cached order: the step most likely takes it from there
        if force is None:  # a step asks up to the move budget while a tier drains
            enough = max(enough, p.max_moves_per_step)
            need = max(need, p.max_moves_per_step)
        size = 2 * need * ORDER_TTL if force is None else need
        if tier in ctx.orders and force is None:
            built, units = ctx.orders[tier]
            if ctx.tick - built <= ORDER_TTL:
                _, held = still_cold(units, _NO_FLAGS, _NO_FLAGS, _NO_FLAGS, count, first, built)
                if held >= enough:
                    continue  # the step will most likely take its victims from the cache
        units, ok = coldest_candidates(_NO_FLAGS, _NO_FLAGS, _NO_FLAGS, count, params[0],
                                       s.attn_sum, s.arena.length, first, kth, ctx.tick,
                                       params[1], params[2], size)
        if not ok:
            continue  # a NaN key: the step scans
        primary, secondary = unit_keys(units, params[0], s.attn_sum, s.arena.length, first,
                                       kth, ctx.tick, params[1], params[2])
        complete = int(count[units].sum()) < size
        prepared.tiers[tier] = (units, primary, secondary, complete)
    return prepared


def coldest(ctx: PlanContext, b: PlanBuilder, tier: int, need: int, forbid: Forbid,
            keep_auto: bool = False, skip: np.ndarray | None = None,
            cache: bool = False) -> Picked:
    """Rows on `tier` of the coldest sessions `forbid` allows, whole sessions, until `need` rows.
    Pinned blocks stay; with keep_auto, so do blocks at or above the auto-pin threshold.
    Vectorized: the cost is one pass over the rows of the sessions it looks at."""
    t, s = b.t, b.s
    empty = NOTHING
    if need <= 0:
        return empty
    order = _order(ctx, b, tier, need, forbid, cache)
    if len(order) == 0:
        return empty
    auto = keep_auto and ctx.pin_threshold != math.inf
    # As numpy compares float32 attention with a Python float: in float32.
    threshold = np.float32(ctx.pin_threshold)
    skip = np.sort(skip) if skip is not None else _NO_ROWS
    walk = (need, tier, auto, threshold, skip, s.arena.arena, s.arena.start, s.arena.length,
            t.tier, t.pinned, t.attn)
    picked, stop, per_unit = walk_coldest(order, *walk)
    if stop == len(order) and len(picked) < need:  # picked: per_unit.sum() rows
        # Pinned blocks made a cached prefix short: look at every candidate.
        everyone = _order(ctx, b, tier, 1 << 62, forbid, cache=False)
        if len(everyone) > len(order):
            order = everyone
            picked, stop, per_unit = walk_coldest(order, *walk)
    gave, sizes = gave_up(order, stop, per_unit, tier == HBM, s.clean, b.touched_flags(),
                          s.dirty)
    return picked, gave, sizes
