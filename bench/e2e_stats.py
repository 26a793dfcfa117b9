"""bench/e2e.py's summaries: percentiles, resumes against their ceilings, matched step ratios."""

from __future__ import annotations

import os
import pstats
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np


def top_functions(stats: pstats.Stats, n: int, unit: str, rows: int = 40,
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


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def ceiling_ms(bytes_l2_l1: int, bytes_l3_l2: int, ceil: dict[str, float]) -> float:
    """(e) for one resume: its bytes at the measured speeds, the disk read then the copy."""
    return 1e3 * (bytes_l2_l1 / (ceil["h2d"] * 1e9) + bytes_l3_l2 / (ceil["disk_read"] * 1e9))


def disk_ms(src: str, bytes_l3_l2: int, ceil: dict[str, float]) -> dict[str, float]:
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
        out[f"resume_ms_p50_{src}"] = pct(vals, 50)
        out[f"resume_ms_p99_{src}"] = pct(vals, 99)
        out[f"ttft_ms_p50_{src}"] = pct([r["ttft_ms"] for r in rs], 50)
        ratio = [r["resume_ms"] / r["ceiling_ms"] for r in rs if r["ceiling_ms"]]
        if ratio:
            out["resume_vs_ceiling"][src] = pct(ratio, 50)
            out[f"ceiling_ms_p50_{src}"] = pct([r["ceiling_ms"] for r in rs], 50)
        disk = [r["resume_ms"] / r["disk_ms"] for r in rs if r.get("disk_ms")]
        if disk:
            out[f"resume_{src}_vs_disk_read_p50"] = pct(disk, 50)
    resumed = [r["resume_ms"] for r in resumes]
    out["resume_ms_p50"], out["resume_ms_p99"] = pct(resumed, 50), pct(resumed, 99)
    return out


def ttft_summary(records: list[dict[str, Any]], missing_returning: int) -> dict[str, Any]:
    """Time to first token of returning turns (a session's turn after its first), from
    add_turn to the end of the step whose output first held a token of the turn; with a
    driver queue before add_turn (arrivals), also from the turn's arrival."""
    back = [r for r in records if r["returning"]]
    first = [r["ttft_ms"] for r in records if not r["returning"]]
    out: dict[str, Any] = {"returning_turns_timed": len(back),
                           "returning_turns_without_first_token": missing_returning,
                           "returning_ttft_ms_p50": pct([r["ttft_ms"] for r in back], 50),
                           "returning_ttft_ms_p99": pct([r["ttft_ms"] for r in back], 99),
                           "first_turn_ttft_ms_p50": pct(first, 50), "ttft_records": records}
    if any(r["queued_ms"] for r in back):
        arrived = [r["ttft_ms"] + r["queued_ms"] for r in back]
        out["returning_ttft_from_arrival_ms_p50"] = pct(arrived, 50)
        out["returning_ttft_from_arrival_ms_p99"] = pct(arrived, 99)
    return out


def matched_ratio(steps: list[tuple[float, bool, int, int, bool, bool]], k: int = 9
                  ) -> float | None:
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
    for ms, busy, b, tokens, changed, _ in steps:
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
            r.update(disk_ms(r["source"], r["bytes_l3_l2"], ceil))
    result.update(resume_summary(result.get("resume_records", [])))
    if "bound" in result:
        from bench.e2e_bound import bound

        result["bound"] = bound(result["bound"]["work"], ceil)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of every thread of this process so far, by its id: Python's thread name
    where the thread is Python's, else the kernel's (Ray's, torch's, numba's own threads)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # (it ended meanwhile)
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        fields = rest.split()  # from the state on: utime and stime are the 12th and 13th
        out[int(tid)] = (names.get(int(tid), comm), (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_cpu_since(before: dict[int, tuple[str, float]], rows: int = 16) -> dict[str, float]:
    """CPU seconds each kind of thread spent since `before` (threads named alike, such as a
    pool's, summed), the busiest first: which threads run beside the step in a window."""
    spent: dict[str, float] = {}
    for tid, (name, cpu) in thread_cpu().items():
        kind = re.sub(r"[_-]?\d+$", "", name)
        spent[kind] = spent.get(kind, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:rows]
    return {k: round(v, 2) for k, v in top if v > 0}
