"""One scheduled step: validate, update sessions, resolve demand, plan, allocate, block tables.

The controller runs a step in two calls and keeps its own fields itself: `check_step` refuses a
bad step changing nothing; the controller then advances its tick; `run_step` changes the table
and sessions (through `steptypes.StepContext`, what a step reads) and returns a `StepOutcome`
(what the controller keeps). Nothing here imports the controller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tpkv.controller.builder import PlanBuilder
from tpkv.controller.demand import EMPTY, demand, keep_records
from tpkv.controller.planner import MAX_PHASES, plan_step
from tpkv.controller.planstate import PlanContext, StepNeeds
from tpkv.controller.sessions import SessionTable, add_counts
from tpkv.controller.stepkernels import alloc_blocks, batch_blocks, outside, start_runs
from tpkv.controller.steptypes import CheckedStep, NamesCache, StepContext, StepOutcome
from tpkv.controller.table import DRAM, HBM, PIN_EXPLICIT
from tpkv.errors import (
    ArgumentError,
    ArgumentTypeError,
    BadRequestError,
    DuplicateSessionError,
    PlanOrderError,
    TierFullError,
)
from tpkv.limits import (
    MAX_SESSION_TOKENS,
    MAX_STEPS_AHEAD,
    check_count,
    check_counts,
)

Upcoming = Mapping[str, int] | Sequence[str] | None


def check_step(ctx: StepContext, session_ids: Sequence[str] | np.ndarray,
               num_new_tokens: Sequence[int] | np.ndarray, upcoming: Upcoming,
               rewrite: Sequence[int] | np.ndarray | None = None,
               resume: Mapping[str, str] | None = None) -> CheckedStep:
    """Controller.schedule's checks, all before anything changes (a refused step changes
    nothing but, perhaps, the table's capacity: ensure_rows)."""
    S, T, pol = ctx.sessions, ctx.table, ctx.config.policy
    bt = ctx.config.geometry.block_tokens
    batch = S.resolve(session_ids)
    add = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                       "MAX_SESSION_TOKENS", negative_ok=True)
    if len(add) != len(batch):
        raise BadRequestError(f"num_new_tokens needs {len(batch)} integers, got {len(add)}")
    code, tokens, nb_before, n_new, nb_after, missing, sum_before, new_total, sum_after = (
        batch_blocks(batch, add, S.tokens, S.pending, S.arena.length, S.counts[1], bt,
                     S.plan_local))
    if code:
        _refuse(S, batch, add)
    if len(tokens) and tokens.max() > MAX_SESSION_TOKENS:  # (each part is at most that)
        i = int(np.argmax(tokens))
        raise ArgumentError(f"session {S.name(int(batch[i]))!r} would hold {int(tokens[i])} "
                            f"tokens after this step (num_new_tokens {int(add[i])}), over "
                            f"MAX_SESSION_TOKENS ({MAX_SESSION_TOKENS})")
    again = _rewrite(S, batch, rewrite)
    choice = _resume(session_ids, batch, resume)
    up = _upcoming(ctx, upcoming, batch)
    total = sum_before + new_total
    l1 = T.slots(HBM)
    if total > l1:
        raise TierFullError(f"a step of {len(batch)} sessions needs {total} L1 slots; L1 holds "
                            f"{l1} per rank")
    held = _pinned_l1_outside(ctx, batch) if S.pins else 0
    if total + held > l1:
        raise TierFullError(f"a step of {len(batch)} sessions needs {total} L1 slots; {held} of "
                            f"L1's {l1} hold pinned blocks of other sessions")
    T.ensure_rows(new_total, pol.max_tracked_blocks)
    pending = ctx.epochs.pending
    if len(pending) + MAX_PHASES > pol.max_pending_plans:
        raise PlanOrderError(f"{len(pending)} plans await confirmation (limit "
                             f"{pol.max_pending_plans}); confirm epoch "
                             f"{pending[0].plan.epoch} first")
    return CheckedStep(batch, tokens, nb_before, n_new, nb_after, missing, new_total, sum_after,
                       up, again, choice)


def _rewrite(S: SessionTable, batch: np.ndarray, rewrite: Sequence[int] | np.ndarray | None
             ) -> np.ndarray:
    """Schedule's `rewrite`, checked: per batch session, 0 .. the tokens it holds."""
    if rewrite is None:
        return np.zeros(len(batch), dtype=np.int64)
    again = check_counts("rewrite", rewrite, MAX_SESSION_TOKENS, "MAX_SESSION_TOKENS")
    if len(again) != len(batch):
        raise BadRequestError(f"rewrite needs {len(batch)} integers, got {len(again)}")
    held = S.tokens[batch]
    if (again > held).any():
        i = int(np.flatnonzero(again > held)[0])
        raise ArgumentError(f"rewrite of session {S.name(int(batch[i]))!r}: {int(again[i])} "
                            f"tokens, more than the {int(held[i])} it holds")
    return again


