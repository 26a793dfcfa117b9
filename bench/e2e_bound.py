"""bench/e2e.py's bound per run: the run's own work at the rates measured in it, each resource
(the GPU, each PCIe direction, disk reads, disk writes) working in parallel with the others."""

from __future__ import annotations

from typing import Any

import numpy as np

# What each field of a configuration's "bound" means (written into the result JSON).
TERMS = {
    "gpu_decode_s": "the window's decode steps, each at the wall time of the run's quiet decode "
                    "steps (no tier move in the step) of the same batch size nearest in KV "
                    "tokens (median of up to 9; of any batch size where that one has none): "
                    "the same steps without tier work beside them",
    "gpu_prefill_s": "the window's prefill steps (turn prompts plus the tokens recomputed): "
                     "one that loaded no block at its own forward time (forward + sampling); "
                     "one whose forward waited for blocks copied into L1 at the least of its "
                     "forward time and the greater of a line fit (ms against tokens fed) over "
                     "the run's prefills that loaded none and a quiet decode step of batch 1 "
                     "nearest in KV tokens (one pass over the weights)",
    "gpu_s": "gpu_decode_s + gpu_prefill_s: the GPU runs one step at a time",
    "pcie_h2d_s": "bytes moved L2 -> L1 / the h2d ceiling (one 1 GiB pinned copy); "
                  "absent on the CPU",
    "pcie_d2h_s": "bytes moved L1 -> L2 / the d2h ceiling (PCIe is full duplex: its own "
                  "resource); absent on the CPU",
    "disk_read_s": "bytes moved L3 -> L2 / the disk's read rate (the run's O_DIRECT probe of "
                   "the L3 directory, the faster of start and end; emulated: the pace)",
    "disk_write_s": "bytes moved L2 -> L3 / the disk's write rate (likewise)",
    "bound_s": "max of gpu_s, pcie_h2d_s, pcie_d2h_s, disk_read_s, disk_write_s: the best "
               "schedule of this work when every resource runs at its measured rate at once",
    "limited_by": "the resource whose term is bound_s",
    "measured_s": "wall time of the window (rounds: the turn rounds; arrivals: the whole run "
                  "without the idle time skipped between arrivals)",
    "bound_tokens_per_s": "tokens generated in the window / bound_s",
    "throughput_vs_bound": "bound_s / measured_s: the run's generated tokens/s over "
                           "bound_tokens_per_s (1.0: nothing waited beyond the busiest "
                           "resource)",
}

# resource term -> (bytes key in the window's moves, ceiling key)
_LINKS = {"pcie_h2d_s": ("l2_l1", "h2d"), "pcie_d2h_s": ("l1_l2", "d2h"),
          "disk_read_s": ("l3_l2", "disk_read"), "disk_write_s": ("l2_l3", "disk_write")}


