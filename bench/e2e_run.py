"""bench/e2e.py's tpkv part: one configuration of tiers driving the engine through the rounds."""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tpkv.config import GiB, HbmConfig, HostConfig, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.errors import TpkvError
from tpkv.models.fingerprint import llama_fingerprint
from tpkv.models.llama import Llama, build_model
from tpkv.models.paged import paged_attention_ref, paged_attention_sdpa
from tpkv.models.tiered import StepTrace, TieredEngine
from tpkv.protocol.plan import Tier


@dataclass(frozen=True)
class Setting:
    key: str
    label: str
    l1_bytes: int
    l2_bytes: int  # 0: the smallest L2 the config allows (one block)
    ssd_root: str | None
    l3_bytes: int = 0
    spill: str = "always"  # PolicyConfig.spill: "always" keeps the most sessions
    # Returns always load from L2/L3: the cost model is told a prefill speed far below any
    # real one, and the engine does not report the measured speed (to time L3 resumes on a
    # machine whose disk reads KV slower than the model recomputes it).
    always_load: bool = False


# The prefill speed (tokens/s) the cost model believes in an always_load setting.
_SLOW_PREFILL = 1.0


_MODELS: dict[tuple[str, str], Llama] = {}


def model_for(name: str, device: torch.device) -> Llama:
    key = (name, str(device))
    if key not in _MODELS:
        _MODELS[key] = build_model(name, seed=0, device=device)
    return _MODELS[key]


def ceilings(device: torch.device, ssd_root: str) -> dict[str, float]:
    """GB/s of one contiguous 1 GiB pinned copy each way and of raw O_DIRECT on the L3 disk."""
    from bench.transfer import raw_odirect

    out: dict[str, float] = {}
    if device.type == "cuda":
        from bench.transfer import ceilings as pcie

        c = pcie(GiB, 5)
        out["h2d"], out["d2h"] = c["h2d"], c["d2h"]
    disk = raw_odirect(Path(ssd_root) / "raw-ceiling.bin", GiB // 4 if device.type == "cpu"
                       else 2 * GiB)
    out["disk_write"], out["disk_read"] = disk["write"], disk["read"]
    return out


def config_for(s: Setting, model: Llama, block_tokens: int, cuda: bool,
               layer_events: int = 1, l1_reuse: str = "newest", l2_reuse: str = "newest",
               write_piece_bytes: int = 4 << 20, write_threads: int = 8) -> TpkvConfig:
    g = model.kv_geometry(tp_size=1, block_tokens=block_tokens)
    bb = g.block_bytes
    l2 = max(s.l2_bytes, bb)
    l3 = (SsdConfig(root=str(Path(s.ssd_root) / f"l3-{s.key}"), budget_bytes=s.l3_bytes,
                    o_direct=cuda, io_threads=8 if cuda else 2,
                    write_piece_bytes=write_piece_bytes, write_threads=write_threads)
          if s.ssd_root else SsdConfig())
    # Automatic pins off: at these sizes 10% of all blocks is about the whole L1 budget.
    extra: dict[str, Any] = {"prefill_tokens_per_s": _SLOW_PREFILL} if s.always_load else {}
    policy = PolicyConfig(cooldown_s=0.0, auto_pin_fraction=0.0, spill=s.spill,
                          l1_reuse=l1_reuse, l2_reuse=l2_reuse,  # type: ignore[arg-type]
                          **extra)
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=s.l1_bytes // bb),
                      l2=HostConfig(budget_bytes=l2, arena_bytes=min(l2, GiB) // bb * bb),
                      l3=l3, policy=policy, wait_timeout_s=300.0,
                      layer_events=bool(layer_events), model_fingerprint=llama_fingerprint(model))