_RESUME = {"load": 1, "recompute": 2}


def _resume(session_ids: Sequence[str] | np.ndarray, batch: np.ndarray,
            resume: Mapping[str, str] | None) -> np.ndarray:
    """Schedule's `resume`, checked: per batch position 0 (the cost model), 1 load or 2
    recompute."""
    out = np.zeros(len(batch), dtype=np.int8)
    if resume is None or not len(resume):
        return out
    if not isinstance(resume, Mapping):
        raise ArgumentTypeError(f"resume must map session ids to 'load' or 'recompute', got "
                                f"{type(resume).__name__}")
    pos = {name: i for i, name in enumerate(session_ids) if isinstance(name, str)}
    for name, how in resume.items():
        if how not in _RESUME:
            raise ArgumentError(f"resume[{name!r}] must be 'load' or 'recompute', got {how!r}")
        if name not in pos:
            raise BadRequestError(f"resume names session {name!r}, which is not in the step's "
                                  f"batch of {len(batch)}")
        out[pos[name]] = _RESUME[how]
    return out


def run_step(ctx: StepContext, step: CheckedStep, session_ids: Sequence[str] | np.ndarray,
             tick: int) -> StepOutcome:
    """The checked step at `tick` (the controller's, just advanced): from here on the table
    changes (an error leaves it half-changed: Controller._changing)."""
    S, T = ctx.sessions, ctx.table
    batch, tokens, new_total, n_new = step.batch, step.tokens, step.new_total, step.n_new
    tokens_before = S.tokens[batch]
    start_runs(batch, tokens, tick, S.tokens, S.pending, S.runs, S.run_hist, S.clean)
    E = ctx.epochs
    b = PlanBuilder(T, S, E.next_epoch, ctx.now_s(), ctx.check_invariants, ctx.move_buffers,
                    committed_epoch=E.committed_epoch)
    want, recompute, keep = demand(ctx, b, batch, step.missing, step.resume)
    needs = StepNeeds(batch, want, len(recompute) + new_total, step.upcoming)
    lost = EMPTY
    if _needs_planning(ctx, needs):
        lost = _plan(ctx, b, needs, tick)
    b.end_phase()
    fresh_old = (np.concatenate([recompute, lost]).astype(np.int64) if len(recompute) or len(lost)
                 else EMPTY)
    slots = T.free[HBM].pop(len(fresh_old) + new_total)
    _place_fresh(ctx, fresh_old, slots[:len(fresh_old)])
    if len(keep):
        keep_records(ctx, b, keep)
    new_rows, new_pos, new_ids, new_logical = _alloc_new(ctx, batch, n_new, step.nb_before,
                                                         slots[len(fresh_old):], tick)
    offsets, table = ctx.batch_table.build(S, T, batch, step.nb_after, step.sum_after)
    if ctx.check_invariants:
        rows, _ = S.arena.gather(batch)
        assert (T.tier[rows] == HBM).all(), "a block of the batch is not in L1"
        assert (table == T.slot[rows]).all(), "the patched batch table is stale"
    fresh_ids, fresh_pos, fresh_logical = new_ids, new_pos, new_logical
    rc_pos = rc_start = rc_stop = EMPTY
    if len(fresh_old):  # they sit first in `slots`, then the new blocks
        old_pos = _positions(batch)(T.session[fresh_old])
        old_logical = T.logical[fresh_old].astype(np.int64)
        fresh_ids = np.concatenate([T.ids(fresh_old), new_ids])
        fresh_pos = np.concatenate([old_pos, new_pos])
        fresh_logical = np.concatenate([old_logical, new_logical])
        rc_pos, rc_start, rc_stop = _ranges(old_pos, old_logical)
    if T.num_kept or T.l3_other:
        _drop_written_copies(ctx, batch, tokens_before, step.rewrite, tokens, rc_pos,
                             rc_start, keep)
    names, names_cache = _names(ctx, session_ids, batch)
    fields = dict(
        tick=tick, session_ids=names, num_tokens=tokens, block_offsets=offsets,
        block_table=table, fresh_block_ids=fresh_ids, fresh_slots=slots.astype(np.int64),
        fresh_session_idx=fresh_pos, fresh_logical=fresh_logical, recompute_session_idx=rc_pos,
        recompute_start=rc_start, recompute_stop=rc_stop)
    return StepOutcome(fields, b, names_cache)


