"""Controller: the one owner of the block table; every placement decision is made here."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from tpkv.config import KvGeometry, TpkvConfig
from tpkv.controller import gcpause, recovery
from tpkv.controller import sessioncalls as calls
from tpkv.controller.autopin import AutoPin
from tpkv.controller.batchtable import BatchTable
from tpkv.controller.builder import PlanBuilder
from tpkv.controller.capture import Capture, capture
from tpkv.controller.cost import RateMeter
from tpkv.controller.epochs import Epochs, PendingPlan
from tpkv.controller.orders import likely_tiers, prepare_orders
from tpkv.controller.planstate import PlanContext, PreparedOrders
from tpkv.controller.sessions import SessionTable
from tpkv.controller.snapshot import session_blocks
from tpkv.controller.spillpace import SpillPacer
from tpkv.controller.step import Upcoming, check_step, run_step
from tpkv.controller.steptypes import StepContext
from tpkv.controller.table import BlockTable
from tpkv.controller.validate import check_policy, check_rank
from tpkv.controller.warm import warm_kernels
from tpkv.errors import ControllerRecoveringError
from tpkv.limits import MAX_STEP_TOKENS, check_count, check_counts, check_seconds
from tpkv.protocol.messages import CommitOutcome, StepResult
from tpkv.protocol.plan import MoveResult, Tier

log = logging.getLogger(__name__)
T = TypeVar("T")

_TICK_LIMIT = 1 << 30  # ticks are int32 in the table; rebased long before they overflow


class Controller:
    """Block table, sessions, policy and plans of one node. No Ray, no torch: `actor.py` wraps it.

    `clock` returns seconds (monotonic); tests pass a fake one. Every method either applies in
    full or raises a typed error (tpkv.errors) with the table unchanged.
    """

    def __init__(self, config: TpkvConfig, clock: Callable[[], float] = time.monotonic, *,
                 restarts: int = 0, awaiting_rebuild: bool = False,
                 table_capacity: int | None = None, check_invariants: bool = False,
                 warm: bool = True) -> None:
        pol, g = config.policy, config.geometry
        check_policy(pol)
        self.config = config
        self.clock = clock
        self.started_s = clock()
        self.l3_enabled = config.l3.enabled
        l1, l2 = config.l1.slots(g), config.l2.slots_per_rank(g)
        l3 = config.l3.capacity_blocks(g) if self.l3_enabled else 0
        self.marks: dict[int, tuple[float, float]] = {
            Tier.HBM: (config.l1.high_watermark, config.l1.low_watermark),
            Tier.DRAM: (config.l2.high_watermark, config.l2.low_watermark),
            Tier.SSD: (config.l3.high_watermark, config.l3.low_watermark)}
        capacity = table_capacity or min(l1 + l2 + l3 + 1024, 1 << 20)
        self.table = BlockTable(l1, l2, l3, pol.lru_k, min(capacity, pol.max_tracked_blocks),
                                self.l3_enabled)
        self.table.pace = SpillPacer(pol, g.block_bytes, self.l3_enabled)
        self.sessions = SessionTable(pol.lru_k)
        self.batch_table = BatchTable()
        self.names_cache: tuple[np.ndarray, tuple[str, ...]] = (np.zeros(0, np.int64), ())
        self.move_buffers: list[np.ndarray] | None = None  # PlanBuilder's, kept between steps
        self.rates = RateMeter(pol)
        self.check_invariants = check_invariants
        self.tick = 0
        self.last_step_s: float | None = None  # now_s() of the last step's start
        self.epochs = Epochs()  # plans in flight, commits, and what the next step carries
        self.draining: dict[int, bool] = {Tier.HBM: False, Tier.DRAM: False, Tier.SSD: False}
        self.eviction_orders: dict[int, tuple[int, np.ndarray]] = {}  # planner cache, per tier
        self.order_asks: dict[int, tuple[int, int]] = {}  # per tier: tick, blocks (planner)
        self.prepared: PreparedOrders | None = None  # by prepare(), for the next step
        self.l1_seen = (-1, 0)  # (tick, L1 blocks) at the last prepare()
        self.order_rebuilds: dict[str, int] = {}  # rebuilds from a prepared order, scanned
        self.autopin = AutoPin(pol)
        self.ranks: dict[int, str] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=256)
        self.event_counts: Counter[str] = Counter()  # every event since start, by kind
        self.latency_us: deque[float] = deque(maxlen=2048)
        self.restarts = restarts
        self.awaiting_rebuild = awaiting_rebuild
        self.broken = ""  # the error that left the table half-changed (see _changing)
        self.changing = False  # set by a step once it changes the table
        self.recovery: dict[str, Any] | None = None
        if awaiting_rebuild:
            self.event("restarted", restarts=restarts)
        if warm:  # compile the kernels now, not in the first steps that need them
            warm_kernels(config, functools.partial(Controller, warm=False))

    # ---- epochs (read-only here: Epochs changes them) ---------------------------------------
    @property
    def next_epoch(self) -> int:
        return self.epochs.next_epoch

    @property
    def committed_epoch(self) -> int:
        return self.epochs.committed_epoch

    @property
    def pending(self) -> deque[PendingPlan]:
        return self.epochs.pending

    @property
    def pin_threshold(self) -> float:
        return self.autopin.threshold

    # ---- clock, events ---------------------------------------------------------------------
    def now_s(self) -> float:
        return self.clock() - self.started_s

    def event(self, kind: str, **data: Any) -> None:
        self.event_counts[kind] += 1
        self.events.append({"tick": self.tick, "t_s": round(self.now_s(), 6), "kind": kind,
                            **data})

    def require_ready(self) -> None:
        if self.awaiting_rebuild:
            why = (f"its table was left half-changed by {self.broken}" if self.broken else
                   f"controller restarted (restart {self.restarts})")
            raise ControllerRecoveringError(
                f"{why}; call rebuild() with the workers' slot maps and the SSD manifests "
                "before anything else")

    def _changing(self, fn: Callable[[], T]) -> T:
        """fn() (a step's planning); an error it raises once it has begun changing the table
        (`self.changing`) leaves the table half-changed, perhaps with plans the ranks hold
        already (an early plan): the controller then waits for a rebuild from the ranks' maps,
        as after a restart, instead of planning from that table."""
        self.changing = False
        try:
            return fn()
        except BaseException as exc:
            if self.changing:
                self.awaiting_rebuild = True
                self.broken = f"{type(exc).__name__} at tick {self.tick}: {exc}"
                self.event("broken", error=self.broken)
                log.error("controller: %s; waiting for a rebuild from the ranks", self.broken)
            raise
        finally:
            self.changing = False

    # ---- ranks and sessions ----------------------------------------------------------------
    def register_rank(self, rank: int, geometry: KvGeometry | Mapping[str, Any],
                      host: str = "") -> dict[str, Any]:
        """A worker announces itself; its geometry must be the controller's exactly."""
        check_rank(rank, geometry, host, self.config.geometry)
        self.ranks[rank] = host
        self.event("rank", rank=rank, host=host, registered=len(self.ranks))
        t = self.table
        return {"l1_slots": t.slots(Tier.HBM), "l2_slots": t.slots(Tier.DRAM),
                "l3_blocks": t.slots(Tier.SSD), "next_epoch": self.next_epoch}

    def open_session(self, session_id: str, num_tokens: int = 0) -> int:
        """Register a session; `num_tokens` of prompt get blocks at its first step. -> handle."""
        self.require_ready()
        s = calls.open_session(self.sessions, session_id, num_tokens, self.tick)
        self._changed(s)
        return self.sessions.handle(s)

    def extend_session(self, session_id: str, num_tokens: int) -> None:
        """Announce tokens (e.g. the user's next turn) that its next step writes."""
        self.require_ready()
        calls.extend_session(self.sessions, session_id, num_tokens)

    def close_session(self, session_id: str) -> int:
        """Forget a session and free its blocks everywhere; returns how many blocks it had."""
        self.require_ready()
        s, n = calls.close_session(self.sessions, self.table, self.epochs, session_id,
                                   self.tick)
        self._changed(s)
        self.event("close", session=session_id, blocks=n)
        self.maybe_check()
        return n

    def pin(self, session_id: str, start: int = 0, stop: int | None = None) -> int:
        """Never demote blocks [start, stop) of a session (also ones created later in the range).
        Returns the number of existing blocks pinned."""
        self.require_ready()
        return calls.pin(self.sessions, self.table, session_id, start, stop)

    def unpin(self, session_id: str, start: int = 0, stop: int | None = None) -> int:
        """Undo pin() over [start, stop); -> the number of blocks no pin covers any more."""
        self.require_ready()
        return calls.unpin(self.sessions, self.table, session_id, start, stop)

    # ---- steps -----------------------------------------------------------------------------
    def schedule(self, session_ids: Sequence[str] | np.ndarray,
                 num_new_tokens: Sequence[int] | np.ndarray,
                 upcoming: Upcoming = None,
                 rewrite: Sequence[int] | np.ndarray | None = None,
                 resume: Mapping[str, str] | None = None) -> StepResult:
        """Plan one step: `session_ids` run and add num_new_tokens[i] tokens each; `upcoming`
        maps sessions expected soon to the steps until they run (prefetched within
        policy.prefetch_steps); `rewrite[i]`: tokens an earlier step counted but no forward
        fed, which this one writes (their blocks' L2/L3 copies are stale); `resume` maps batch
        sessions to "load" or "recompute": the caller's choice for their blocks outside L1
        instead of the cost model's (e.g. "load" for a session whose L3 records every rank
        has read ahead). Returns block tables, fresh slots and 0..4 plans."""
        started = time.perf_counter_ns()
        self.require_ready()
        gc_on = gcpause.pause()  # no GC pass in the step: prepare() runs the one due
        try:
            if self.tick >= _TICK_LIMIT:
                self._rebase_ticks()
            result = self._changing(lambda: self._step(session_ids, num_new_tokens, upcoming,
                                                       rewrite, resume))
        finally:
            gcpause.resume(gc_on)
            self.prepared = None  # for this step only (or a refused one: made again)
        self.latency_us.append((time.perf_counter_ns() - started) / 1e3)
        return result

    def _step(self, session_ids: Sequence[str] | np.ndarray,
              num_new_tokens: Sequence[int] | np.ndarray, upcoming: Upcoming,
              rewrite: Sequence[int] | np.ndarray | None = None,
              resume: Mapping[str, str] | None = None) -> StepResult:
        """step.check_step (a refused step changes nothing), the next tick, step.run_step."""
        ctx = StepContext(
            self.config, self.table, self.sessions, self.epochs, self.batch_table, self.rates,
            self.autopin, self.marks, self.l3_enabled, self.draining, self.eviction_orders,
            self.order_asks, self.order_rebuilds, self.prepared, self.move_buffers,
            self.names_cache, self.check_invariants, self.now_s)
        checked = check_step(ctx, session_ids, num_new_tokens, upcoming, rewrite, resume)
        self.changing = True  # from here on the table changes
        self.tick += 1
        self.last_step_s = self.now_s()  # the dashboard tells idle from live by it
        self.rates.observe_step(self.last_step_s)
        out = run_step(ctx, checked, session_ids, self.tick)
        self.names_cache = out.names_cache
        return StepResult(**out.fields, **self.finish_step(out.builder))

    def prepare(self, force: Mapping[int, int] | None = None) -> None:
        """Between steps, while the host waits (after a forward's launch, after the actor's
        reply), what the next schedule() would do first: the eviction orders it is likely to
        rebuild (planstate.PreparedOrders, each tier's coldest sessions ranked at the next
        tick), the GC pass due soon (gcpause.collect_due), the row arena's compaction due soon
        (RowArena.make_room). The step's result is the same with or without it, however often
        it is called. `force` (tests): tiers to prepare, each with at least that many blocks."""
        gcpause.collect_due()
        if self.awaiting_rebuild:
            return
        self.sessions.arena.make_room()
        if not (self.order_asks or force):
            return
        ctx = PlanContext(self.config.policy, self.marks, self.l3_enabled, self.tick + 1, 0.0,
                          self.pin_threshold, orders=self.eviction_orders, asked=self.order_asks)
        t = self.table
        l1, l2 = ((t.used(k), t.slots(k), self.marks[k][0]) for k in (Tier.HBM, Tier.DRAM))
        likely, self.l1_seen = likely_tiers(l1, l2, self.l1_seen, self.order_asks, self.tick,
                                            self.config.policy.max_moves_per_step)
        self.prepared = prepare_orders(ctx, self.sessions, self.prepared, force, likely)

    def _changed(self, s: int) -> None:
        """Session s's eviction key or blocks may have changed outside a step."""
        if self.prepared is not None:
            self.prepared.changed.append(s)

    def finish_step(self, b: PlanBuilder) -> dict[str, Any]:
        """Keep the step's plans as pending; return its plans, drops, and what happened
        since the last step (closed sessions, lost blocks) for the StepResult."""
        self.epochs.hand_out(b)
        # Kept for the next step unless a bulk step (a drain) grew them past what steps need.
        keep = len(b.buffers[0]) <= 16 * self.config.policy.max_moves_per_step
        self.move_buffers = b.buffers if keep else None
        drops = b.drop_lists()
        for e in b.events:
            self.event(**e)  # type: ignore[arg-type]
        out = self.epochs.outbox(self.table, self.sessions, b, drops)
        self.maybe_check()
        return out

    def report_attention(self, session_id: str, mass: Sequence[float] | np.ndarray,
                         start: int = 0) -> None:
        """Add attention mass to blocks start, start+1, ... of a session (cumulative)."""
        self.require_ready()
        self._changed(calls.add_attention(self.sessions, self.table, session_id, mass, start))
        self.autopin.dirty = True

    def report_attentions(self, updates: Sequence[tuple[str, int, Sequence[float] | np.ndarray]]
                          ) -> None:
        """report_attention of several sessions, [(session_id, start, mass)]: every check
        first (a refused batch adds nothing), then each report."""
        self.require_ready()
        for session_id, start, mass in updates:
            calls.attention_rows(self.sessions, session_id, mass, start)
        for session_id, start, mass in updates:
            self.report_attention(session_id, mass, start)

    def report_prefill(self, num_tokens: int, seconds: float) -> None:
        """A measured prefill (tokens, seconds) for the cost model."""
        n = check_count("num_tokens", num_tokens, MAX_STEP_TOKENS, "MAX_STEP_TOKENS")
        self.rates.observe_prefill(n, check_seconds("seconds", seconds))

    # ---- confirmations ---------------------------------------------------------------------
    def commit(self, results: Sequence[MoveResult]) -> CommitOutcome:
        """All ranks' reports for the oldest unconfirmed epoch (see Epochs.commit)."""
        self.require_ready()
        out = self.epochs.commit(self.table, self.sessions, results,
                                 self.config.geometry.tp_size)
        if out.mismatch_ranks:
            self.event("mismatch", epoch=out.epoch, ranks=list(out.mismatch_ranks))
        else:
            self.rates.observe_plan(list(results))  # (checked: MoveResults)
        if out.num_misses:
            self.event("miss", epoch=out.epoch, blocks=out.num_misses)
        self.maybe_check()
        return out

    def slot_map(self) -> dict[str, Any]:
        """The authoritative map of every live block (for resync and for tests)."""
        return self.epochs.slot_map(self.table, self.sessions, self.tick)

    def resync(self) -> dict[str, Any]:
        """After a mismatch: the full map for workers to restore; pending plans are superseded."""
        self.require_ready()
        out = self.epochs.resync(self.table, self.sessions, self.tick)
        self.event("resync", epoch=self.committed_epoch, blocks=len(out["block_ids"]))
        return out

    def mark_lost(self, block_ids: Sequence[int] | np.ndarray) -> int:
        """Blocks some rank could not restore in a resync (it holds no copy): Tier.NONE on
        every rank (sent with the next step), recomputed when their session next runs, never
        served as the zeros that rank has. Unknown or already lost ids are ignored."""
        self.require_ready()
        ids = check_counts("block_ids", block_ids, (1 << 63) - 1, "int64")
        n = self.epochs.lose(self.table, self.sessions, ids)
        if n:
            self.event("lost_in_resync", blocks=n)
        return n

    def set_l2_online(self, num_slots: int) -> int:
        """The ranks have pinned L2 slots [0, num_slots) (pinning runs in the background after
        start): only those are handed out. -> the L2 slots online after the call."""
        n = check_count("num_slots", num_slots, self.table.full_slots(Tier.DRAM), "L2 slots")
        before = self.table.slots(Tier.DRAM)
        after = self.table.set_l2_online(n)
        if after != before:
            self.event("l2_online", slots=after, of=self.table.full_slots(Tier.DRAM))
        return after

    # ---- recovery and observability --------------------------------------------------------
    def rebuild(self, slot_maps: Sequence[Mapping[str, Any]],
                ssd_manifests: Mapping[str, Sequence[int] | np.ndarray],
                ssd_records: Mapping[str, int] | None = None) -> dict[str, Any]:
        """After a restart: rebuild the table from every rank's slot map and the SSD manifests.
        `ssd_records`: how many records each session's segment holds (SsdStore.
        session_records), dead ones too; without it the manifests' distinct indices count."""
        self.prepared = None
        new = recovery.rebuild(self.config, self.table, self.tick, self.next_epoch,
                               self.restarts, slot_maps, ssd_manifests, ssd_records)
        self.table, self.sessions, self.tick = new.table, new.sessions, new.tick
        self.epochs.restart(new.next_epoch, new.ssd_dropped)
        self.batch_table = BatchTable()
        self.eviction_orders.clear()
        self.names_cache = (np.zeros(0, np.int64), ())
        self.draining = {t: False for t in self.draining}
        self.awaiting_rebuild, self.broken = False, ""
        self.recovery = new.summary
        self.event("rebuilt", **new.summary)
        self.maybe_check()
        return new.summary

    def snapshot(self, max_sessions: int = 256) -> dict[str, Any]:
        return self.capture(check_count("max_sessions", max_sessions, 1 << 31, "2**31")).snapshot()

    def capture(self, max_sessions: int = 256) -> Capture:
        """What snapshot() shows, copied fast; render it anywhere (`.snapshot()`)."""
        return capture(self, max_sessions)

    def session_blocks(self, session_id: str) -> dict[str, Any]:
        """Per-block state of one session (access history folded in first)."""
        S = self.sessions
        rows = S.rows(S.lookup(session_id)).copy()
        self.table.fold_runs(rows, S.runs, S.run_hist)
        return session_blocks(self.table, rows, session_id, self.tick, self.config.policy,
                              self.pin_threshold)

    def metadata_bytes(self) -> int:
        """Bytes of every array the controller keeps (table, sessions, arena, caches)."""
        scratch = sum(a.nbytes for a in self.move_buffers or ())
        return (self.table.nbytes() + self.sessions.nbytes() + self.batch_table.nbytes()
                + scratch)

    def check_integrity(self) -> None:
        recovery.check_integrity(self.table, self.sessions, self.epochs,
                                 self.config.geometry.block_tokens)

    def maybe_check(self) -> None:
        if self.check_invariants:
            self.check_integrity()

    def _rebase_ticks(self) -> None:
        self.prepared = None
        shift = self.tick - (1 << 20)
        self.table.rebase_ticks(shift)
        self.sessions.rebase_ticks(shift)
        self.tick -= shift
        self.autopin.rebase(shift)
        self.event("rebase_ticks", shift=shift)
