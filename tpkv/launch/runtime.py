"""tpkv.init: one TP rank's runtime (controller link, worker, step loop with confirm and retry)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from tpkv import errors
from tpkv.config import TpkvConfig
from tpkv.errors import ControllerError, RankMismatchError, TpkvError
from tpkv.launch.ahead import Ahead, Credits, as_upcoming
from tpkv.launch.bootstrap import RankContext, shutdown_ray
from tpkv.launch.collective import all_results, as_step, from_rank0, misses_hit_batch
from tpkv.launch.link import Link, make_link
from tpkv.launch.recovery_calls import Recovery
from tpkv.launch.sent import SentCalls
from tpkv.launch.session_calls import SessionCalls
from tpkv.limits import MAX_SESSION_TOKENS, check_counts
from tpkv.protocol.messages import (
    StepResult,
)
from tpkv.workers.confirm import mismatch_error
from tpkv.workers.worker import Worker

log = logging.getLogger(__name__)
T = TypeVar("T")


class TpkvRuntime(SessionCalls, Recovery):
    """What `tpkv.init` returns on every rank. Rank 0 talks to the controller; every call that
    changes the controller runs there and its answer (or typed error) reaches every rank by one
    broadcast, so all ranks run the same code with the same arguments.

    A step: `begin_step` (the plans reach every rank, each applies them and starts the
    all-gather), the engine's forward pass (`worker.wait_layer(l)` before attention on layer l),
    `end_step` (confirmation; rank 0 sends the commit without waiting; a mismatch resyncs every
    rank and raises RankMismatchError). `run_step` wraps the three and retries. Its schedule
    is sent ahead (`schedule_ahead`, while the step before runs its forward) when the caller
    knows the batch, else at begin_step. Rank 0's calls go through one link (tpkv.launch.link),
    in process or to the Ray actor, with the same calls and features either way.
    """

    def __init__(self, config: TpkvConfig, ctx: RankContext, worker: Worker,
                 controller: Any, ray_joined: bool | None = None) -> None:
        self.config, self.ctx, self.worker = config, ctx, worker
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.timeout_s = config.wait_timeout_s
        self.controller = controller if ctx.rank == 0 else None  # sets self.link
        self._ray_joined = ray_joined
        self.sent = SentCalls(self.timeout_s)  # rank 0: commits and reports on their way
        self._applied: Any = None
        self._ahead: Ahead | None = None  # rank 0: the next step's schedule, sent ahead
        self.credits = Credits()  # rank 0: tokens steps planned ahead added but never fed
        self.num_ahead_used = 0  # steps whose schedule was sent ahead and used as is
        self.num_ahead_unused = 0  # ... and applied without their forward (another batch came)
        self.num_retries = 0
        self.last_step_times: dict[str, float] = {}
        self.num_mismatches = 0
        self.last_mismatch: RankMismatchError | None = None
        self.num_rebuilds = 0  # times a restarted controller was rebuilt from the ranks
        self._l2_told = -1  # L2 slots rank 0 last told the controller are pinned (-1: none)
        self.closing: set[str] = set()  # closed at the controller, blocks not yet released here
        self.opened: set[str] = set()  # open at the controller (through open_session)
        self.pins: dict[str, list[tuple[int, int]]] = {}  # explicit pins, block ranges

    @property
    def num_commit_refusals(self) -> int:
        """Rank 0: epochs the controller refused after the ranks agreed."""
        return self.sent.num_refusals

    @property
    def controller(self) -> Any:
        """Rank 0: the Controller, or the actor's ControllerClient (None elsewhere)."""
        return None if self.link is None else self.link.target

    @controller.setter
    def controller(self, controller: Any) -> None:
        """A new controller object: what was sent to the old one (a step planned ahead) is
        void."""
        old = getattr(self, "link", None)
        if old is not None:
            old.close()
        self.link = None if controller is None else make_link(controller, self.timeout_s)
        self._ahead = None

    @property
    def _ctl(self) -> Link:
        if self.link is None:
            raise TpkvError(f"rank {self.rank} has no controller link (rank 0 talks to it)")
        return self.link

    # ---- the step ----------------------------------------------------------------------------
    def schedule_ahead(self, session_ids: Sequence[str], num_new_tokens: Sequence[int],
                       upcoming: Mapping[str, int] | Sequence[str] | None = None,
                       resume: Mapping[str, str] | None = None) -> None:
        """The batch the caller will run next (every rank calls it; rank 0 acts): its schedule
        is sent now, while this step's forward runs, and read at the next begin_step. Nothing
        is sent while one is already on its way; a wrong guess costs one step applied without
        its forward (ahead.py). The commits and reports held for the next call go with it,
        or now where nothing is sent."""
        if self.rank != 0 or self._ahead is not None or not len(session_ids):
            self.send_posts()
            return
        ids = tuple(session_ids)
        n = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                         "MAX_SESSION_TOKENS")
        self._sync_l2_online()
        sent, rewrite = self.credits.ask(ids, n)
        reply = self._ctl.send("schedule", list(ids), sent, as_upcoming(upcoming), rewrite,
                               resume)
        self._ahead = Ahead(ids, n, sent, reply)

    def begin_step(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                   upcoming: Mapping[str, int] | Sequence[str] | None = None,
                   late_ok: bool = False, resume: Mapping[str, str] | None = None
                   ) -> StepResult:
        """Apply the step's plans everywhere and start their confirmation: the schedule sent
        ahead for this batch, else one made now on rank 0. A controller that restarted (and
        lost its table) is rebuilt from the ranks first. `late_ok`: plans that only demote
        other sessions' blocks may wait for apply_late() (Worker.apply_step); the step is then
        confirmed at the next begin_step. `resume`: as Controller.schedule takes it."""
        if isinstance(session_ids, (str, bytes)):
            raise errors.ArgumentTypeError(f"session_ids must be a list of str, got "
                                           f"{type(session_ids).__name__} {session_ids!r:.64}")
        num_new_tokens = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                                      "MAX_SESSION_TOKENS", negative_ok=True)
        return self._recovering(
            lambda: self._begin_step(session_ids, num_new_tokens, upcoming, late_ok, resume))

    def send_posts(self) -> None:
        """Rank 0: the commits and reports held for the next call, sent now (a step that plans
        none ahead; Link.flush)."""
        if self.link is not None:
            self.link.flush()

    def apply_late(self) -> None:
        """Once the step's forward is launched: apply its plans that wait (begin_step's
        late_ok) and start their confirmation (the next begin_step collects it). From then on
        rank 0's commits and reports wait for the next call to the controller (a schedule,
        this step's planned ahead or the next one's) and go in the same actor call (Link)."""
        self.worker.apply_late()
        if self.link is not None:
            self.link.hold_posts = True  # this caller schedules each step

    def _end_late_step(self) -> None:
        """end_step for a step whose forward read none of its plans' blocks (its plans were
        applied after the forward was launched, or it never ran a forward): a disagreement has
        resynced every rank (end_step) and is logged, not raised."""
        try:
            self.end_step()
        except RankMismatchError as exc:
            log.error("rank %d: plans no forward read disagreed: %s", self.rank, exc)

    def _finish_last(self) -> None:
        if self._applied is not None:
            if self._applied.late:  # this step starts from the resynced map if they disagreed
                self._end_late_step()
            else:
                self.end_step()

    def _begin_step(self, session_ids: Sequence[str], num_new_tokens: np.ndarray,
                    upcoming: Mapping[str, int] | Sequence[str] | None,
                    late_ok: bool = False, resume: Mapping[str, str] | None = None
                    ) -> StepResult:
        self._finish_last()
        t0 = time.perf_counter()
        ahead = self.from_rank0(lambda: self._ahead_answer(session_ids, num_new_tokens),
                                "a step planned ahead")
        if ahead is not None and ahead["used"]:
            return self._apply(as_step(ahead["step"]), late_ok, t0)
        if ahead is not None:  # planned for another batch: applied with no forward first
            self._apply_unused(as_step(ahead["step"]))

        def plan() -> dict[str, Any]:
            resync = self._resync_if_commit_failed()
            self._sync_l2_online()
            sent, rewrite = self.credits.ask(session_ids, num_new_tokens)
            step = self._call("schedule", list(session_ids), sent, as_upcoming(upcoming),
                              rewrite, resume)
            self.credits.fed(session_ids, num_new_tokens, sent)
            return {"step": self._answer(step), "resync": resync}

        answer = self.from_rank0(plan, "plans of a step")
        if answer["resync"] is not None:
            self._resync(answer["resync"])
        return self._apply(as_step(answer["step"]), late_ok, t0)

    def _ahead_answer(self, session_ids: Sequence[str], num_new_tokens: np.ndarray
                      ) -> dict[str, Any] | None:
        """Rank 0: the schedule sent ahead, and whether it is this step's (the same batch and
        counts, and no commit refused since). None when none was sent, or the controller
        refused it (nothing changed there; a restarted controller is rebuilt by the call
        that follows)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        try:
            step = ahead.reply.result()
        except ControllerError:  # a bug, not a refusal: raised, as in process
            raise
        except TpkvError as exc:
            log.debug("rank 0: the schedule sent ahead was refused: %s", exc)
            return None
        used = ahead.matches(session_ids, num_new_tokens) and not self.sent.refused
        if used:
            self.credits.fed(ahead.session_ids, ahead.num_new_tokens, ahead.sent)
            self.num_ahead_used += 1
        else:
            self.credits.unfed(ahead.session_ids, ahead.sent)
            self.num_ahead_unused += 1
        return {"step": self._answer(step), "used": used}

    def _apply(self, step: StepResult, late_ok: bool, t0: float) -> StepResult:
        t1 = time.perf_counter()
        self._applied = self.worker.apply_step(step, late_ok)
        # host seconds of the last step's planning (controller, to every rank) and applying
        self.last_step_times = {"plan": t1 - t0, "apply": time.perf_counter() - t1}
        self.closing.difference_update(step.closed_sessions)
        return step

    def _apply_unused(self, step: StepResult) -> None:
        """A step planned ahead for a batch that did not run: every rank applies and confirms
        it as a step whose forward never ran (its plans are the controller's, pending)."""
        self._applied = self.worker.apply_step(step)
        self.closing.difference_update(step.closed_sessions)
        self._end_late_step()

    def settle_ahead(self) -> None:
        """A collective, before any call that reads or changes the controller's table outside
        a step: a schedule sent ahead is applied first (as a step without its forward), so
        every rank's map and the controller's agree on what came before the call."""
        ahead = self.from_rank0(lambda: self._ahead_answer((), np.zeros(0, dtype=np.int64)),
                                "a step planned ahead")
        if ahead is not None:
            self._finish_last()
            self._apply_unused(as_step(ahead["step"]))

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
        results = all_results(self.ctx, report, exchange)
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
                self.sent.commit(self._ctl, per_plan)
            if missed:
                self._check_commits(wait=True)  # before the retry schedules the recompute
        return not misses_hit_batch(report, results)

    def run_step(self, session_ids: Sequence[str], num_new_tokens: Sequence[int] | np.ndarray,
                 fn: Callable[[StepResult], T],
                 upcoming: Mapping[str, int] | Sequence[str] | None = None,
                 max_retries: int = 2, late_ok: bool = False,
                 resume: Mapping[str, str] | None = None) -> T:
        """begin_step, fn(step) (the forward pass), end_step; after a mismatch or a miss the
        step runs again with no new tokens (the first attempt added them) on repaired tiers.
        With `late_ok`, a step whose plans wait (begin_step) returns without end_step: it is
        confirmed at the next begin_step (it has no loads, so no miss can hit its batch)."""
        tokens = check_counts("num_new_tokens", num_new_tokens, MAX_SESSION_TOKENS,
                              "MAX_SESSION_TOKENS", negative_ok=True)
        for attempt in range(max_retries + 1):
            step = self.begin_step(session_ids, tokens, upcoming, late_ok, resume)
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
            self.settle_ahead()  # its plans are the controller's: applied and confirmed
            if self._applied is not None:
                self.end_step()
            self._check_commits(wait=True)
            if self._ray_joined is not None:
                shutdown_ray(self.ctx, self._ray_joined)
            elif self.world_size > 1:
                self.ctx.ctl.barrier("close")
        finally:
            if self.link is not None:
                self.link.close()
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
        if ready == self._l2_told:
            return
        if self._l2_told < 0:  # the first tell goes before any schedule
            self._call("set_l2_online", num_slots=ready)
        else:  # L2 only grows from here: a schedule that comes first sees less of it
            self.sent.report(self._ctl, "set_l2_online", num_slots=ready)
        self._l2_told = ready

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A controller call on rank 0, after every call sent before it."""
        return self._ctl.call(method, *args, **kwargs)

    def _on_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.settle_ahead()
        return self._recovering(
            lambda: self.from_rank0(lambda: self._call(method, *args, **kwargs), method))

    def advise(self, method: str, *args: Any, **kwargs: Any) -> None:
        """A rank-0-only call whose loss costs nothing but accuracy (attention mass, prefill
        speed): while the controller is restarting it is dropped, not raised on one rank."""
        if self.rank != 0:
            return
        self.sent.report(self._ctl, method, *args, **kwargs)

    def from_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """Run fn on rank 0; every rank gets its value or raises its typed error
        (collective.from_rank0)."""
        return from_rank0(self.ctx, fn, what)

    def _check_commits(self, wait: bool = False) -> None:
        self.sent.check(wait)
