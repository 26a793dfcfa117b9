"""bench/e2e.py's tpkv part: one configuration of tiers driving the engine through the rounds."""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from typing import Any

import numpy as np
import torch

from bench.e2e_bound import bound, time_account, window_work
from bench.e2e_emulate import PacedStore
from bench.e2e_setup import Setting, ceilings, config_for, model_for  # noqa: F401 (e2e.py's)
from bench.e2e_stats import (  # noqa: F401  (rerate: e2e.py's import)
    ceiling_ms,
    disk_ms,
    matched_ratio,
    pct,
    rerate,
    resume_summary,
    thread_cpu,
    thread_cpu_since,
    top_functions,
    ttft_summary,
)
from bench.gc_clock import GC_CLOCK
from tpkv.config import GiB
from tpkv.errors import TpkvError
from tpkv.models.paged import paged_attention_ref, paged_attention_sdpa
from tpkv.models.tiered import StepTrace, TieredEngine
from tpkv.models.turns import Finished
from tpkv.protocol.plan import Tier


def run_tiered(s: Setting, sizes: Any, contexts: list[int], device: torch.device,
               ceil: dict[str, float], controller: str = "ray") -> dict[str, Any]:
    import tpkv

    cuda = device.type == "cuda"
    model = model_for(sizes.model, device)
    cfg = config_for(s, model, sizes.block_tokens, cuda, sizes.layer_events,
                     sizes.write_piece_mib << 20, sizes.write_threads,
                     sizes.prefetch_max_blocks, sizes.prefetch_stage_max_blocks)
    bt, bb = sizes.block_tokens, cfg.geometry.block_bytes
    l1_blocks = cfg.l1.slots(cfg.geometry)
    longest = max(contexts) + (sizes.rounds - 1) * (sizes.user_tokens + sizes.gen_tokens) + 1
    max_batch = (l1_blocks - 8) // -(-longest // bt)
    if max_batch < 1:
        raise SystemExit(f"({s.key}): L1 of {l1_blocks} blocks cannot hold one session of "
                         f"{longest} tokens plus 8 blocks of room; raise --l1-gib")
    t_start = time.perf_counter()
    rt = tpkv.init(cfg, controller=controller, device=device)
    rt.worker.host.wait_pinned()  # L2 comes online in the background: measure it whole
    paced = None
    if s.emulate_gbps and rt.worker.store is not None:  # its disk at the emulated speed
        paced = PacedStore(rt.worker.store, s.emulate_gbps)
        ceil = {**ceil, "disk_read": s.emulate_gbps, "disk_write": s.emulate_gbps}
    try:
        attention = paged_attention_sdpa if cuda else paged_attention_ref
        tiered = TieredEngine(rt, model, max_batch=max_batch, max_prefill_tokens=1,
                              report_prefill=not s.always_load,
                              attention=attention)
        tiered.trace = cuda  # device times of each step's copies, for the resume records
        tiered.engine.time_device = cuda  # and of each forward (parts: forward_device_ms)
        # every graph shape the run can meet, captured before it (as a server would at start)
        t_graphs = time.perf_counter()
        ahead = {"graphs": tiered.engine.capture_graphs(longest)}
        ahead["seconds"] = round(time.perf_counter() - t_graphs, 2)
        gc_mark = GC_CLOCK.install().mark()
        if sizes.arrivals:
            from bench.e2e_arrive import Arrivals

            r = Arrivals(tiered, sizes, contexts, bb, ceil).run()
        else:
            r = Rounds(tiered, sizes, contexts, bb, ceil).run()
        r["graphs_captured_ahead"] = ahead
        if paced is not None:  # once every spill is written (spills run in the background)
            rt.worker.executor.wait_spills(time.monotonic() + 120, every=True)
            r["emulated_l3"] = paced.stats()
        eng = rt.worker.engine  # how well the slot placement let copies merge into runs
        r["copy_blocks"], r["copy_descriptors"] = dict(eng.num_blocks), dict(eng.num_descriptors)
        # late plans whose read-ahead copies into L2 were waited for at the next step
        r["reads_later"] = rt.worker.num_reads_later
        snap = rt.controller.snapshot()
        r["events"] = snap["event_counts"]  # the controller's, by kind
        # the spill pacer's disk: the write rate the ranks' spills measured, its lag in steps
        r["spill_pace"] = snap["spill_pace"]
        r["rates"] = snap["rates"]  # the cost model's measured rates (stage_blocks reads them)
        r["late_steps"] = rt.worker.num_late
        r["gc"] = GC_CLOCK.since(gc_mark)  # this process's collections during the run
        # steps planned ahead and used as planned, or applied without their forward
        r["ahead_steps"] = {"used": rt.num_ahead_used, "unused": rt.num_ahead_unused}
        r["chained_moves"] = rt.worker.executor.num_chained  # L2 -> L1 moves issued during reads
        direct = rt.worker.executor.direct  # of those, copied from read-ahead buffers
        r["direct_blocks"] = 0 if direct is None else direct.num_blocks
        # turns back from L3: read ahead while they waited outside the batch (sessions, and the
        # blocks their steps took from memory), or sent in to be recomputed (models/returns.py)
        ahead = rt.worker.store.ahead if rt.worker.store is not None else None
        r["returns"] = {"read_ahead": tiered.returns.num_read_ahead,
                        "recomputed": tiered.returns.num_recomputed,
                        "served_blocks": ahead.num_served if ahead is not None else 0,
                        # kept outside while L2 had no room for their fresh K/V without a drop
                        "held_for_disk": tiered.returns.num_held,
                        "spill_wait_s": round(tiered.returns.spill_wait_s, 3)}
        r["dropped_blocks"] = tiered.stats.dropped_blocks  # (after the fill: dropped_blocks_fill)
        if rt.worker.store is not None:  # where the L3 reads' time went
            # spill pieces that paused for a step's reads; steps that waited for spills (they
            # went first then)
            r["l3_write_pauses"], r["l3_writes_first"] = rt.worker.store.write_pauses()
            # waits for spills of spills.LONG_WAIT_S or more (each logged with its spills)
            r["spill_long_waits"] = rt.worker.executor.spills.num_long_waits
            rs = rt.worker.store.read_stats()
            r["l3_reads"] = {"jobs": rs.jobs, "bytes": rs.bytes, "job_s": round(rs.job_s, 3),
                             "syscall_share": round(rs.syscall_s / max(rs.job_s, 1e-9), 3)}
    finally:
        rt.close()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    r.update({"label": s.label, "controller": controller, "l1_gib": s.l1_bytes / GiB,
              "l2_gib": s.l2_bytes / GiB,
              "l3_gib": s.l3_bytes / GiB if s.ssd_root else 0.0, "max_batch": max_batch,
              "block_bytes": bb, "emulated": bool(s.emulate_gbps),
              "emulate_gbps": s.emulate_gbps,
              "mode": "arrivals" if sizes.arrivals else "rounds",
              "wall_s": round(time.perf_counter() - t_start, 1)})
    return r