def run_tiered(s: Setting, sizes: Any, contexts: list[int], device: torch.device,
               ceil: dict[str, float], controller: str = "ray") -> dict[str, Any]:
    import tpkv

    cuda = device.type == "cuda"
    model = model_for(sizes.model, device)
    cfg = config_for(s, model, sizes.block_tokens, cuda, sizes.layer_events,
                     sizes.l1_reuse, sizes.l2_reuse,
                     sizes.write_piece_mib << 20, sizes.write_threads)
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
    try:
        attention = paged_attention_sdpa if cuda else paged_attention_ref
        tiered = TieredEngine(rt, model, max_batch=max_batch, max_prefill_tokens=1,
                              report_prefill=not s.always_load,
                              attention=attention)
        tiered.trace = cuda  # device times of each step's copies, for the resume records
        r = Rounds(tiered, sizes, contexts, bb, ceil).run()
        eng = rt.worker.engine  # how well the slot placement let copies merge into runs
        r["copy_blocks"], r["copy_descriptors"] = dict(eng.num_blocks), dict(eng.num_descriptors)
        r["events"] = rt.controller.snapshot()["event_counts"]  # the controller's, by kind
        r["late_steps"] = rt.worker.num_late
        # steps planned ahead and used as planned, or applied without their forward
        r["ahead_steps"] = {"used": rt.num_ahead_used, "unused": rt.num_ahead_unused}
        r["chained_moves"] = rt.worker.executor.num_chained  # L2 -> L1 moves issued during reads
        gate = getattr(rt.worker.store, "_gate", None)
        if gate is not None:  # spill pieces that waited for a resume's reads
            r["l3_write_pauses"] = gate.num_pauses
        if rt.worker.store is not None:  # where the L3 reads' time went
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
              "block_bytes": bb, "wall_s": round(time.perf_counter() - t_start, 1)})
    return r


# _l2_state: how many of the next free L2 slots handed out it looks at (512 MiB of the e2e's
# 512 KiB blocks, about a resume's refill)
NEXT_L2 = 1024


def _top(stats: pstats.Stats, n: int, unit: str, rows: int = 40,
         tpkv_only: bool = False) -> list[dict[str, Any]]:
    """The functions with the most own time, per one of the n profiled steps; with tpkv_only,
    tpkv's own functions with the most time under them (what the tiers add to a step)."""
    items = stats.stats.items()  # type: ignore[attr-defined]
    if tpkv_only:
        items = [kv for kv in items if f"{os.sep}tpkv{os.sep}" in kv[0][0]]
    top = sorted(items, key=lambda kv: -kv[1][3 if tpkv_only else 2])[:rows]
    return [{"fn": f"{Path(f).name}:{line}({name})", "calls": v[1],
             f"tottime_{unit}": round(v[2] * 1e3 / n, 4),
             f"cumtime_{unit}": round(v[3] * 1e3 / n, 4)}
            for (f, line, name), v in top]


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


