"""tpkv.init: one TP rank's runtime (controller link, worker, step loop with confirm and retry)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from tpkv import errors
from tpkv.config import TpkvConfig
from tpkv.errors import ControllerRecoveringError, RankMismatchError, TpkvError, WaitTimeoutError
from tpkv.launch import recover
from tpkv.launch.bootstrap import RankContext, shutdown_ray
from tpkv.limits import MAX_SESSION_TOKENS, check_counts
from tpkv.protocol.messages import (
    CommitOutcome,
    StepResult,
    move_result_from_dict,
    move_result_to_dict,
)
from tpkv.protocol.plan import MovePlan, MoveResult
from tpkv.protocol.wire import decode, detached, encode
from tpkv.workers.confirm import STATUS_MISSES, mismatch_error
from tpkv.workers.worker import StepReport, Worker

log = logging.getLogger(__name__)
T = TypeVar("T")


class TpkvRuntime:
    """What `tpkv.init` returns on every rank. Rank 0 talks to the controller; every call that
    changes the controller runs there and its answer (or typed error) reaches every rank by one
    broadcast, so all ranks run the same code with the same arguments.

    A step: `begin_step` (rank 0 schedules, the plans reach every rank, each applies them and
    starts the all-gather), the engine's forward pass (`worker.wait_layer(l)` before attention
    on layer l), `end_step` (confirmation; rank 0 commits in the background; a mismatch resyncs
    every rank and raises RankMismatchError). `run_step` wraps the three and retries.
    """

    def __init__(self, config: TpkvConfig, ctx: RankContext, worker: Worker,
                 controller: Any, serialized: bool = False, ray_joined: bool | None = None
                 ) -> None:
        self.config, self.ctx, self.worker = config, ctx, worker
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.controller = controller if ctx.rank == 0 else None
        self.timeout_s = config.wait_timeout_s
        self._lock = None if serialized else threading.Lock()
        self._ray_joined = ray_joined
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tpkv-commit")
        self._commits: list[Future[CommitOutcome]] = []
        self._applied: Any = None
        self._deferred = False  # the step in flight left its watermark demotions for apply_late
        self._refused = False
        self.num_retries = 0
        self.last_step_times: dict[str, float] = {}
        self.num_mismatches = 0
        self.num_commit_refusals = 0  # rank 0: epochs the controller refused after agreement
        self.last_mismatch: RankMismatchError | None = None
        self._restore: dict[str, Any] | None = None
        self.num_rebuilds = 0  # times a restarted controller was rebuilt from the ranks
        self._l2_told = -1  # L2 slots rank 0 last told the controller are pinned (-1: none)
        self.closing: set[str] = set()  # closed at the controller, blocks not yet released here
        self.pins: dict[str, list[tuple[int, int]]] = {}  # explicit pins, block ranges

    # ---- session calls (run on rank 0, answered everywhere) -------------------------------
    def open_session(self, session_id: str, num_tokens: int = 0) -> int:
        return int(self._on_rank0("open_session", session_id=session_id,
                                  num_tokens=num_tokens))

    def extend_session(self, session_id: str, num_tokens: int) -> None:
        self._on_rank0("extend_session", session_id=session_id, num_tokens=num_tokens)

    def close_session(self, session_id: str) -> int:
        freed = int(self._on_rank0("close_session", session_id=session_id))
        self.closing.add(session_id)  # the ranks release its blocks with the next step
        self.pins.pop(session_id, None)
        self._drop_l3(session_id)
        return freed

    def _drop_l3(self, session_id: str) -> None:
        """Closed means deleted: this rank's L3 files of the session go now, not with the next
        step (which may never come); its spills in flight finish first, so none lands after."""
        store = self.worker.store
        if store is None:
            return
        self.worker.executor.wait_spills(time.monotonic() + self.timeout_s,
                                         names={session_id})
        try:
            store.drop_session(session_id)
        except (errors.SsdError, OSError) as exc:  # the next step's delete tries again
            log.warning("rank %d: L3 files of closed session %r not deleted: %s", self.rank,
                        session_id, exc)

    def pin(self, session_id: str, start: int = 0, stop: int | None = None) -> int:
        n = int(self._on_rank0("pin", session_id=session_id, start=start, stop=stop))
        # kept here too: a rebuilt controller gets its pins back from the ranks
        self.pins.setdefault(session_id, []).append((start, start + n if stop is None else stop))
        return n

    def controller_slot_map(self) -> dict[str, Any]:
        """The controller's authoritative map on every rank (for checks and tests). The Ray
        actor has no read-only call for it: there it is taken by resync(), and every rank
        restores from it at its next step (a no-op where the maps agree)."""

        def fetch() -> dict[str, Any]:
            self._check_commits(wait=True)
            try:
                return {"map": self._call("slot_map"), "resync": False}
            except AttributeError:
                return {"map": self._call("resync"), "resync": True}

        answer = self.from_rank0(fetch, "slot map")
        if answer["resync"]:
            self._restore = answer["map"]
        return dict(answer["map"])

    # ---- the step ----------------------------------------------------------------------------
    def begin_step(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                   upcoming: Mapping[str, int] | Sequence[str] | None = None,
                   late_ok: bool = False, defer_marks: bool = False) -> StepResult:
        """Schedule on rank 0, apply the step's plans everywhere, start the confirmation. A
        controller that restarted (and lost its table) is rebuilt from the ranks first.
        `late_ok`: plans that only demote other sessions' blocks may wait for apply_late()
        (Worker.apply_step); the step is then confirmed at the next begin_step.
        `defer_marks` (with late_ok; an in-process controller): a step that plans only for the
        watermarks is scheduled without those moves; apply_late() has the controller plan
        them and applies them (Controller.plan_deferred)."""
        if isinstance(session_ids, (str, bytes)):
            raise errors.ArgumentTypeError(f"session_ids must be a list of str, got "
                                           f"{type(session_ids).__name__} {session_ids!r:.64}")
        num_new_tokens = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                                      "MAX_SESSION_TOKENS", negative_ok=True)
        return self._recovering(
            lambda: self._begin_step(session_ids, num_new_tokens, upcoming, late_ok,
                                     defer_marks))

    def apply_late(self) -> StepResult | None:
        """Once the step's forward is launched (a collective when the step deferred its
        watermark demotions): apply its plans that wait (begin_step's late_ok), or plan and
        apply the demotions it deferred (defer_marks); returns the latter's StepResult (the
        step is then confirmed at the next begin_step), else None."""
        self.worker.apply_late()
        if not self._deferred:
            return None
        self._deferred = False
        own = self._applied
        if own is not None and (own.plans or own.pending is not None):
            # the step's own moves are not confirmed yet (run_step's fn is the forward, or
            # its plans waited): the next schedule() plans the watermarks' moves instead
            return None
        answer = self._recovering(lambda: self.from_rank0(
            lambda: self._answer(self._call("plan_deferred")), "deferred watermark plans"))
        if answer is None:
            return None
        step = _as_step(answer)
        if own is not None:  # the step moved nothing: nothing to confirm
            self.end_step()
        self._applied = self.worker.apply_deferred(step)
        if self.world_size == 1:
            # Its confirmation is local: confirm and commit it now, while the device computes,
            # not in the next step's schedule (whose controller call waited for the commit).
            self._end_late_step()
            self._check_commits(wait=True)
        return step

    def _end_late_step(self) -> None:
        """end_step for a step whose plans were applied after its forward was launched (late
        or deferred): a disagreement has resynced every rank (end_step) and is logged, not
        raised, for that forward read none of those blocks."""
        try:
            self.end_step()
        except RankMismatchError as exc:
            log.error("rank %d: the plans applied after a forward disagreed: %s", self.rank, exc)

    def _begin_step(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                    upcoming: Mapping[str, int] | Sequence[str] | None,
                    late_ok: bool = False, defer_marks: bool = False) -> StepResult:
        self._deferred = False
        if self._applied is not None:
            if self._applied.late:  # this step starts from the resynced map if they disagreed
                self._end_late_step()
            else:
                self.end_step()
        if self._restore is not None:
            self._resync(self._restore)
            self._restore = None

        def plan() -> dict[str, Any]:
            resync = self._resync_if_commit_failed()
            self._sync_l2_online()
            # only an in-process controller plans between calls (the Ray client lacks it)
            local = hasattr(self.controller, "plan_deferred")
            extra: dict[str, Any] = {"defer_marks": True} if defer_marks and late_ok and local \
                else {}
            if local:
                extra["early"] = self._hand_early
            step = self._call("schedule", list(session_ids),
                              np.asarray(num_new_tokens, dtype=np.int64).reshape(-1), upcoming,
                              **extra)
            return {"step": self._answer(step), "resync": resync,
                    "deferred": "defer_marks" in extra
                    and getattr(self.controller, "deferred", None) is not None}

        t0 = time.perf_counter()
        answer = self.from_rank0(plan, "plans of a step", early=self.worker.apply_early)
        if answer["resync"] is not None:
            self._resync(answer["resync"])
        step = _as_step(answer["step"])
        self._deferred = bool(answer["deferred"])
        t1 = time.perf_counter()
        self._applied = self.worker.apply_step(step, late_ok)
        # host seconds of the last step's planning (controller, to every rank) and applying
        self.last_step_times = {"plan": t1 - t0, "apply": time.perf_counter() - t1}
        self.closing.difference_update(step.closed_sessions)
        return step

    def _hand_early(self, plan: MovePlan) -> None:
        """Rank 0, inside Controller.schedule (its `early`): every rank applies the step's first
        plan now (the others get it in from_rank0 before the step's answer)."""
        if self.world_size > 1:
            self.ctx.ctl.broadcast_bytes(encode({"early": plan.to_dict()}),
                                         what="a step's early plan")
        self.worker.apply_early(plan)

    def end_step(self) -> bool:
        """Wait (bounded) for the confirmation of the step. True: committed. False: an L3 miss
        hit a block the step needs (the controller recomputes it): run the step again. Raises
        RankMismatchError after resyncing every rank when the ranks disagree."""
        applied, self._applied = self._applied, None
        if applied is None:
            return True
        self._check_commits()
        report = self.worker.finish(applied)
        exchange = self.world_size > 1 and (report.any_misses or bool(report.mismatches))
        results = self._all_results(report, exchange)
        if report.mismatches:
            self.num_mismatches += 1
            err = mismatch_error(report.gathered, report.expected, report.mismatches)
            slot_map = self.from_rank0(lambda: self._commit_and_resync(results, err.epoch),
                                       f"resync after epoch {err.epoch}")
            lost = self._resync(slot_map)
            note = f", {len(lost)} blocks lost on rank {self.rank}" if len(lost) else ""
            self.last_mismatch = RankMismatchError(
                f"{err}; every rank resynced to epoch {slot_map['epoch']}{note}", err.epoch,
                err.ranks)
            raise self.last_mismatch
        if self.rank == 0:
            missed = any(len(r.miss_block_ids) for per_plan in results for r in per_plan)
            for per_plan in results:
                self._commits.append(self._committer.submit(self._call, "commit", per_plan))
            if missed:
                self._check_commits(wait=True)  # before the retry schedules the recompute
        return not _misses_hit_batch(report, results)

    def run_step(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                 fn: Callable[[StepResult], T],
                 upcoming: Mapping[str, int] | Sequence[str] | None = None,
                 max_retries: int = 2, late_ok: bool = False, defer_marks: bool = False) -> T:
        """begin_step, fn(step) (the forward pass), end_step; after a mismatch or a miss the
        step runs again with no new tokens (the first attempt added them) on repaired tiers.
        With `late_ok`, a step whose plans wait (begin_step) returns without end_step: it is
        confirmed at the next begin_step (it has no loads, so no miss can hit its batch)."""
        tokens = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                              "MAX_SESSION_TOKENS", negative_ok=True)
        for attempt in range(max_retries + 1):
            step = self.begin_step(session_ids, tokens, upcoming, late_ok, defer_marks)
            out = fn(step)
            if self._applied is not None and self._applied.late:
                return out
            try:
                if self.end_step():
                    return out
            except RankMismatchError as exc:
                if attempt == max_retries:
                    raise
                log.warning("rank %d: step retried: %s", self.rank, exc)
            self.num_retries += 1
            tokens = np.zeros(len(tokens), dtype=np.int64)
        raise errors.PlanMismatchError(f"step of {len(tokens)} sessions still failed after "
                                       f"{max_retries} retries (L3 misses)")

    def close(self, error: BaseException | None = None) -> None:
        """End the step in flight, flush commits, leave Ray and the process groups together.
        With `error` (the app is failing) tell the others through the heartbeats and leave at
        once: they fail within their bound, naming this rank."""
        try:
            if error is not None:
                if self.ctx.liveness is not None:
                    self.ctx.liveness.fail(f"{type(error).__name__}: {error}",
                                           follower=isinstance(error, errors.RankTimeoutError))
                if self._ray_joined:
                    import ray

                    ray.shutdown()
                return
            if self._applied is not None:
                self.end_step()
            self._check_commits(wait=True)
            if self._ray_joined is not None:
                shutdown_ray(self.ctx, self._ray_joined)
            elif self.world_size > 1:
                self.ctx.ctl.barrier("close")
        finally:
            self._committer.shutdown(wait=False)
            self.worker.close()
            self.ctx.close()

    def __enter__(self) -> TpkvRuntime:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)

    # ---- internals -------------------------------------------------------------------------
    def _answer(self, step: StepResult | None) -> StepResult | dict[str, Any] | None:
        """A StepResult as from_rank0 passes it on: a group of one takes a detached copy (no
        wire form to build and check), larger groups its wire form."""
        if step is None:
            return None
        return step.detached() if self.world_size == 1 else step.to_dict()

    def _sync_l2_online(self) -> None:
        """Rank 0, before a schedule: tell the controller how much of L2 is pinned (the rest
        is pinned in the background; the other ranks wait for an arena a copy needs)."""
        ready = self.worker.host.ready_slots
        if ready != self._l2_told:
            self._call("set_l2_online", num_slots=ready)
            self._l2_told = ready

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A controller call on rank 0 (one at a time for an in-process controller)."""
        fn = getattr(self.controller, method)
        if self._lock is None:
            return fn(*args, **kwargs)
        if not self._lock.acquire(timeout=self.timeout_s):
            raise WaitTimeoutError(f"controller busy for {self.timeout_s:g} s ({method})")
        try:
            return fn(*args, **kwargs)
        finally:
            self._lock.release()

    def _on_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._recovering(
            lambda: self.from_rank0(lambda: self._call(method, *args, **kwargs), method))

    def _recovering(self, fn: Callable[[], T]) -> T:
        """fn() on every rank; if the controller answers that it restarted, rebuild it from the
        ranks (a collective: the answer reached every rank) and run fn() once more."""
        try:
            return fn()
        except ControllerRecoveringError:
            self.rebuild_controller()
            return fn()

    def rebuild_controller(self) -> dict[str, Any]:
        """A collective: rebuild the restarted controller from the ranks (recover.py), then
        restore this rank from its map. Returns the rebuild summary."""
        what = "slot maps for a controller rebuild"
        gather = (lambda b: self.ctx.ctl.gather_bytes(b, what)) if self.world_size > 1 \
            else (lambda b: [b])
        summary = recover.rebuild_controller(self.worker, gather, self.from_rank0, self._call,
                                             self.closing, self.pins)
        for fut in self._commits:  # commits still in flight were for the lost controller
            fut.cancel()
        self._commits, self._refused = [], False
        self._resync(self.from_rank0(lambda: dict(self._call("resync")),
                                     "resync after a controller rebuild"))
        self.num_rebuilds += 1
        self._l2_told = -1  # the rebuilt controller hears again how much of L2 is pinned
        return summary

    def prepare_controller(self) -> None:
        """Rank 0, in-process controller: Controller.prepare() now, while the device runs the
        step's forward (the engine calls this once it is launched): the next schedule finds
        its eviction orders made. Skipped when the controller is busy (a commit in the
        background) or remote (the Ray actor prepares after each reply by itself); optional
        work, so a failure is logged, not raised."""
        prepare = getattr(self.controller, "prepare", None)
        if prepare is None:
            return
        if self._lock is not None and not self._lock.acquire(blocking=False):
            return
        try:
            prepare()
        except Exception:
            log.exception("Controller.prepare failed")
        finally:
            if self._lock is not None:
                self._lock.release()

    def advise(self, method: str, *args: Any, **kwargs: Any) -> None:
        """A rank-0-only call whose loss costs nothing but accuracy (attention mass, prefill
        speed): while the controller is restarting it is dropped, not raised on one rank."""
        if self.rank != 0:
            return
        try:
            self._call(method, *args, **kwargs)
        except ControllerRecoveringError:
            log.warning("controller restarting: %s report dropped", method)

    def from_rank0(self, fn: Callable[[], Any], what: str,
                   early: Callable[[MovePlan], None] | None = None) -> Any:
        """Run fn on rank 0; every rank gets its value or raises its typed error. A group of
        one skips the wire (encoding a resume's step took about as long as planning it) and
        takes a copy instead: the controller reuses its arrays in the next call. `early`:
        on the other ranks, what to do with plans rank 0 broadcasts while fn runs (_hand_early)
        before its answer."""
        if self.world_size == 1:
            return detached(fn())
        payload, failure = None, None
        if self.rank == 0:
            try:
                payload = encode({"ok": fn()})
            except Exception as exc:  # every rank raises it (others as its tpkv type, or base)
                failure = exc
                message = str(exc.args[0]) if isinstance(exc, TpkvError) and exc.args else \
                    f"rank 0: {what}: {type(exc).__name__}: {exc}"
                payload = encode({"error": type(exc).__name__, "message": message})
        if self.world_size > 1:
            payload = self.ctx.ctl.broadcast_bytes(payload, what=what)
        if failure is not None:
            raise failure
        assert payload is not None
        answer = decode(payload)
        while "early" in answer and self.rank != 0:
            if early is None:
                raise TpkvError(f"rank {self.rank}: {what}: rank 0 sent a plan ahead of its "
                                "answer, which this call does not take")
            early(MovePlan.from_dict(answer["early"]))
            answer = decode(self.ctx.ctl.broadcast_bytes(None, what=what))
        if "error" in answer:
            cls = getattr(errors, str(answer["error"]), None)
            if not (isinstance(cls, type) and issubclass(cls, TpkvError)):
                cls = TpkvError
            raise cls(answer["message"])
        return answer["ok"]

    def _all_results(self, report: StepReport, exchange: bool) -> list[list[MoveResult]]:
        """[plan][rank] MoveResults: exchanged when some rank has misses or disagrees, else
        rebuilt from the gathered rows (rank 0's byte counts and timings stand for all)."""
        if exchange:
            blobs = self.ctx.ctl.gather_bytes(
                encode([move_result_to_dict(r) for r in report.results]), "move results")
            per_rank = [[move_result_from_dict(d) for d in decode(b)] for b in blobs]
            return [list(col) for col in zip(*per_rank)]
        row_of = {int(e): j for j, e in enumerate(report.expected[:, 0].tolist())}
        out = []
        for own in report.results:
            j = row_of.get(own.epoch)
            rows = report.gathered[:, j, :] if j is not None else None
            out.append([MoveResult(
                own.epoch, r, own.moves_applied if rows is None else int(rows[r, 1]),
                # this rank's own digest counts its misses; the gathered row may not
                own.slot_map_digest if rows is None or r == self.rank else int(rows[r, 2]),
                own.status if rows is None else int(rows[r, 3]) & ~STATUS_MISSES,
                own.miss_block_ids,
                own.bytes_h2d, own.bytes_d2h, own.bytes_ssd_read, own.bytes_ssd_write,
                own.elapsed_ns) for r in range(self.world_size)])
        return out

    def _resync(self, slot_map: dict[str, Any]) -> np.ndarray:
        """Every rank restores the controller's map; blocks any rank holds no copy of are
        marked lost at the controller (recomputed, never read as that rank's zeros). Returns
        the ids this rank lost. A collective: every rank calls it at the same point."""
        lost = np.asarray(self.worker.resync(slot_map), dtype=np.int64)
        every = lost
        if self.world_size > 1:
            blobs = self.ctx.ctl.gather_bytes(encode(lost), "blocks lost in a resync")
            every = np.unique(np.concatenate(
                [np.asarray(decode(b), dtype=np.int64).reshape(-1) for b in blobs]))
        if len(every):
            self.from_rank0(lambda: self._call("mark_lost", block_ids=every),
                            "mark blocks lost in a resync")
        return lost

    def _commit_and_resync(self, results: list[list[MoveResult]], first: int) -> dict[str, Any]:
        self._check_commits(wait=True)
        for per_plan in results:
            if per_plan[0].epoch > first:
                break
            self._call("commit", per_plan)
        return dict(self._call("resync"))

    def _check_commits(self, wait: bool = False) -> None:
        """Collect background commits (all of them when `wait`); raise one that failed."""
        keep = []
        for fut in self._commits:
            if wait or fut.done():
                try:
                    outcome = fut.result(timeout=self.timeout_s)
                except ControllerRecoveringError:  # the next scheduling call rebuilds it
                    log.warning("controller restarted before a commit reached it")
                    continue
                if not outcome.committed:  # the all-gather agreed, so this is a bug somewhere
                    log.error("controller refused epoch %d (ranks %s) after the all-gather "
                              "agreed; resyncing", outcome.epoch, outcome.mismatch_ranks)
                    self._refused = True
                    self.num_commit_refusals += 1
            else:
                keep.append(fut)
        self._commits = keep

    def _resync_if_commit_failed(self) -> dict[str, Any] | None:
        self._check_commits()
        if not self._refused:
            return None
        self._check_commits(wait=True)
        self._refused = False
        return dict(self._call("resync"))


def _as_step(answer: StepResult | dict[str, Any]) -> StepResult:
    return answer if isinstance(answer, StepResult) else StepResult.from_dict(answer)


def _misses_hit_batch(report: StepReport, results: list[list[MoveResult]]) -> bool:
    """Whether a block missed on any rank belongs to a session of the step's batch."""
    batch = set(report.step.session_ids)
    for plan, per_plan in zip(report.step.plans, results):
        missed = np.concatenate([np.asarray(r.miss_block_ids, dtype=np.int64)
                                 for r in per_plan] + [np.zeros(0, dtype=np.int64)])
        if len(missed):
            hit = np.isin(plan.block_ids, missed)
            if {plan.session_names[i] for i in plan.session_idx[hit].tolist()} & batch:
                return True
    return False