# _l2_state: how many of the next free L2 slots handed out it looks at (512 MiB of the e2e's
# 512 KiB blocks, about a resume's refill)
NEXT_L2 = 1024


class Rounds:
    """The fill round then the turn rounds; per-step and per-resume records."""

    def __init__(self, tiered: TieredEngine, sizes: Any, contexts: list[int], block_bytes: int,
                 ceil: dict[str, float]) -> None:
        self.tiered, self.engine, self.sizes = tiered, tiered.engine, sizes
        self.contexts, self.bb, self.ceil = contexts, block_bytes, ceil
        self.vocab = tiered.engine.model.config.vocab_size
        # decode: (ms, moved, batch, KV tokens the batch attends over, whether the batch's
        # sessions differ from the last decode step's)
        # decode steps: (ms, tier traffic, batch, KV tokens, batch changed, a CUDA graph was
        # captured in it: the step's time is the capture's, not the traffic's)
        self.steps: list[tuple[float, bool, int, int, bool, bool]] = []
        self._members: tuple[str, ...] = ()
        self.resumes: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.held_after_fill = 0
        self.dropped_fill = 0  # blocks dropped in the fill round
        self.traffic: list[dict[str, Any]] = []  # decode steps with moves: parts and copies
        self.quiet_parts: list[dict[str, float]] = []  # decode steps without: parts
        mode = sizes.profile
        self.profile = cProfile.Profile() if mode == 1 else None
        # mode 2: each decode step profiled alone, then added to the traffic or the quiet sum
        self.step_stats: dict[str, tuple[pstats.Stats | None, int]] | None = (
            {"traffic": (None, 0), "quiet": (None, 0)} if mode == 2
            else {"admit": (None, 0)} if mode == 3 else None)
        # prefill steps: (tokens fed, forward ms, whether none of its blocks was loaded,
        # tokens cached before it)
        self.prefills: list[tuple[int, float, bool, int]] = []
        self.window: dict[str, Any] | None = None  # open_window(): where the bound counts from
        self._returning: dict[str, bool] = {}  # the session's last turn: one after another
        # turns whose first token is not there yet: (added, returning, queued s, turn, tokens
        # the session holds once it is)
        self._first_token: dict[str, tuple[float, bool, float, int, int]] = {}
        self.ttft: list[dict[str, Any]] = []  # every turn's time to first token
        # every step: (what it was, its seconds, its forward's seconds): the window's account
        self.spent: list[tuple[str, float, float]] = []

    def run(self) -> dict[str, Any]:
        sizes, names = self.sizes, [f"s{i}" for i in range(len(self.contexts))]
        rng = np.random.default_rng(sizes.seed + 1)
        gen_tokens, t_turns = 0, 0.0
        for rnd in range(sizes.rounds):
            if rnd == 1:  # the measured window (throughput, bound): the turn rounds
                self.open_window()
            t0 = time.perf_counter()
            # a round's turns all come at once, in a random order: the engine takes them into
            # its batch as it has room, and what waits is known (a read ahead can start early)
            for i in rng.permutation(len(names)).tolist():
                n = self.contexts[i] if rnd == 0 else sizes.user_tokens
                self.add_turn(names[i], rng.integers(0, self.vocab, n).tolist(),
                              sizes.gen_tokens if rnd else 1, returning=rnd > 0, turn=rnd)
            try:
                made = self._drain()
            except (TpkvError, torch.OutOfMemoryError) as exc:
                self.failures.append(f"round {rnd}: {type(exc).__name__}: {exc}"[:300])
                return self._report(gen_tokens, t_turns)
            gen_tokens += made if rnd else 0
            print(f"  round {rnd}: {time.perf_counter() - t0:.1f} s", flush=True)
            if rnd == 0:
                self.held_after_fill = self._held(names)
                self.dropped_fill = self.tiered.stats.dropped_blocks
            else:
                t_turns += time.perf_counter() - t0
        return self._report(gen_tokens, t_turns)

    def add_turn(self, session: str, tokens: list[int], gen: int, *, returning: bool,
                 queued_s: float = 0.0, turn: int = 0) -> None:
        """engine.add_turn, timed: the turn's first token is looked for after every step
        (queued_s: how long it waited in the driver's own queue before this call)."""
        seq = self.engine.seqs.get(session)
        # the session's tokens once this turn's first is sampled: held + prompt + 1
        after = (len(seq.token_ids) if seq is not None else 0) + len(tokens) + 1
        self.engine.add_turn(session, tokens, gen)
        self._returning[session] = returning
        self._first_token[session] = (time.perf_counter(), returning, queued_s, turn, after)

    def open_window(self) -> None:
        """From now on steps, bytes and recomputed tokens count toward the run's bound."""
        st = self.tiered.stats
        self.window = {"decode": len(self.steps), "prefill": len(self.prefills),
                       "bytes": dict(st.bytes), "spent": len(self.spent),
                       "threads": thread_cpu()}

    def _drain(self) -> int:
        """Step until the queued turns are done; returns tokens generated."""
        tokens = 0
        while self.engine.has_work:
            tokens += self.one_step()[0]
        return tokens

    def one_step(self) -> tuple[int, list[Finished]]:
        """One engine step, recorded; returns the batch's size (tokens made) and the turns
        it finished."""
        e, st = self.engine, self.tiered.stats
        t_admit = time.perf_counter()
        if self.step_stats is not None and "admit" in self.step_stats:
            self._add_profile("admit", e.admit_pending)
        else:
            e.admit_pending()  # whom the step runs, in waiting and running
        self.spent.append(("admit", time.perf_counter() - t_admit, 0.0))
        prefill = e.prefill_next
        kind = "prefill" if prefill else "decode"
        session = e.waiting[0].session if prefill else None
        returning = session is not None and self._returning.get(session, False)
        fed = e.waiting[0].num_uncached if prefill else 0
        context = e.waiting[0].num_cached if prefill else 0
        batch = 1 if prefill else min(len(e.running), e.max_batch)
        kv_tokens = 0 if prefill else sum(len(q.token_ids) for q in e.running[:batch])
        members = () if prefill else tuple(q.session for q in e.running[:batch])
        moves0, recompute0 = dict(st.moves), st.recompute_tokens
        loads0 = {t: len(v) for t, v in st.resume_s.items()}
        profiled = self.profile is not None and returning
        if profiled:  # the host side of a resume: its schedule and wait, not the forward
            e.schedule, e.wait = self._profiled(self.tiered.schedule, self.tiered.wait)
        step_prof = (cProfile.Profile() if self.step_stats is not None and kind == "decode"
                     and "quiet" in self.step_stats else None)
        l2_before = self._l2_state()
        l3_before = self._l3_sources()
        captures0 = e.graphs.captures if e.graphs is not None else 0
        gc0 = GC_CLOCK.total_s
        t0 = time.perf_counter()
        if step_prof is not None:
            finished = step_prof.runcall(e.step)
        else:
            finished = e.step()
        t1 = time.perf_counter()
        ms = (t1 - t0) * 1e3
        gc_ms = round(1e3 * (GC_CLOCK.total_s - gc0), 3)  # collections during the step
        self._first_tokens(t1)
        what = ("idle" if not batch else "resume" if returning else kind)
        self.spent.append((what, t1 - t0, self.tiered.last_times.get("forward", 0.0)
                           if batch else 0.0))
        if profiled:
            e.schedule, e.wait = self.tiered.schedule, self.tiered.wait
        moved = {k: st.moves[k] - moves0[k] for k in st.moves}
        if step_prof is not None:
            self._add_stats("traffic" if any(moved.values()) else "quiet", step_prof)
        # whether the step's forward captured a CUDA graph (a shape new to this
        # configuration's engine: its time is mostly the capture's)
        captured = e.graphs is not None and e.graphs.captures > captures0
        if kind == "decode":
            changed, self._members = members != self._members, members
            self.steps.append((ms, any(moved.values()), batch, kv_tokens, changed, captured))
            shape = {"batch": batch, "kv_tokens": kv_tokens, "batch_changed": changed,
                     "captured_graph": captured, "gc_ms": gc_ms}
            if any(moved.values()):
                self.traffic.append({"step_ms": round(ms, 3), "moved": moved, **shape,
                                     **self._parts(), **l2_before,
                                     **self._l3_sources(l3_before),
                                     "spill_wait_ms": self._spill_wait_ms(),
                                     "trace": self.tiered.last_trace})
            else:
                self.quiet_parts.append({"step_ms": round(ms, 3), **shape, **self._parts()})
        else:
            loaded = {t: len(v) > loads0[t] for t, v in st.resume_s.items()}
            # (tokens fed, forward ms, whether no block of it was loaded into L1, tokens
            # cached before): the bound's prefill time (e2e_bound.prefill_s)
            self.prefills.append((fed + st.recompute_tokens - recompute0,
                                  1e3 * self.tiered.last_times.get("forward", t1 - t0),
                                  not (loaded["l2"] or loaded["l3"]), context))
            if returning:
                self._resume(session, ms, moved, st.recompute_tokens > recompute0, loaded)
                # tokens recomputed against those the session held: all of them where the
                # turn was sent to the GPU, part where blocks of it were dropped
                self.resumes[-1].update({**l2_before, **self._l3_sources(l3_before),
                                         "gc_ms": gc_ms, "context_tokens": context,
                                         "recomputed_tokens": st.recompute_tokens - recompute0,
                                         "captured_graph": captured})
        return batch, finished

    def _first_tokens(self, now: float) -> None:
        """Turns whose Seq now holds a generated token: their time to first token, from
        add_turn, whatever engine queue they waited in."""
        for s, (added, returning, queued_s, turn, after) in list(self._first_token.items()):
            seq = self.engine.seqs.get(s)  # (the last turn's tokens stay until it is reset)
            if seq is not None and seq.generated and len(seq.token_ids) >= after:
                del self._first_token[s]
                self.ttft.append({"session": s, "turn": turn, "returning": returning,
                                  "ttft_ms": round(1e3 * (now - added), 3),
                                  "queued_ms": round(1e3 * queued_s, 3)})

    def _resume(self, session: str | None, ms: float, moved: dict[str, int], recomputed: bool,
                loaded: dict[str, bool]) -> None:
        st = self.tiered.stats
        src = ("recompute" if recomputed else "l3" if loaded["l3"] else "l2" if loaded["l2"]
               else "l1")
        resume_ms = ms if src in ("recompute", "l1") else 1e3 * st.resume_s[src][-1]
        b2, b3 = moved["l2_l1"] * self.bb, moved["l3_l2"] * self.bb
        ceil_ms = (ceiling_ms(b2, b3, self.ceil) if src in ("l2", "l3") and "h2d" in self.ceil
                   else None)
        self.resumes.append({"session": session, "source": src, "resume_ms": round(resume_ms, 3),
                             "ttft_ms": round(ms, 3), "bytes_l2_l1": b2, "bytes_l3_l2": b3,
                             "ceiling_ms": None if ceil_ms is None else round(ceil_ms, 3),
                             **disk_ms(src, b3, self.ceil), "moved": moved,
                             # host ms its L3 reads waited for spills (into L2 slots still
                             # being written to disk, or of the session itself)
                             "spill_wait_ms": self._spill_wait_ms(),
                             **self._parts(), "trace": self.tiered.last_trace})

    def _spill_wait_ms(self) -> float:
        return round(sum(a.outcome.spill_wait_ns for a in self.tiered.step_plans()) / 1e6, 3)

    def _l2_state(self) -> dict[str, int]:
        """Before a step, with L3: the controller's free L2 slots, how many of them a
        background spill still reads (a copy into one waits for that spill), and of the next
        NEXT_L2 slots it hands out, how many; and the spills running. Empty without L3."""
        ex = self.tiered.rt.worker.executor
        table = getattr(self.tiered.rt.controller, "table", None)
        if ex.store is None or table is None:
            return {}
        free = table.free[int(Tier.DRAM)]
        slots = free.stack[:free.top]
        running = [sp.slots for sp in ex.spills.running if not sp.future.done()]
        read = np.concatenate(running) if running else np.zeros(0, dtype=np.int64)
        busy = np.isin(slots, read)
        return {"l2_free": len(slots), "l2_free_spilling": int(busy.sum()),
                "l2_next_spilling": int(busy[::-1][:NEXT_L2].sum()),
                "spills_running": len(running)}

    def _l3_sources(self, before: dict[str, int] | None = None) -> dict[str, int]:
        """The L3 blocks this rank's step reads took from read-ahead buffers and from the disk
        so far, or since `before` (empty without L3)."""
        store = self.tiered.rt.worker.store
        if store is None:
            return {}
        now = {"l3_from_read_ahead": store.ahead.num_served,
               "l3_from_disk": store.step_disk_blocks}
        return now if before is None else {k: v - before.get(k, 0) for k, v in now.items()}

    def _add_profile(self, key: str, fn: Any) -> None:
        prof = cProfile.Profile()
        prof.runcall(fn)
        self._add_stats(key, prof)

    def _add_stats(self, key: str, prof: cProfile.Profile) -> None:
        assert self.step_stats is not None
        acc, n = self.step_stats[key]
        if acc is None:
            acc = pstats.Stats(prof)
        else:
            acc.add(prof)
        self.step_stats[key] = (acc, n + 1)

    def _profiled(self, *fns: Any) -> list[Any]:
        prof = self.profile
        assert prof is not None
        return [lambda *a, _f=f: prof.runcall(_f, *a) for f in fns]

    def _parts(self) -> dict[str, float]:
        return {f"{k}_ms": round(1e3 * v, 3) for k, v in self.tiered.last_times.items()}

    def _held(self, names: list[str]) -> int:
        """Sessions whose every block is still in some tier (resumable without recompute)."""
        m = self.tiered.rt.controller_slot_map()
        kept = np.asarray(m["tiers"]) != int(Tier.NONE)  # dropped blocks keep a row, tier NONE
        counts = np.bincount(np.asarray(m["session_idx"])[kept],
                             minlength=len(m["session_names"]))
        have = dict(zip(m["session_names"], counts.tolist()))
        bt = self.engine.block_tokens
        return sum(1 for s in names if s in self.engine.seqs
                   and have.get(s, 0) >= -(-self.engine.seqs[s].num_cached // bt))

    def _report(self, gen_tokens: int, t_turns: float) -> dict[str, Any]:
        st, steps = self.tiered.stats, self.steps
        for rec in (*self.resumes, *self.traffic):  # the copies' device times, once all done
            if isinstance(rec.get("trace"), StepTrace):
                rec["copies"] = rec.pop("trace").resolve()
            else:
                rec.pop("trace", None)
        ms = [s[0] for s in steps]
        # the step times against each other leave out the steps that captured a graph
        timed = [s for s in steps if not s[5]]
        quiet = [s[0] for s in timed if not s[1]]
        busy = [s[0] for s in timed if s[1]]
        out: dict[str, Any] = {
            "sessions": len(self.contexts), "sessions_held": self.held_after_fill,
            "dropped_blocks_fill": self.dropped_fill,
            "oom_or_failures": len(self.failures), "failures": self.failures,
            "decode_tokens_per_s": round(gen_tokens / t_turns, 1) if t_turns else None,
            "decode_step_tokens_per_s": round(sum(s[2] for s in steps) / (sum(ms) / 1e3), 1)
            if ms else None,
            "step_ms_p50": pct(ms, 50), "step_ms_p99": pct(ms, 99),
            "step_ms_p50_quiet": pct(quiet, 50), "step_ms_p50_traffic": pct(busy, 50),
            "step_ms_p99_traffic": pct(busy, 99),
            "decode_steps": len(ms), "decode_steps_with_traffic": len(busy),
            "decode_steps_capturing_a_graph": len(steps) - len(timed),
            "resume_steps_capturing_a_graph": sum(bool(r.get("captured_graph"))
                                                  for r in self.resumes),
            "step_ms_traffic_vs_quiet": round(float(np.median(busy) / np.median(quiet)), 3)
            if busy and quiet else None,
            "step_ms_traffic_vs_matched_quiet": matched_ratio(timed),
            "moves": dict(st.moves), "bytes": dict(st.bytes),
            # L1 -> L2 moves into the L2 copy a block kept since its promotion, and L2 -> L3
            # moves of blocks whose record is on disk since their load: no bytes moved
            "kept_moves": st.kept_moves,
            "kept_spills": st.kept_spills,
            "recompute_tokens": st.recompute_tokens, "retries": st.retries,
            "resumes_by_source": {}, "resume_vs_ceiling": {}, "resume_records": self.resumes,
            "traffic_records": self.traffic}
        # where a decode step with tier traffic spends its host time, and one without
        for key, recs in (("traffic_parts", self.traffic),
                          ("quiet_parts", self.quiet_parts),
                          ("quiet_changed_parts",  # quiet steps whose batch changed
                           [r for r in self.quiet_parts if r["batch_changed"]])):
            for q in ((50, 90) if recs else ()):
                out[f"{key}_p{q}_ms"] = {k: pct([r[k] for r in recs if k in r], q)
                                         for k in recs[-1] if k.endswith("_ms")}
        if self.profile is not None:
            stats, n = pstats.Stats(self.profile), max(1, len(self.resumes))
            out["profile_top"] = top_functions(stats, n, "ms_per_resume")
            out["profile_tpkv"] = top_functions(stats, n, "ms_per_resume", 60, tpkv_only=True)
        for key, (acc, n) in (self.step_stats or {}).items():
            if acc is not None:
                out[f"profile_{key}_steps"] = n
                out[f"profile_{key}_top"] = top_functions(acc, n, "ms_per_step")
                out[f"profile_{key}_tpkv"] = top_functions(acc, n, "ms_per_step", 60,
                                                           tpkv_only=True)
        out.update(resume_summary(self.resumes))
        out.update(ttft_summary(self.ttft, sum(v[1] for v in self._first_token.values())))
        if self.window is not None:  # what the window did, at the rates measured in the run
            out["bound"] = bound(window_work(steps, self.prefills, self.window, dict(st.bytes),
                                             t_turns, gen_tokens), self.ceil)
            out["window_s"] = time_account(self.spent[self.window["spent"]:], t_turns)
            # CPU seconds of each kind of thread in the window: what runs beside the step
            out["window_thread_cpu_s"] = thread_cpu_since(self.window["threads"])
        return out
