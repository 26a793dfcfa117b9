"""plan_step: the moves one step needs (demand, demotions, spills, prefetch), in up to 3 phases."""

from __future__ import annotations

import math

import numpy as np

from tpkv.controller.builder import PlanBuilder
from tpkv.controller.kernels import count_either, uncopied_running
from tpkv.controller.orders import NOTHING, Picked, allowed, coldest
from tpkv.controller.planstate import PlanContext, StepNeeds
from tpkv.controller.policy import watermark_excess
from tpkv.controller.rowkernels import not_on, prefetch_rows, split_by_tier
from tpkv.controller.table import DRAM, HBM, SSD, BlockTable

MAX_PHASES = 3  # L3 -> L2, then L2 -> L1 into slots a demotion freed; a third phase for slack


def plan_step(ctx: PlanContext, b: PlanBuilder, needs: StepNeeds) -> np.ndarray:
    """Emit the step's moves through `b`; return rows of `needs.want_l1` that could not be
    brought up in MAX_PHASES phases and were dropped (the caller recomputes them)."""
    try:
        return _plan_step(ctx, b, needs)
    finally:
        b.t.pace.stepped(b.into_l2)


def _plan_step(ctx: PlanContext, b: PlanBuilder, needs: StepNeeds) -> np.ndarray:
    t, s = b.t, b.s
    protect = np.zeros(s.capacity, dtype=bool)
    protect[needs.batch] = True
    shield = protect.copy()
    shield[needs.upcoming] = True
    budget = ctx.policy.max_moves_per_step
    pending = needs.want_l1
    for phase in range(MAX_PHASES):
        b.begin_phase()
        if len(pending):
            in2, in3 = split_by_tier(pending, t.tier)
        else:
            in2 = in3 = pending
        free1 = t.num_free(HBM)
        need1 = len(in2) + len(in3) + needs.num_fresh
        room1 = max(0, need1 - free1)
        extra1 = 0
        if phase == 0:
            extra1 = _watermark(ctx, HBM, t.used(HBM) + need1, t.slots(HBM))
            extra1 = min(max(0, extra1 - room1), budget)
        victims, units, sizes = _pick_l1(ctx, b, shield, protect, room1, extra1)
        free2 = t.num_free(DRAM)
        intake = len(in3) + len(victims)  # blocks copied into L2 in this phase
        needed = len(in3) + min(len(victims), room1)  # of which the step needs (not ahead)
        # copies the step needs that would find no clean L2 slot: they would wait for the
        # disk (spills read those slots), so whole sessions leave L2 for clean slots now
        # instead (_make_l2_room). A drain ahead of need never does that: it takes the clean
        # slots only when the rest would wait (`clean_only`).
        must = _unwritten_room(ctx, t, needed) if ctx.l3_enabled else 0
        clean_only = ctx.l3_enabled and (must > 0 or _unwritten_room(ctx, t, intake) > 0)
        if clean_only:
            intake = max(needed, min(intake, t.free[DRAM].clean + t.num_kept))
        short2 = max(0, intake - free2)
        extra2 = 0
        if phase == 0 and ctx.l3_enabled:  # L1 draining goes first
            projected = t.used(DRAM) + intake - min(len(in2), free1 + len(victims))
            extra2 = _watermark(ctx, DRAM, projected, t.slots(DRAM))
            # L2 spills now, or did: blocks live in L3 (L1 and L2 do not hold the sessions)
            pressed = short2 > 0 or extra2 > 0 or t.used(SSD) > 0
            extra2 = max(0, extra2 - short2)
            spilled = 0 if must else short2  # (at need: spilled, or left for clean slots)
            # a drain spills no faster than the disk writes: a copy into L2 that finds no
            # clean slot waits for the spills queued before its slot's
            extra2 = min(extra2, t.pace.room(t.free[DRAM], spilled))
            # ahead of need: the slots this frees are clean by the time steps need them
            # but never into L3 room a session there would have to give up
            l3_room = t.num_free(SSD) - spilled - int(np.count_nonzero(s.counts[SSD + 1])) - 1
            extra2 = max(extra2, min(max(0, l3_room),
                                     t.pace.ahead(t.free[DRAM], free2, intake, spilled,
                                                  pressed)))
            extra2 = min(extra2, max(budget - extra1, budget // 4))
        _make_l2_room(ctx, b, shield, short2, extra2, budget, must)
        free2 = t.num_free(DRAM)
        if clean_only:  # this phase's copies take clean slots only; the rest go in the next
            free2 = min(free2, max(0 if must else needed, t.free[DRAM].clean + t.num_kept))
        stage = in3[:free2]
        b.move(stage, SSD, DRAM)
        demoted = victims[:free2 - len(stage)]
        b.move(demoted, HBM, DRAM)
        done = units[np.cumsum(sizes) <= len(demoted)] if len(units) else units
        s.clean[done] = True
        if len(demoted) and len(in2) > free1:
            b.free_vacated(HBM)  # the promotions below may fill what the demotions empty
        promoted = in2[:t.num_free(HBM)]
        b.move(promoted, DRAM, HBM)
        if demoted.size:
            b.events.append({"kind": "demote", "blocks": len(demoted), "sessions": len(done)})
        if phase == 0:
            _prefetch(ctx, b, needs, len(pending) - len(promoted))
        b.end_phase()
        if len(pending):
            pending = not_on(pending, t.tier, HBM)
        if len(pending) == 0 and t.num_free(HBM) >= needs.num_fresh:
            _settle(ctx, b, needs.num_fresh)
            return pending
    b.begin_phase()  # drops from here on apply after the last plan: any block may go
    b.drop(pending)  # could not be loaded in time: recompute instead
    short = needs.num_fresh + len(pending) - t.num_free(HBM)
    if short > 0:
        rows, _, _ = _pick_l1(ctx, b, protect, protect, short, 0)
        b.drop(rows)
        b.events.append({"kind": "drop_l1", "blocks": len(rows)})
    _settle(ctx, b, needs.num_fresh + len(pending))
    return pending


def _settle(ctx: PlanContext, b: PlanBuilder, fresh: int) -> None:
    """A tier keeps draining into the next step only if this step left it above its low mark
    (the per-step move budget, or too few victims, stopped it): that is the hysteresis."""
    t = b.t
    for tier in (HBM, DRAM, SSD):
        used = t.used(tier) + (fresh if tier == HBM else 0)
        target = int(math.floor(ctx.marks[tier][1] * t.slots(tier)))
        ctx.draining[tier] = ctx.draining.get(tier, False) and used > target


def _watermark(ctx: PlanContext, tier: int, used: int, slots: int) -> int:
    high, low = ctx.marks[tier]
    excess, ctx.draining[tier] = watermark_excess(used, slots, high, low,
                                                  ctx.draining.get(tier, False))
    return excess


def _pick_l1(ctx: PlanContext, b: PlanBuilder, shield: np.ndarray, protect: np.ndarray,
             room: int, extra: int) -> Picked:
    """Demotion victims: first sessions neither running nor expected soon, keeping auto pins;
    if the room this step must have is still short, expected sessions and auto pins too."""
    s = b.s
    if room + extra <= 0:
        return NOTHING
    rows, units, sizes = coldest(ctx, b, HBM, room + extra, allowed(b.touched, shield, s.clean),
                                  keep_auto=True, cache=True)
    if len(rows) < room:
        # Both passes pick among sessions untouched before the first: it picked only such
        # sessions, so untouching them again restores that state for the second.
        b.touched[units] = False
        more = coldest(ctx, b, HBM, room - len(rows), allowed(b.touched, protect), skip=rows)
        b.touched[units] = True
        rows, units, sizes = (np.concatenate([a, m]) for a, m in zip((rows, units, sizes), more))
    return rows, units, sizes


def _unwritten_room(ctx: PlanContext, t: BlockTable, intake: int) -> int:
    """spill="cost" with paced spills: how many of `intake` copies into L2 find no clean slot
    (free and read by no spill, or a kept copy given back), when they would wait longer than
    `spill_queue_s` for the disk to write the spills in flight and those at need (0 for a
    shorter wait: they are spilled). "always" lets them wait (it keeps the most)."""
    if ctx.policy.spill != "cost" or not t.pace.enabled:
        return 0
    short = max(0, intake - t.free[DRAM].clean - t.num_kept)
    return short if t.pace.would_hold(t.free[DRAM], short) else 0


def _make_l2_room(ctx: PlanContext, b: PlanBuilder, shield: np.ndarray, short: int, extra: int,
                  budget: int, must: int = 0) -> None:
    """Free L2: without L3, drop the coldest sessions' L2 blocks now; with L3, spill whole
    sessions (their slots free at the end of this phase), dropping L3 sessions if it is full.
    `must` (_unwritten_room): blocks that leave L2 now without a write, coldest whole sessions
    first (dropped, or kept spills where L3 holds their records), so that the phase's copies
    find clean slots instead of waiting for the disk; then only `extra` is spilled."""
    t = b.t
    want = max(short, must) + extra
    if want <= 0:
        return
    # Sessions whose L1 blocks go down in this phase may still spill their older L2 blocks:
    # those are other rows, and nothing has moved yet in this phase.
    forbid = allowed(shield) if len(b.segment_gone) == 0 else allowed(shield, b.segment_gone)
    rows, units, sizes = coldest(ctx, b, DRAM, want if ctx.l3_enabled else short, forbid,
                                 cache=True)
    if not ctx.l3_enabled:
        b.drop(rows)
        if len(rows):
            b.events.append({"kind": "drop_l2", "blocks": len(rows), "sessions": len(units)})
        return
    if must and len(rows):
        k = min(int(np.searchsorted(np.cumsum(sizes), must)) + 1, len(units))
        n = int(sizes[:k].sum())
        _leave_unwritten(b, rows[:n], units[:k], "the disk is behind: a spill would hold "
                                                 "the step's copies into L2")
        rows, units = rows[n:], units[k:]
        if not len(rows):
            return
    cap3 = t.slots(SSD)
    headers = _l3_headers(b, units)
    # Blocks whose records are on disk already (L3 copies) take no room
    written = uncopied_running(rows, t.l3copy) if t.keep_l3 else np.arange(1, len(rows) + 1)
    new3 = int(written[-1]) if len(rows) else 0
    room3 = max(0, new3 - t.num_free(SSD) + headers)
    if t.keep_l3:
        # Segments that hold only copies go before any block in L3, and ahead of need: down
        # to the low mark once the records pass the high one (freed room is held through this
        # step's build, so a spill that waits for it is cut short, and L2 with it)
        high, low = ctx.marks[SSD]
        records = t.used(SSD) + t.l3_other + new3
        ahead = records - int(math.floor(low * cap3)) if records > high * cap3 else 0
        if max(room3, ahead) > 0:
            room3 = max(0, room3 - _give_back_copies(b, units, max(room3, ahead)))
    excess3 = _watermark(ctx, SSD, t.used(SSD) + len(rows), cap3)
    # Sessions dropped here were counted among those in L3 (or with records there); their
    # files stay until the step is applied, so the count of headers holds.
    _drop_l3(ctx, b, shield, max(room3, min(excess3, budget)))
    rows = rows[:int(np.searchsorted(written, max(0, t.num_free(SSD) - headers), "right"))]
    b.move(rows, DRAM, SSD)
    if len(rows):
        b.events.append({"kind": "spill", "blocks": len(rows), "sessions": len(units)})


def _leave_unwritten(b: PlanBuilder, rows: np.ndarray, units: np.ndarray, why: str) -> None:
    """`rows` leave L2 with no write: those whose records L3 holds (BlockTable.l3copy) as kept
    spills (free; their slots come free when the phase ends), the others dropped (their
    slots free now; their sessions are recomputed when they return)."""
    t = b.t
    copied = t.l3copy[rows] != 0 if t.keep_l3 else np.zeros(len(rows), dtype=bool)
    b.move(rows[copied], DRAM, SSD)
    b.drop(rows[~copied])
    b.events.append({"kind": "drop_l2", "blocks": len(rows) - int(copied.sum()),
                     "kept_spills": int(copied.sum()), "sessions": len(units), "why": why})


def _l3_headers(b: PlanBuilder, units: np.ndarray) -> int:
    """L3 room, in blocks, to keep for segment headers (4 KiB each; the budget counts them and
    capacity_blocks does not): a block each, as a record is at least twice a header, for the
    sessions with blocks in L3, those a spill of `units` may start a segment for, and those whose
    files stay until this step is applied (dropped, or moved out of L3, in it; those of the last
    step are in BlockTable.l3_held). An upper bound: with sessions of hundreds of blocks it
    keeps well under 1% of L3."""
    in_l3 = b.s.counts[SSD + 1]
    on_disk = count_either(in_l3, b.s.l3_other) if b.t.keep_l3 else np.count_nonzero(in_l3)
    return int(on_disk) + len(units) + len(b.ssd_dropped) + len(b.left_l3_sessions())


def _drop_l3(ctx: PlanContext, b: PlanBuilder, shield: np.ndarray, need: int) -> None:
    """Discard whole sessions' L3 records (coldest first; none with a pinned block there)."""
    t, s = b.t, b.s
    if need <= 0:
        return
    forbid = shield | b.touched
    for si in s.pins:
        r = s.rows(si)
        if ((t.tier[r] == SSD) & (t.pinned[r] != 0)).any():
            forbid[si] = True
    rows, units, _ = coldest(ctx, b, SSD, need, allowed(forbid), cache=True)
    b.drop(rows)
    b.drop_segments(units)
    if len(rows):
        b.events.append({"kind": "drop_l3", "blocks": len(rows), "sessions": len(units)})


def _give_back_copies(b: PlanBuilder, spilling: np.ndarray, need: int) -> int:
    """Free `need` blocks of L3 room (more where the last segment holds more; less where
    there are too few) by deleting segments that hold no block only in L3 (records of
    blocks loaded back, and dead ones), those of the sessions run most recently first (a
    session run longest ago leaves L2 next, where its copies save a write); none being
    spilled now (`spilling`), none dropped or moved into or out of L3 by a plan not yet
    confirmed (a rank may still read or write it). Returns the records freed (their
    room is held through this step's build, as all room freed with copies: BlockTable.
    end_l3_step)."""
    s = b.s
    cand = np.flatnonzero((s.l3_other > 0) & (s.counts[SSD + 1] == 0)
                          & (s.l3_epoch <= b.committed_epoch))
    if len(spilling):
        cand = cand[~np.isin(cand, spilling)]
    if len(cand) == 0:
        return 0
    order = cand[np.argsort(-s.run_hist[0][cand], kind="stable")]
    freed = np.cumsum(s.l3_other[order].astype(np.int64) + 1)  # + its header block
    units = order[:int(np.searchsorted(freed, need)) + 1]
    records = int(s.l3_other[units].sum())
    b.events.append({"kind": "drop_l3_copies", "sessions": len(units), "records": records})
    b.drop_segments(units)
    return records


def _prefetch(ctx: PlanContext, b: PlanBuilder, needs: StepNeeds, still_needed: int) -> None:
    """Bring up blocks of sessions expected soon, skipping blocks in their cooldown, at most
    prefetch_max_blocks per step, and never past a tier's high watermark: those blocks would
    come up on demand a step later anyway, so this moves no more than demand would."""
    t, s, p = b.t, b.s, ctx.policy
    if len(needs.upcoming) == 0:
        return
    slots1, slots2 = t.slots(HBM), t.slots(DRAM)
    reserve = needs.num_fresh + still_needed
    room1 = min(int(math.floor(ctx.marks[HBM][0] * slots1)) - t.used(HBM) - reserve,
                t.num_free(HBM) - reserve, p.prefetch_max_blocks)
    # into clean L2 slots only (no spill still reads them): a prefetch never waits for the disk
    free2 = t.free[DRAM].clean if t.pace.enabled else t.num_free(DRAM)
    room2 = min(int(math.floor(ctx.marks[DRAM][0] * slots2)) - t.used(DRAM), free2,
                p.prefetch_max_blocks, p.prefetch_stage_max_blocks or ctx.measured_stage_blocks)
    if room1 <= 0 and room2 <= 0:
        return
    ups = needs.upcoming[~b.touched[needs.upcoming]]  # none that gave up blocks this phase
    A = s.arena  # rows out of their cooldown, soonest sessions first
    up, stage = prefetch_rows(ups, A.arena, A.start, A.length, t.tier, t.demoted_at,
                              ctx.now_s, p.cooldown_s, room1, room2)
    b.move(up, DRAM, HBM)
    b.move(stage, SSD, DRAM)
    if len(up) or len(stage):
        b.events.append({"kind": "prefetch", "sessions": len(ups), "l2_l1": len(up),
                         "l3_l2": len(stage)})
