"""Glue: PagedEngine on the tiers through TpkvRuntime (schedule, wait, report, release)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpkv.config import HbmConfig, HostConfig, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.launch.runtime import TpkvRuntime
from tpkv.models.engine import PagedEngine
from tpkv.models.fingerprint import llama_fingerprint
from tpkv.models.llama import Llama, ModelConfig
from tpkv.models.returns import Returns
from tpkv.models.scheduler import StepTables
from tpkv.models.turns import StepReport
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import Tier

# (src, dst) of each move direction, by the names used in stats and summaries.
DIRECTIONS = {"l1_l2": (Tier.HBM, Tier.DRAM), "l2_l1": (Tier.DRAM, Tier.HBM),
              "l2_l3": (Tier.DRAM, Tier.SSD), "l3_l2": (Tier.SSD, Tier.DRAM)}
TIER_NAMES = {int(Tier.HBM): "l1", int(Tier.DRAM): "l2", int(Tier.SSD): "l3"}


def tiered_config(model: Llama | ModelConfig, tp_size: int, *, block_tokens: int, l1_blocks: int,
                  l2_blocks: int, ssd_root: str | None = None, l3_blocks: int = 4096,
                  policy: PolicyConfig | None = None, wait_timeout_s: float = 30.0,
                  **extra: Any) -> TpkvConfig:
    """A config whose KV geometry (and dtype) is the model's; tier sizes in blocks per rank.
    L3 records are stored under `model_fingerprint` if given in `extra`, else, for a Llama,
    `llama_fingerprint(model)` (its weights: two seeds never share records); a ModelConfig
    alone leaves it empty (records of any weights of that shape are read as these)."""
    g = model.kv_geometry(tp_size=tp_size, block_tokens=block_tokens)
    if isinstance(model, Llama) and not extra.get("model_fingerprint"):
        extra = {**extra, "model_fingerprint": llama_fingerprint(model)}
    l3 = (SsdConfig(root=ssd_root, budget_bytes=SsdConfig.budget_for(l3_blocks, g), o_direct=False,
                    io_threads=2) if ssd_root else SsdConfig())
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=l1_blocks),
                      l2=HostConfig(budget_bytes=l2_blocks * tp_size * g.block_bytes,
                                    arena_bytes=max(l2_blocks, 1) * g.block_bytes),
                      l3=l3, policy=policy or PolicyConfig(cooldown_s=0.0),
                      wait_timeout_s=wait_timeout_s, **extra)


@dataclass
class TierStats:
    """What the tiers did for the engine (the same on every rank; bytes are this rank's)."""

    steps: int = 0
    retries: int = 0
    moves: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    # L1 -> L2 moves into the L2 copy a block kept since its promotion (not in moves/bytes:
    # they copy nothing)
    kept_moves: int = 0
    # L2 -> L3 moves of blocks whose record the session's segment holds since they were loaded
    # from L3 (not in moves/bytes: nothing is written)
    kept_spills: int = 0
    recompute_blocks: int = 0  # blocks the controller asked to recompute
    recompute_tokens: int = 0  # tokens fed again because of them
    dropped_blocks: int = 0  # blocks the steps' plans dropped from every tier (or lost)
    resume_s: dict[str, list[float]] = field(
        default_factory=lambda: {"l1": [], "l2": [], "l3": []})  # by farthest source tier


@dataclass
class StepTrace:
    """The copies of one step on the device: (plan, direction, start, stop) CUDA events, and an
    event recorded when the step was scheduled (on an idle stream: the host's clock then)."""

    t0: Any
    spans: list[tuple[int, str, Any, Any]]

    def resolve(self) -> list[dict[str, Any]]:
        """Milliseconds from the schedule call to each copy batch's start and end (waits for
        them; call once the step is long done)."""
        out = []
        for plan, direction, start, stop in self.spans:
            stop.synchronize()
            out.append({"plan": plan, "dir": direction,
                        "start_ms": round(self.t0.elapsed_time(start), 3),
                        "stop_ms": round(self.t0.elapsed_time(stop), 3)})
        return out


class TieredEngine:
    """A PagedEngine whose L1 pool is the worker's HbmPool tensor and whose block tables come
    from the controller. Every rank builds one and makes the same calls (add_turn, step,
    close_session) in the same order; rank 0 talks to the controller, the runtime broadcasts.

    schedule: open unknown sessions, then `begin_step` (plans applied on every rank) and
    `end_step` at once, before the forward pass, so that a step whose blocks missed on L3 is
    simply scheduled again (with no new tokens) before any KV is read; the step's recompute
    ranges become `engine.invalidate(session, first_lost_block * block_tokens)`: the engine
    feeds every token from the first lost block on again (later blocks of the session are
    rewritten with the same KV, which keeps this to one call per session and always correct).
    With `hint_running` each step names the other decoding turns as upcoming (`_upcoming`).
    wait: the worker's copies into L1 are complete. report: attention mass and prefill speed to
    the controller (rank 0). release: close the session at the controller.
    """

    def __init__(self, rt: TpkvRuntime, model: Llama, *, report_prefill: bool = True,
                 max_retries: int = 2, hint_running: bool = True, **engine_kwargs: Any) -> None:
        self.rt = rt
        self.hint_running = hint_running
        self.report_prefill = report_prefill
        self.max_retries = max_retries
        self.opened: set[str] = set()
        self.stats = TierStats()
        self._resume: tuple[float, str] | None = None
        self._commit_ns = 0
        self._traced: list[Any] = []  # the plans the step applied with it (for its trace)
        # A resume's end on the GPU, timed on the device (wait() no longer holds the forward
        # back for it): (tier, host seconds from its schedule to the clock event, clock event,
        # event after its copies), resolved into stats.resume_s once the step is reported.
        self._resume_timing: tuple[str, float, Any, Any] | None = None
        # trace = True (GPU): each step keeps the device times of its copies (last_trace).
        self.trace = False
        self.last_trace: StepTrace | None = None
        self._clock: Any = None
        # Host seconds of the last step's parts: schedule (controller + plans issued; of it
        # schedule_plan and schedule_apply for its last attempt), wait (until its blocks are in
        # L1), forward (+ sampling; of it launched_apply, the late plans and deferred copies
        # issued once the forward is queued, and launched_prepare, Controller.prepare), report
        # (to the controller); commits: L3 manifest commits made on this thread in the step;
        # blocked: the step's plans' time blocked on other work (in schedule or launched).
        self.last_times: dict[str, float] = {}
        # A step's demotion-only plans are issued once its forward is launched (they free L1
        # for later steps; nothing in this one reads them): their host time runs beside it.
        # Then the controller prepares the next step's eviction orders (Controller.prepare).
        rt.worker.defer_demotions()
        self.returns = Returns(rt)
        self.engine = PagedEngine(model, rt.worker.hbm.tensor, schedule=self.schedule,
                                  wait=self.wait, report=self.report, release=self.release,
                                  launched=self.launched, admit=self.returns.admit,
                                  **engine_kwargs)
        self.returns.num_running = lambda: len(self.engine.running)
        self.returns.room = self.engine.room  # turns outside go in as the batch has places
        self.returns.new_session_tokens = self._new_session_tokens
        self.returns.decode_ahead = self._decode_ahead
        self.returns.turn_tokens = lambda names: sum(
            self.engine.seqs[n].max_new_tokens for n in names)
        self.block_tokens = self.engine.block_tokens

    def launched(self) -> None:
        """The step's forward is queued on the device: apply its plans that waited for this
        (run_step's late_ok), issue its deferred demotions, then send the next step's schedule
        (the batch the engine expects next), which the controller plans while the device
        computes: the next step finds it there."""
        t0 = time.perf_counter()
        self.rt.apply_late()
        self.rt.worker.executor.flush()
        if self.last_trace is not None:  # with the copies issued only now
            self.last_trace.spans = self._spans()
        t1 = time.perf_counter()
        nxt = self.engine.predict_next(self.returns.sample(self.engine.returning))
        if nxt is not None and nxt[0] and self.opened.issuperset(nxt[0]):
            ids, new, running = nxt
            self.rt.schedule_ahead(ids, new, self._upcoming(ids, running),
                                   self.returns.hints(ids))
        else:  # the commits and reports held for a schedule go alone
            self.rt.send_posts()
        self.last_times["launched_apply"] = t1 - t0
        self.last_times["launched_ahead"] = time.perf_counter() - t1

    # ---- the engine's four hooks ------------------------------------------------------------
    def schedule(self, session_ids: Sequence[str], num_new_tokens: Sequence[int]) -> StepResult:
        started = time.perf_counter()
        self._commit_ns = self.rt.worker.executor.commit_ns
        t0 = self._clock_event()
        self._resume_timing = None  # of a step whose forward failed
        for s in session_ids:
            if s not in self.opened:
                self.rt.open_session(s)
                self.opened.add(s)
        farthest = int(Tier.HBM)

        def attempt(step: StepResult) -> StepResult:  # before the forward: nothing read yet
            nonlocal farthest
            farthest = max(farthest, self._count(step))
            self._invalidate(step)
            return step

        retries = self.rt.num_retries
        # late_ok: a step whose plans only demote other sessions' blocks is applied in two
        # parts, its new blocks before the forward, its plans once the forward is launched
        # (confirmed at the next step)
        step = self.rt.run_step(session_ids, num_new_tokens, attempt, self._upcoming(session_ids),
                                max_retries=self.max_retries, late_ok=True,
                                resume=self.returns.hints(session_ids))
        self.stats.retries += self.rt.num_retries - retries
        self.stats.steps += 1
        self.returns.loaded(session_ids)
        self.returns.l2_room = step.l2_room
        self._resume = (started, TIER_NAMES[farthest]) if farthest != Tier.HBM else None
        self.last_times = {"schedule": time.perf_counter() - started,
                           **{f"schedule_{k}": v for k, v in self.rt.last_step_times.items()}}
        issued = [a.outcome.h2d_issued_ns for a in self.rt.worker.last_applied
                  if a.outcome.h2d_issued_ns]
        if issued:  # host seconds from the schedule's start to its first copy into L1
            self.last_times["first_h2d_issue"] = min(issued) / 1e9 - started
        self._traced = list(self.rt.worker.last_applied)
        if t0 is not None:
            self.last_trace = StepTrace(t0, self._spans())
        return step

    def step_plans(self) -> list[Any]:
        """This rank's AppliedPlans of the last step: those applied with it, then those
        applied once its forward was launched (late or deferred plans)."""
        later = [a for a in self.rt.worker.last_applied
                 if not any(a is b for b in self._traced)]
        return self._traced + later

    def _spans(self) -> list[tuple[int, str, Any, Any]]:
        """(plan, direction, start, stop) of the copy batches of the step's plans."""
        return [(i, *span) for i, a in enumerate(self.step_plans())
                for span in a.outcome.timing]

    def _upcoming(self, session_ids: Sequence[str],
                  running: Sequence[str] | None = None) -> list[str] | None:
        """With hint_running: the turns decoding (now, or `running`: when the step is planned
        ahead, those decoding after the step in flight) that are not in this step (a
        prefill's): they run again within a step or two, so the controller neither demotes
        them to make watermark room nor leaves them out of L1 (it prefetches what they miss).
        After them, the turns next in line for the batch (`_next_in_line`): their blocks come
        up in the steps before they join (the worker applies such prefetch-only plans once the
        forward is launched), so the step they join in has less or nothing to load."""
        if not self.hint_running:
            return None
        now = set(session_ids)
        if running is None:
            running = [q.session for q in self.engine.running]
        names = [s for s in running[:self.engine.max_batch] if s not in now]
        names += [s for s in self._next_in_line() if s not in now and s not in names]
        return names or None

    def _new_session_tokens(self, name: str) -> int:
        seq = self.engine.seqs[name]
        return seq.num_uncached if seq.num_cached == 0 else 0

    def _decode_ahead(self) -> int:
        """Rank 0: tokens the turns decoding and queued for the batch have yet to decode."""
        eng = self.engine
        return sum(q.max_new_tokens - len(q.generated) for q in (*eng.running, *eng.waiting))

    def _next_in_line(self) -> list[str]:
        """Rank 0: the sessions of the turns queued for the batch (`waiting`), then of those
        outside it that may go in (Returns.ready), in order, at most max_batch: only sessions
        the controller knows, not sent in to be recomputed, and with nothing on L3 that is not
        read ahead (a prefetch reads L3 only from memory; ReturningReads.done is false
        while a spill of the session runs, which its load would wait for)."""
        if self.rt.rank != 0:
            return []
        worker, returns, most = self.rt.worker, self.returns, self.engine.max_batch
        queued = (q.session for q in self.engine.waiting)
        outside = (q.session for q in self.engine.returning if returns.ready(q.session))
        out: list[str] = []
        for name in itertools.chain(queued, outside):  # (asked lazily: max_batch at most)
            if len(out) >= most:
                break
            if (name in self.opened and name not in returns.recompute and name not in out
                    and (worker.returning.done(name) or not worker.returning.on_l3(name))):
                out.append(name)
        return out

    def _clock_event(self, always: bool = False) -> Any:
        """With `trace` (or `always`) on the GPU: a timing event on an idle stream, recorded
        now (the device's clock at this host moment)."""
        device = self.rt.worker.hbm.device
        if not (self.trace or always) or device.type != "cuda":
            return None
        import torch

        if self._clock is None:
            self._clock = torch.cuda.Stream(device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._clock)
        return event

    def wait(self, tables: StepTables) -> None:
        """The forward waits on the device for the step's copies into L1 (no host wait). A
        resume ends when they are done on the device: on the GPU an event after them and a
        clock event recorded now time it (resolved at report()); on the CPU they are done."""
        t0 = time.perf_counter()
        self.rt.worker.wait_all()
        if self._resume is not None:
            started, tier = self._resume
            engine = self.rt.worker.executor.engine
            if engine.on_gpu:
                import torch

                done = torch.cuda.Event(enable_timing=True)
                done.record(engine.streams["h2d"])  # after every copy issued so far
                now = time.perf_counter()
                self._resume_timing = (tier, now - started, self._clock_event(always=True), done)
            else:
                self.stats.resume_s[tier].append(time.perf_counter() - started)
        self.last_times["wait"] = time.perf_counter() - t0

    def report(self, r: StepReport) -> None:
        self.last_times["forward"] = r.forward_s
        if self.engine.forward_device_s is not None:  # (engine.time_device)
            self.last_times["forward_device"] = self.engine.forward_device_s
        # L3 manifest commits (fsyncs) made on this thread in the step, wherever they fell
        self.last_times["commits"] = (self.rt.worker.executor.commit_ns - self._commit_ns) / 1e9
        # of the plans' host time, what they spent blocked on other work (spills still reading
        # the L2 slots they fill, earlier copies they follow): ExecOutcome.blocked_ns
        self.last_times["blocked"] = sum(a.outcome.blocked_ns for a in self.step_plans()) / 1e9
        if self._resume_timing is not None:  # its forward, which waited for it, is done
            tier, offset, clock, done = self._resume_timing
            self._resume_timing = None
            done.synchronize()
            self.stats.resume_s[tier].append(offset + clock.elapsed_time(done) / 1e3)
        t0 = time.perf_counter()
        try:
            self._report(r)
        finally:
            self.last_times["report"] = time.perf_counter() - t0

    def _report(self, r: StepReport) -> None:
        if self.rt.rank != 0:
            return
        updates = [(session, 0, mass) for session, mass in
                   zip(r.output.session_ids, r.output.block_mass) if len(mass)]
        if updates:  # sent, not waited for: the whole batch in one call
            self.rt.advise("report_attention", updates)
        if r.kind == "decode":
            self.returns.decoded(len(r.output.session_ids), r.forward_s)
        if self.report_prefill and r.kind == "prefill":  # (else the configured speed stands)
            self.returns.prefilled(int(sum(r.num_new_tokens)), r.forward_s)
            self.rt.advise("report_prefill", num_tokens=int(sum(r.num_new_tokens)),
                           seconds=r.forward_s)

    def release(self, session: str) -> object:
        self.returns.loaded([session])
        if session not in self.opened:
            return 0
        self.opened.discard(session)
        return self.rt.close_session(session)

    # ---- internals ---------------------------------------------------------------------------
    def _invalidate(self, step: StepResult) -> None:
        first: dict[str, int] = {}
        for i, start, stop in zip(step.recompute_session_idx.tolist(),
                                  step.recompute_start.tolist(), step.recompute_stop.tolist()):
            s = step.session_ids[i]
            first[s] = min(first.get(s, start), start)
            self.stats.recompute_blocks += stop - start
        for s, block in first.items():
            seq = self.engine.seqs[s]
            before = seq.num_uncached
            self.stats.recompute_tokens += self.engine.invalidate(s, block * self.block_tokens) \
                - before

    def _count(self, step: StepResult) -> int:
        """Add the step's moves to the stats; the farthest tier a batch session loads from."""
        farthest = int(Tier.HBM)
        batch = set(step.session_ids)
        bb = self.rt.worker.hbm.block_bytes
        self.stats.dropped_blocks += sum(len(d) for d in step.drops)
        for plan in step.plans:
            if not plan.num_moves:
                continue
            # Moves by (source, destination) tier in one pass: code = src * 4 + dst.
            n = np.bincount(plan.src_tier.astype(np.int64) * 4 + plan.dst_tier, minlength=16)
            if plan.num_kept:  # into the L2 copy or L3 record kept: nothing copied
                kept = plan.kept_mask()
                down = int(np.count_nonzero(kept & (plan.dst_tier == int(Tier.DRAM))))
                n[int(Tier.HBM) * 4 + int(Tier.DRAM)] -= down
                n[int(Tier.DRAM) * 4 + int(Tier.SSD)] -= plan.num_kept - down
                self.stats.kept_moves += down
                self.stats.kept_spills += plan.num_kept - down
            for name, (src, dst) in DIRECTIONS.items():
                moves = int(n[src * 4 + dst])
                self.stats.moves[name] += moves
                self.stats.bytes[name] += moves * bb
            if plan.session_names:
                ours = [i for i, name in enumerate(plan.session_names) if name in batch]
                mine = np.isin(plan.session_idx, ours) & (plan.src_tier > plan.dst_tier)
                if mine.any():
                    farthest = max(farthest, int(plan.src_tier[mine].max()))
        return farthest