class Rounds:
    """The fill round then the turn rounds; per-step and per-resume records."""

    def __init__(self, tiered: TieredEngine, sizes: Any, contexts: list[int], block_bytes: int,
                 ceil: dict[str, float]) -> None:
        self.tiered, self.engine, self.sizes = tiered, tiered.engine, sizes
        self.contexts, self.bb, self.ceil = contexts, block_bytes, ceil
        self.vocab = tiered.engine.model.config.vocab_size
        # decode: (ms, moved, batch, KV tokens the batch attends over, whether the batch's
        # sessions differ from the last decode step's)
        self.steps: list[tuple[float, bool, int, int, bool]] = []
        self._members: tuple[str, ...] = ()
        self.resumes: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.held_after_fill = 0
        self.traffic: list[dict[str, Any]] = []  # decode steps with moves: parts and copies
        self.quiet_parts: list[dict[str, float]] = []  # decode steps without: parts
        mode = getattr(sizes, "profile", 0)
        self.profile = cProfile.Profile() if mode == 1 else None
        # mode 2: each decode step profiled alone, then added to the traffic or the quiet sum
        self.step_stats: dict[str, tuple[pstats.Stats | None, int]] | None = (
            {"traffic": (None, 0), "quiet": (None, 0)} if mode == 2 else None)

    def run(self) -> dict[str, Any]:
        sizes, names = self.sizes, [f"s{i}" for i in range(len(self.contexts))]
        rng = np.random.default_rng(sizes.seed + 1)
        gen_tokens, t_turns = 0, 0.0
        for rnd in range(sizes.rounds):
            t0 = time.perf_counter()
            order = rng.permutation(len(names))
            for first in range(0, len(order), self.engine.max_batch):
                for i in order[first:first + self.engine.max_batch].tolist():
                    n = self.contexts[i] if rnd == 0 else sizes.user_tokens
                    self.engine.add_turn(names[i], rng.integers(0, self.vocab, n).tolist(),
                                         sizes.gen_tokens if rnd else 1)
                try:
                    made = self._drain(rnd)
                except (TpkvError, torch.OutOfMemoryError) as exc:
                    self.failures.append(f"round {rnd}: {type(exc).__name__}: {exc}"[:300])
                    return self._report(gen_tokens, t_turns)
                gen_tokens += made if rnd else 0
            print(f"  round {rnd}: {time.perf_counter() - t0:.1f} s", flush=True)
            if rnd == 0:
                self.held_after_fill = self._held(names)
            else:
                t_turns += time.perf_counter() - t0
        return self._report(gen_tokens, t_turns)

    def _drain(self, rnd: int) -> int:
        """Step until the queued turns are done; returns tokens generated."""
        e, st, tokens = self.engine, self.tiered.stats, 0
        while e.has_work:
            kind = "prefill" if e.waiting else "decode"
            session = e.waiting[0].session if e.waiting else None
            batch = 1 if e.waiting else min(len(e.running), e.max_batch)
            kv_tokens = 0 if e.waiting else sum(len(q.token_ids) for q in e.running[:batch])
            members = () if e.waiting else tuple(q.session for q in e.running[:batch])
            moves0, recompute0 = dict(st.moves), st.recompute_tokens
            loads0 = {t: len(v) for t, v in st.resume_s.items()}
            profiled = self.profile is not None and rnd > 0 and kind == "prefill"
            if profiled:  # the host side of a resume: its schedule and wait, not the forward
                e.schedule, e.wait = self._profiled(self.tiered.schedule, self.tiered.wait)
            step_prof = (cProfile.Profile() if self.step_stats is not None and rnd > 0
                         and kind == "decode" else None)
            l2_before = self._l2_state()
            t0 = time.perf_counter()
            if step_prof is not None:
                step_prof.runcall(e.step)
            else:
                e.step()
            ms = (time.perf_counter() - t0) * 1e3
            if profiled:
                e.schedule, e.wait = self.tiered.schedule, self.tiered.wait
            moved = {k: st.moves[k] - moves0[k] for k in st.moves}
            if step_prof is not None and self.step_stats is not None:
                key = "traffic" if any(moved.values()) else "quiet"
                acc, n = self.step_stats[key]
                if acc is None:
                    acc = pstats.Stats(step_prof)
                else:
                    acc.add(step_prof)
                self.step_stats[key] = (acc, n + 1)
            tokens += batch
            if kind == "decode":
                changed, self._members = members != self._members, members
                self.steps.append((ms, any(moved.values()), batch, kv_tokens, changed))
                shape = {"batch": batch, "kv_tokens": kv_tokens, "batch_changed": changed}
                if any(moved.values()):
                    self.traffic.append({"step_ms": round(ms, 3), "moved": moved, **shape,
                                         **self._parts(), **l2_before,
                                         "trace": self.tiered.last_trace})
                else:
                    self.quiet_parts.append({"step_ms": round(ms, 3), **shape, **self._parts()})
            elif rnd:
                self._resume(session, ms, moved, st.recompute_tokens > recompute0,
                             {t: len(v) > loads0[t] for t, v in st.resume_s.items()})
                self.resumes[-1].update(l2_before)
        return tokens

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
                             **_disk_ms(src, b3, self.ceil), "moved": moved,
                             # host ms its L3 reads waited for spills (into L2 slots still
                             # being written to disk, or of the session itself)
                             "spill_wait_ms": round(sum(
                                 a.outcome.spill_wait_ns for a in
                                 self.tiered.step_plans()) / 1e6, 3),
                             **self._parts(), "trace": self.tiered.last_trace})

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
        quiet = [s[0] for s in steps if not s[1]]
        busy = [s[0] for s in steps if s[1]]
        out: dict[str, Any] = {
            "sessions": len(self.contexts), "sessions_held": self.held_after_fill,
            "oom_or_failures": len(self.failures), "failures": self.failures,
            "decode_tokens_per_s": round(gen_tokens / t_turns, 1) if t_turns else None,
            "decode_step_tokens_per_s": round(sum(s[2] for s in steps) / (sum(ms) / 1e3), 1)
            if ms else None,
            "step_ms_p50": _pct(ms, 50), "step_ms_p99": _pct(ms, 99),
            "step_ms_p50_quiet": _pct(quiet, 50), "step_ms_p50_traffic": _pct(busy, 50),
            "decode_steps": len(ms), "decode_steps_with_traffic": len(busy),
            "step_ms_traffic_vs_quiet": round(float(np.median(busy) / np.median(quiet)), 3)
            if busy and quiet else None,
            "step_ms_traffic_vs_matched_quiet": matched_ratio(steps),
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
                out[f"{key}_p{q}_ms"] = {k: _pct([r[k] for r in recs if k in r], q)
                                         for k in recs[-1] if k.endswith("_ms")}
        if self.profile is not None:
            stats, n = pstats.Stats(self.profile), max(1, len(self.resumes))
            out["profile_top"] = _top(stats, n, "ms_per_resume")
            out["profile_tpkv"] = _top(stats, n, "ms_per_resume", 60, tpkv_only=True)
        for key, (acc, n) in (self.step_stats or {}).items():
            if acc is not None:
                out[f"profile_{key}_steps"] = n
                out[f"profile_{key}_top"] = _top(acc, n, "ms_per_step")
                out[f"profile_{key}_tpkv"] = _top(acc, n, "ms_per_step", 60, tpkv_only=True)
        out.update(resume_summary(self.resumes))
        return out


def ceiling_ms(bytes_l2_l1: int, bytes_l3_l2: int, ceil: dict[str, float]) -> float:
    """(e) for one resume: its bytes at the measured speeds, the disk read then the copy."""
    return 1e3 * (bytes_l2_l1 / (ceil["h2d"] * 1e9) + bytes_l3_l2 / (ceil["disk_read"] * 1e9))


def _disk_ms(src: str, bytes_l3_l2: int, ceil: dict[str, float]) -> dict[str, float]:
    """An L3 resume's read alone at the disk's read ceiling: the bound once its copies into L1
    overlap its reads (chained loads), as the ceiling's sum of the two does not assume."""
    if src != "l3" or not ceil.get("disk_read"):
        return {}
    return {"disk_ms": round(1e3 * bytes_l3_l2 / (ceil["disk_read"] * 1e9), 3)}


def resume_summary(resumes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per source tier: count, resume and first-token percentiles, ratio to the ceiling."""
    out: dict[str, Any] = {"resumes_by_source": {}, "resume_vs_ceiling": {}}
    for src in ("l1", "l2", "l3", "recompute"):
        rs = [r for r in resumes if r["source"] == src]
        if not rs:
            continue
        vals = [r["resume_ms"] for r in rs]
        out["resumes_by_source"][src] = len(rs)
        out[f"resume_ms_p50_{src}"] = _pct(vals, 50)
        out[f"resume_ms_p99_{src}"] = _pct(vals, 99)
        out[f"ttft_ms_p50_{src}"] = _pct([r["ttft_ms"] for r in rs], 50)
        ratio = [r["resume_ms"] / r["ceiling_ms"] for r in rs if r["ceiling_ms"]]
        if ratio:
            out["resume_vs_ceiling"][src] = _pct(ratio, 50)
            out[f"ceiling_ms_p50_{src}"] = _pct([r["ceiling_ms"] for r in rs], 50)
        disk = [r["resume_ms"] / r["disk_ms"] for r in rs if r.get("disk_ms")]
        if disk:
            out[f"resume_{src}_vs_disk_read_p50"] = _pct(disk, 50)
    resumed = [r["resume_ms"] for r in resumes]
    out["resume_ms_p50"], out["resume_ms_p99"] = _pct(resumed, 50), _pct(resumed, 99)
    return out


def matched_ratio(steps: list[tuple[float, bool, int, int, bool]], k: int = 9) -> float | None:
    """Median over the decode steps with tier traffic of step time / the median time of the k
    quiet steps alike (the same batch size, the batch changed since the last decode step or
    not) nearest in KV tokens: the same step with and without the traffic beside it. The
    traffic runs in the steps after a resume, whose batch has just changed and attends over
    other contexts than the average step: the two medians alone compare different steps."""
    quiet: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}
    for key in {(s[2], s[4]) for s in steps}:
        q = sorted((s[3], s[0]) for s in steps if not s[1] and (s[2], s[4]) == key)
        if q:
            quiet[key] = (np.array([t for t, _ in q]), np.array([m for _, m in q]))
    ratios = []
    for ms, busy, b, tokens, changed in steps:
        if not busy or len(quiet.get((b, changed), ((),))[0]) < k:
            continue
        toks, times = quiet[(b, changed)]
        near = np.argsort(np.abs(toks - tokens), kind="stable")[:k]
        ratios.append(ms / float(np.median(times[near])))
    return round(float(np.median(ratios)), 3) if ratios else None


def rerate(result: dict[str, Any], ceil: dict[str, float]) -> None:
    """Hold a configuration's resumes against other ceilings (in place)."""
    for r in result.get("resume_records", []):
        if r.get("ceiling_ms") is not None:
            r["ceiling_ms"] = round(ceiling_ms(r["bytes_l2_l1"], r["bytes_l3_l2"], ceil), 3)
            r.update(_disk_ms(r["source"], r["bytes_l3_l2"], ceil))
    result.update(resume_summary(result.get("resume_records", [])))