def _quiet(steps: list[tuple[float, bool, int, int, bool, bool]]) -> np.ndarray:
    """[n, 3] (batch, KV tokens, ms) of the quiet decode steps (the fastest tenth of all steps
    stands for one where every step moved blocks)."""
    quiet = [(s[2], s[3], s[0]) for s in steps if not s[1]]
    if not quiet and steps:
        ms = sorted(s[0] for s in steps)
        quiet = [(s[2], s[3], ms[len(ms) // 10]) for s in steps]
    return np.array(quiet, dtype=np.float64).reshape(-1, 3)


def _quiet_ms(quiet: np.ndarray, batch: int, kv: int, k: int = 9) -> float:
    same = quiet[quiet[:, 0] == batch]
    pool = same if len(same) else quiet
    if not len(pool):
        return 0.0
    near = np.argsort(np.abs(pool[:, 1] - kv), kind="stable")[:k]
    return float(np.median(pool[near, 2]))


def quiet_decode_s(steps: list[tuple[float, bool, int, int, bool, bool]], first: int) -> float:
    """Seconds of decode steps[first:] each at the time of the quiet steps alike (TERMS)."""
    quiet = _quiet(steps)
    return sum(_quiet_ms(quiet, s[2], s[3]) for s in steps[first:]) / 1e3


def prefill_fit(prefills: list[tuple[int, float, bool, int]]) -> np.ndarray | None:
    """(slope, intercept) of forward ms against tokens fed over the prefills that loaded no
    block; None without two sizes of them."""
    clean = [(t, ms) for t, ms, ok, _ in prefills if ok and t > 0]
    if len({t for t, _ in clean}) < 2:
        return None
    return np.polyfit([t for t, _ in clean], [ms for _, ms in clean], 1)


def prefill_s(prefills: list[tuple[int, float, bool, int]],
              steps: list[tuple[float, bool, int, int, bool, bool]], first: int) -> float:
    """Seconds of prefills[first:] on the GPU (TERMS)."""
    fit, quiet = prefill_fit(prefills), _quiet(steps)
    total = 0.0
    for tokens, ms, clean, context in prefills[first:]:
        if not clean:  # its forward waited for copies: at most that long, at least one pass
            line = 0.0 if fit is None else float(np.polyval(fit, tokens))
            ms = min(ms, max(line, _quiet_ms(quiet, 1, context)))
        total += ms
    return total / 1e3


def window_work(steps: list[tuple[float, bool, int, int, bool, bool]],
                prefills: list[tuple[int, float, bool, int]], window: dict[str, Any],
                bytes_now: dict[str, int], measured_s: float, tokens: int) -> dict[str, Any]:
    """What the window did: GPU seconds at quiet rates, bytes by direction, time, tokens."""
    return {"gpu_decode_s": round(quiet_decode_s(steps, window["decode"]), 4),
            "gpu_prefill_s": round(prefill_s(prefills, steps, window["prefill"]), 4),
            "bytes": {k: v - window["bytes"].get(k, 0) for k, v in bytes_now.items()},
            "measured_s": round(measured_s, 4), "tokens": tokens}


def time_account(spent: list[tuple[str, float, float]], measured_s: float) -> dict[str, float]:
    """Where the window's wall time went: per kind of step (decode, prefill of a first turn,
    resume: a returning turn's prefill, idle: a step with nothing to run) its seconds and its
    forwards' seconds, the engine's admission of turns before each step (admit: with nothing
    to run, it waits for a read ahead) and the time outside any step."""
    out: dict[str, float] = {}
    for what, step_s, forward_s in spent:
        out[f"{what}_s"] = out.get(f"{what}_s", 0.0) + step_s
        if what not in ("idle", "admit"):
            out[f"{what}_forward_s"] = out.get(f"{what}_forward_s", 0.0) + forward_s
    out["outside_steps_s"] = measured_s - sum(s for _, s, _ in spent)
    out["measured_s"] = measured_s
    return {k: round(v, 3) for k, v in sorted(out.items())}


def bound(work: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    """The bound of `work` at the rates in `ceil` (GB/s), with its terms (TERMS)."""
    terms: dict[str, float] = {
        "gpu_s": round(work["gpu_decode_s"] + work["gpu_prefill_s"], 4)}
    for name, (direction, rate) in _LINKS.items():
        if ceil.get(rate):
            terms[name] = round(work["bytes"].get(direction, 0) / (ceil[rate] * 1e9), 4)
    limited_by = max(terms, key=lambda k: terms[k])
    bound_s = terms[limited_by]
    out: dict[str, Any] = {**terms, "bound_s": bound_s, "limited_by": limited_by,
                           "work": work, "rates_gbps": {k: round(v, 3) for k, v in ceil.items()}}
    if bound_s > 0 and work["measured_s"] > 0:
        out["bound_tokens_per_s"] = round(work["tokens"] / bound_s, 1)
        out["throughput_vs_bound"] = round(bound_s / work["measured_s"], 3)
    return out