def _drop_written_copies(ctx: StepContext, batch: np.ndarray, before: np.ndarray,
                         rewrite: np.ndarray, after: np.ndarray, rc_pos: np.ndarray,
                         rc_start: np.ndarray, keep: np.ndarray) -> None:
    """The copies of blocks this step writes are stale: the last block of a session that gets
    tokens, when it was partly filled, the blocks of tokens it writes again (`rewrite`), and
    every block from a recomputed range on (the engine feeds the session again from there),
    but for the blocks recomputed by choice that keep their L3 records (`keep`,
    keep_records). Their L2 copies are freed; their L3 copies are void (the records stay,
    dead, until their segment goes; a later spill writes them again)."""
    S, T = ctx.sessions, ctx.table
    slots = T.take_written(batch, before, rewrite, after, ctx.config.geometry.block_tokens,
                           S.arena.arena, S.arena.start, S.kept_last, S.l3_last)
    if len(rc_pos):
        rows = np.concatenate([S.arena.rows(int(batch[pos]))[start:] for pos, start in
                               zip(rc_pos.tolist(), rc_start.tolist())])
        T.l3copy[rows[~np.isin(rows, keep)] if len(keep) else rows] = 0
        more = T.take_kept(np.unique(rows))
        slots = np.concatenate([slots, more[more >= 0]])
    if len(slots):  # one group: freed slots go back in ascending order (SlotStack.push)
        T.free[DRAM].push(slots)


def _plan(ctx: StepContext, b: PlanBuilder, needs: StepNeeds, tick: int) -> np.ndarray:
    """plan_step with the controller's context; the rows it dropped (recomputed)."""
    pol = ctx.config.policy
    threshold = ctx.autopin.refresh(tick, ctx.table, ctx.sessions, ctx.eviction_orders)
    prep = ctx.prepared
    stale = (np.concatenate([needs.batch, np.asarray(prep.changed, dtype=np.int64)])
             if prep is not None and prep.tick == tick else EMPTY)
    stage = 0 if pol.prefetch_stage_max_blocks else ctx.rates.stage_blocks(
        ctx.config.geometry.block_bytes, pol.prefetch_max_blocks)
    plan = PlanContext(pol, ctx.marks, ctx.l3_enabled, tick, ctx.now_s(), threshold,
                       ctx.draining, ctx.eviction_orders, prep, stale, ctx.order_asks,
                       ctx.order_rebuilds, stage)
    return plan_step(plan, b, needs).astype(np.int64)


def _upcoming(ctx: StepContext, upcoming: Upcoming, batch: np.ndarray) -> np.ndarray:
    """Sessions expected within prefetch_steps steps, soonest first, without the batch."""
    if upcoming is None:
        return EMPTY
    if isinstance(upcoming, (str, bytes)) or not isinstance(upcoming, (Mapping, Sequence,
                                                                        np.ndarray)):
        raise ArgumentTypeError(f"upcoming must map session ids to steps ahead or list them, "
                                f"got {type(upcoming).__name__} {repr(upcoming)[:64]}")
    if not len(upcoming):
        return EMPTY
    if isinstance(upcoming, Mapping):
        steps = {name: check_count(f"upcoming[{name!r}]", k, MAX_STEPS_AHEAD, "MAX_STEPS_AHEAD")
                 for name, k in upcoming.items()}
        horizon = ctx.config.policy.prefetch_steps
        names = [n for n, k in sorted(steps.items(), key=lambda kv: kv[1]) if k <= horizon]
    else:
        for name in upcoming:
            if not isinstance(name, str):  # (unhashable ones too)
                ctx.sessions.lookup(name)
        names = list(dict.fromkeys(upcoming))  # once each, in the order given
    if not names:
        return EMPTY
    idx = ctx.sessions.resolve(names)
    return idx[outside(idx, batch, ctx.sessions.plan_local)]


def _refuse(S: SessionTable, batch: np.ndarray, add: np.ndarray) -> None:
    """Raise the error of a step that batch_blocks refused (a token count < 0, or a session
    twice), with the session it concerns."""
    if len(add) and add.min() < 0:
        i = int(np.argmin(add))
        raise ArgumentError(f"num_new_tokens must be >= 0; session {S.name(int(batch[i]))!r} "
                            f"got {int(add[i])}")
    ordered = np.sort(batch)
    dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
    raise DuplicateSessionError(f"session {S.name(dup)!r} appears twice in a step of "
                                f"{len(batch)} sessions")


def _names(ctx: StepContext, given: Sequence[str] | np.ndarray,
           batch: np.ndarray) -> tuple[tuple[str, ...], NamesCache]:
    """The batch's session ids and the names cache to keep; for handles, patched from the last
    step's tuple (a decode batch changes in a few places a step) instead of looked up 1024
    times."""
    if not isinstance(given, np.ndarray):
        return tuple(given), ctx.names_cache
    S = ctx.sessions
    # Handles were checked by resolve() (they are S.handle_of[batch]); a copy, kept below.
    handles = given.astype(np.int64) if given.dtype.kind in "iu" else S.handle_of[batch]
    prev_handles, prev_names = ctx.names_cache
    if len(prev_handles) == len(batch):
        changed = np.flatnonzero(prev_handles != handles).tolist()
        out = list(prev_names) if changed else prev_names
        for i in changed:
            out[i] = S.name(int(batch[i]))  # type: ignore[index]
    else:
        out = [S.name(i) for i in batch.tolist()]
    result = tuple(out)
    return result, (handles, result)


def _pinned_l1_outside(ctx: StepContext, batch: np.ndarray) -> int:
    T, S = ctx.table, ctx.sessions
    in_batch = set(batch.tolist())
    held = 0
    for si in S.pins:
        if si not in in_batch:
            r = S.rows(si)
            held += int(((T.pinned[r] & PIN_EXPLICIT != 0) & (T.tier[r] == HBM)).sum())
    return held


def _needs_planning(ctx: StepContext, needs: StepNeeds) -> bool:
    return _own_needs(ctx, needs) or _marks_due(ctx, needs.num_fresh)


def _own_needs(ctx: StepContext, needs: StepNeeds) -> bool:
    """The step itself needs moves: blocks to load, room in L1 for its new blocks, or
    upcoming sessions to prefetch (what the watermarks want aside)."""
    T, S = ctx.table, ctx.sessions
    if len(needs.want_l1) or T.num_free(HBM) < needs.num_fresh:
        return True
    up = needs.upcoming
    return bool(len(up) and (S.counts[1][up] < S.arena.length[up]).any())


def _marks_due(ctx: StepContext, num_fresh: int = 0) -> bool:
    """A tier is above its high watermark (L1 with `num_fresh` new blocks more), or still
    draining towards its low one."""
    T = ctx.table
    if any(ctx.draining.values()) or T.used(HBM) + num_fresh > ctx.marks[HBM][0] * T.slots(HBM):
        return True
    return ctx.l3_enabled and T.used(DRAM) > ctx.marks[DRAM][0] * T.slots(DRAM)


def _place_fresh(ctx: StepContext, rows: np.ndarray, slots: np.ndarray) -> None:
    """Rows with no copy (NONE) get L1 slots: the engine recomputes their KV there."""
    if len(rows) == 0:
        return
    ctx.table.set_tier(rows, HBM, slots, free_src=True)
    sess = ctx.table.session[rows].astype(np.int64)
    ctx.sessions.dirty[sess] = True
    S = ctx.sessions
    add_counts(S.counts, S.count_keys(0, sess), -1)
    add_counts(S.counts, S.count_keys(1, sess), 1)


def _alloc_new(ctx: StepContext, batch: np.ndarray, n_new: np.ndarray, first: np.ndarray,
               slots: np.ndarray, tick: int) -> tuple[np.ndarray, ...]:
    """Rows for the blocks new tokens open (n_new[i] for batch[i], from block first[i] on), in
    fresh L1 slots (no move: the engine writes), appended to their sessions (the batch table
    stays clean). Returns (rows, batch position, block id and logical index of each)."""
    T, S = ctx.table, ctx.sessions
    free = T.free_rows
    new = alloc_blocks(batch, n_new, first, free.stack, free.top, slots, tick, S.runs,
                       S.counts[1], T.session, T.logical, T.last_tick, T.count, T.runs_seen,
                       T.tier, T.slot, T.owner[HBM], T.gen)
    rows = new[0]
    if len(rows) == 0:
        return new
    free.top -= len(rows)  # ensure_rows made room
    T.num_in[HBM + 1] += len(rows)
    S.arena.append_new(batch, n_new, rows)
    if S.pins:
        for i in np.flatnonzero(n_new > 0).tolist():
            si, lo, n = int(batch[i]), int(first[i]), int(n_new[i])
            for start, stop in S.pins.get(si, ()):
                a, z = max(start, lo), min(stop, lo + n)
                if a < z:
                    T.pinned[S.rows(si)[a:z]] |= PIN_EXPLICIT
    return new


def _positions(batch: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A function from session indices to their positions in the batch."""
    order = np.argsort(batch, kind="stable")
    ordered = batch[order]

    def pos(sessions: np.ndarray) -> np.ndarray:
        return order[np.searchsorted(ordered, sessions)].astype(np.int64)
    return pos


def _ranges(pos: np.ndarray, logical: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs of consecutive logical blocks per batch position: (position, start, stop)."""
    if len(pos) == 0:
        return EMPTY, EMPTY, EMPTY
    order = np.lexsort((logical, pos))
    p, lg = pos[order], logical[order]
    new = np.ones(len(p), dtype=bool)
    new[1:] = (p[1:] != p[:-1]) | (lg[1:] != lg[:-1] + 1)
    starts = np.flatnonzero(new)
    stops = np.concatenate([starts[1:], [len(p)]])
    return p[starts], lg[starts], lg[stops - 1] + 1
