"""End to end on one GPU: tpkv's engine GPU only vs L1+L2 vs L1+L2+L3, beside transformers'
offloaded cache and the transfer ceiling of the resumed bytes, all on the same seeded sessions.

    python bench/e2e.py            # quick look: a few minutes on an H200
    python bench/e2e.py --full     # the published numbers (one device call, < 10 minutes)
    python bench/e2e.py --device cpu   # tiny sizes (CPU preset): a few minutes on 2 cores
    python bench/e2e.py --full --arrivals 1             # Poisson arrivals + think time
    python bench/e2e.py --full --emulate-l3-gbps 7,14   # + (c2) on a RAM L3 paced to 7, 14 GB/s
    python bench/e2e.py --full --model 8b               # 128 KiB of KV per token

The workload: every session first reads a long context (its prefill is the "fill" round), then
comes back for more turns (a user message, a generated answer) in seeded random order; the
others' turns are its think time. Every session returns only after all others had a turn, so a
node that cannot hold them all must recompute (a) or load them back from L2 / L3 (b, c).
With --arrivals 1 the same sessions and turns come in time instead (bench/e2e_arrive.py:
Poisson arrivals, exponential think times). Every configuration reports the time to first
token of returning turns and a bound: its own work at the rates measured in the run
(bench/e2e_bound.py; the result's "bound_terms" says what each term is).
Writes bench/results/e2e.json (+ .png with bench/plot_e2e.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.e2e_bound import TERMS  # noqa: E402
from bench.e2e_emulate import (  # noqa: E402
    MODELS,
    dir_speed,
    fit,
    kv_bytes_per_token,
    model_config,
    mount_of,
)
from bench.e2e_run import Setting, ceilings, rerate, run_tiered  # noqa: E402
from bench.e2e_warm import warm_up  # noqa: E402
from bench.transfer import raw_odirect, raw_odirect_read  # noqa: E402
from tpkv.config import GiB  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    model: str = "1b"
    block_tokens: int = 16
    l1_gib: float = 1.0  # KV budget in GPU memory, the same for every configuration
    l2_gib: float = 3.0
    l2_all_gib: float = 24.0  # (b2): an L2 that holds every session (the node's DRAM allows it)
    l3_gib: float = 8.0
    # (c3): an L3 that holds every session with room for dead records (its copies of loaded
    # sessions then stay)
    l3_all_gib: float = 24.0
    sessions: int = 96
    context: tuple[int, int] = (4096, 8192)  # tokens of each session's first turn
    rounds: int = 3  # the fill round, then rounds - 1 turns per session
    user_tokens: int = 64
    gen_tokens: int = 16  # per turn after the fill round (the fill round's answer is 1 token)
    hf_seconds: float = 60.0  # wall-time cap of the transformers run
    # 1: L2 -> L1 copies layer by layer (TpkvConfig.layer_events); 0: whole blocks. The engine's
    # forward is one graph that waits for every layer, so per-layer events only multiply the
    # copy descriptors by the chunks (8 here: ~2.4 ms more host time a 768-block resume,
    # bench/results/copy_issue.json).
    layer_events: int = 0
    # SsdConfig.write_piece_bytes in MiB: the most of a spill one write carries between the
    # pauses it makes while a resume reads L3 (per writing thread: write_threads).
    write_piece_mib: int = 4
    # SsdConfig.write_threads: the store's threads that write spills (its 8 others read).
    write_threads: int = 8
    # PolicyConfig.prefetch_max_blocks: blocks a step brings up ahead of need, into L1 and from
    # L3 into L2 each (a turn in line's L3 blocks come up in parts of at most this many)
    prefetch_max_blocks: int = 1024
    # PolicyConfig.prefetch_stage_max_blocks: of those, L3 -> L2 stages per step (0: measured)
    prefetch_stage_max_blocks: int = 0
    seed: int = 0
    # 1: cProfile the resume steps (host time by function, in the config's "profile_top");
    # 2: the decode steps, those with tier traffic and those without apart ("profile_traffic_top",
    # "profile_quiet_top", ms per step); 3: the admission before each step ("profile_admit_top",
    # ms per step)
    profile: int = 0
    # 1: sessions arrive as a Poisson process of arrival_per_s and come back think_s (mean,
    # exponential) after each answer, instead of the rounds; at most `admit` turns in the engine
    # at once (0: its max_batch), the rest queue in the driver (TTFT from arrival counts it)
    arrivals: int = 0
    arrival_per_s: float = 2.0
    think_s: float = 20.0
    admit: int = 0


# (a) holds about 5 sessions in 1 GiB of L1; 96 sessions need L2 + L3 for the rest.
QUICK = Sizes(sessions=96, l2_gib=6.0, l3_gib=16.0)
FULL = Sizes(l1_gib=2.0, l2_gib=16.0, l2_all_gib=48.0, l3_gib=28.0, l3_all_gib=44.0, sessions=96,
             context=(8192, 16384))
# Without --full on a CPU: the tiny model (1.5 KiB of KV per token), 24 sessions, (a) holding
# about 4 of them; a few minutes on 2 cores.
CPU = Sizes(model="tiny", l1_gib=0.004, l2_gib=0.008, l2_all_gib=0.05, l3_gib=0.03,
            l3_all_gib=0.05, sessions=24, context=(256, 512), user_tokens=16, gen_tokens=4,
            hf_seconds=10.0, arrival_per_s=20.0, think_s=0.5)


def parse() -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the published sizes")
    ap.add_argument("--configs", default="a,b,b2,c,c2,d",
                    help="subset of a,b,b2,c,c2,c3,d to run (c3: resumes from L3, not default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ssd-dir", default=None, help="L3 directory (default: a temp dir)")
    ap.add_argument("--out", default="bench/results/e2e.json")
    ap.add_argument("--controller", choices=["ray", "local"], default="ray",
                    help="the controller's transport: the Ray actor (default) or in process")
    ap.add_argument("--emulate-l3-gbps", default="",
                    help="comma-separated GB/s: run --emulate-configs again with L3 on "
                         "--emulate-dir, reads and writes each paced to that rate (labelled "
                         "emulated; results as '<config>-em<GB/s>')")
    ap.add_argument("--emulate-configs", default="c2",
                    help="configurations the emulated L3 runs (of c, c2, c3)")
    ap.add_argument("--emulate-dir", default="/dev/shm",
                    help="a RAM-backed directory for the emulated L3")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the short run that warms the process before the measured "
                         "configurations (bench/e2e_warm.py)")
    ap.add_argument("--compare-local", action="store_true",
                    help="run each configuration again with the in-process controller, in "
                         "the order actor, in process, in process, actor (results as "
                         "'<config>', '<config>-local', '<config>-local-2', '<config>-2'; "
                         "ratios of the means of their step times)")
    ap.add_argument("--compare-pairs", type=int, default=2, choices=[1, 2],
                    help="with --compare-local: 2 runs each in that order (a drift over "
                         "the process's life or a first run's cost falls on both alike), "
                         "1: actor then in process")
    for f in dataclasses.fields(Sizes):
        kind = type(f.default)
        if kind is tuple:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, nargs=2, default=None)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
    args = ap.parse_args()
    sizes = FULL if args.full else QUICK if args.device != "cpu" else CPU
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
               if getattr(args, f.name) is not None}
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
    if "context" not in changes and changes.get("model") in MODELS:
        # the same KV bytes per session as the 1b preset's table: fewer, larger tokens
        scale = kv_bytes_per_token(model_config("1b")) / kv_bytes_per_token(
            model_config(changes["model"]))
        changes["context"] = tuple(int(c * scale) for c in sizes.context)
    sizes = dataclasses.replace(sizes, **changes)
    if sizes.arrival_per_s <= 0 or sizes.think_s < 0 or sizes.admit < 0:
        raise SystemExit(f"arrivals need --arrival-per-s > 0, --think-s >= 0 and --admit >= 0, "
                         f"got {sizes.arrival_per_s}, {sizes.think_s}, {sizes.admit}")
    return args, sizes


DEFINITIONS = {
    "returning_ttft_ms": "a returning turn (a session's turn after its first): wall time from "
                         "its engine.add_turn to the end of the step after which the session's "
                         "Seq first holds a generated token of that turn, whatever engine "
                         "queue it waited in; p50 and p99 per configuration",
    "returning_ttft_from_arrival_ms": "arrivals: the same from the turn's arrival, with its "
                                      "wait in the driver's queue (at most --admit turns in "
                                      "the engine)",
    "emulated": "'<config>-em<G>': the configuration with L3 on --emulate-dir (RAM), every "
                "read_blocks and write_blocks of the worker's store paced to G GB/s (reads "
                "and writes each on their own clock); emulated_l3 gives the bytes paced, the "
                "time slept and the I/Os that ended after their interval (late: the store's "
                "own path slower than the pace)",
    "sessions_held": "rounds: sessions whose every block is in some tier after the fill round; "
                     "arrivals: at the end of the run",
}


def settings(sizes: Sizes, ssd_root: str) -> dict[str, Setting]:
    l1 = int(sizes.l1_gib * GiB)
    return {
        # GPU only: no L3, and the smallest L2 the config allows (one block): a session that
        # does not fit in L1 loses its blocks and is recomputed when it returns.
        "a": Setting("a", "GPU only (evict + recompute)", l1, 0, None),
        "b": Setting("b", "L1+L2", l1, int(sizes.l2_gib * GiB), None),
        # The same with an L2 larger than all sessions' KV: every return loads from L2.
        "b2": Setting("b2", "L1+L2, L2 holds all", l1, int(sizes.l2_all_gib * GiB), None),
        "c": Setting("c", "L1+L2+L3", l1, int(sizes.l2_gib * GiB), ssd_root,
                     int(sizes.l3_gib * GiB)),
        # tpkv's default policy: spills paced to the disk, dropped rather than waited for.
        "c2": Setting("c2", "L1+L2+L3, default policy (spills paced to the disk)", l1,
                      int(sizes.l2_gib * GiB), ssd_root, int(sizes.l3_gib * GiB), spill="cost"),
        # (c) with every return loaded, however slow the disk, and an L3 that holds every
        # session: times resumes from L3 against their ceiling (not in the default list: it
        # adds about two minutes to --full).
        "c3": Setting("c3", "L1+L2+L3, L3 holds all, returns always loaded", l1,
                      int(sizes.l2_gib * GiB), ssd_root, int(sizes.l3_all_gib * GiB),
                      always_load=True),
    }


def main() -> None:
    args, sizes = parse()
    wanted = args.configs.split(",")
    device = torch.device(args.device)
    rng = np.random.default_rng(sizes.seed)
    contexts = rng.integers(sizes.context[0], sizes.context[1] + 1, sizes.sessions).tolist()
    started = time.time()
    rates = [float(g) for g in args.emulate_l3_gbps.split(",") if g.strip()]
    emulate = [k for k in args.emulate_configs.split(",") if k] if rates else []
    if any(g <= 0 for g in rates) or not set(emulate) <= {"c", "c2", "c3"}:
        raise SystemExit(f"--emulate-l3-gbps needs rates > 0 ({rates}) and --emulate-configs "
                         f"a subset of c,c2,c3 ({emulate})")
    sizing = fit(model_config(sizes.model), sizes, wanted, emulate)
    print("sizes against one H200 and its host:", sizing, flush=True)
    if device.type == "cuda" and not sizing["fits"]:
        raise SystemExit(f"these sizes do not fit one H200 (139 GiB) and its host (128 GiB): "
                         f"{sizing}")
    if emulate:  # the emulated L3 lives in RAM: its directory must hold the largest one
        need = max(sizes.l3_all_gib if k == "c3" else sizes.l3_gib for k in emulate) * GiB
        free = shutil.disk_usage(args.emulate_dir).free
        if free < need:
            raise SystemExit(f"--emulate-dir {args.emulate_dir} has {free / GiB:.1f} GiB free, "
                             f"the emulated L3 needs {need / GiB:.1f} GiB")
        em_dir = {**mount_of(args.emulate_dir), "one_thread_gbps": dir_speed(args.emulate_dir)}
        print("emulated L3 directory:", em_dir, flush=True)
        if not em_dir["huge_pages"]:
            print(f"note: {args.emulate_dir} is not a tmpfs with huge pages: its writes cost a "
                  "page allocation per 4 KiB (1.3-1.5 GB/s a thread on the H200 host), so the "
                  "pace may not be reached; `mount -t tmpfs -o huge=always,size=48G tmpfs DIR` "
                  "and --emulate-dir DIR", flush=True)
    ssd_root = args.ssd_dir or tempfile.mkdtemp(prefix="tpkv-e2e-")
    Path(ssd_root).mkdir(parents=True, exist_ok=True)
    ceil = ceilings(device, ssd_root)
    print("ceilings (GB/s):", {k: round(v, 2) for k, v in ceil.items()}, flush=True)
    # The disk's read ceiling reads back, once, what it has just written. Diagnostics beside it
    # (no ratio uses them): the same read of another file at once repeated, and at the end of
    # the run, when its data is minutes old as an L3 session's is (a virtual disk may serve a
    # first read of fresh data from a cache, or in a burst its sustained rate does not keep).
    aged = Path(ssd_root) / "aged-ceiling.bin"
    fresh = raw_odirect(aged, GiB // 4 if device.type == "cpu" else GiB, keep=True)["read"]
    disk_reads = {"fresh": round(fresh, 3), "again": round(raw_odirect_read(aged), 3)}
    results: dict[str, Any] = {}
    head = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "sizes": dataclasses.asdict(sizes), "ceilings_gbps": ceil, "sizing": sizing,
            "bound_terms": TERMS, "definitions": DEFINITIONS}
    if emulate:
        head["emulate_dir"] = em_dir
    if not args.no_warm_up:
        warm = warm_up(sizes, device, ceil, args.controller)
        print(f"== warm-up (not measured): {warm['seconds']:.1f} s, moves {warm['moves']}",
              flush=True)
    for key, setting in settings(sizes, ssd_root).items():
        if key in wanted:
            print(f"== ({key}) {setting.label}", flush=True)
            results[key] = run_tiered(setting, sizes, contexts, device, ceil, args.controller)
            print(json.dumps(summary_line(results[key])), flush=True)
            write(args.out, head, results, started)  # what is done survives a cut-off run
            if args.compare_local and args.controller != "local":
                again = [("local", "-local")] + ([("local", "-local-2"),
                                                  (args.controller, "-2")]
                                                 if args.compare_pairs == 2 else [])
                for controller, suffix in again:
                    print(f"== ({key}{suffix}) the same, {controller} controller", flush=True)
                    shutil.rmtree(Path(ssd_root) / f"l3-{key}", ignore_errors=True)
                    results[key + suffix] = run_tiered(setting, sizes, contexts, device, ceil,
                                                       controller)
                    print(json.dumps(summary_line(results[key + suffix])), flush=True)
                    write(args.out, head, results, started)
            # its L3 files go before the next configuration starts (the disk holds one L3;
            # deleting tens of GiB takes seconds)
            shutil.rmtree(Path(ssd_root) / f"l3-{key}", ignore_errors=True)
    for g in rates:  # L3 on a RAM-backed directory, paced: a faster disk than this one
        for key in emulate:
            base = settings(sizes, ssd_root)[key]
            root = tempfile.mkdtemp(prefix="tpkv-e2e-em-", dir=args.emulate_dir)
            em = dataclasses.replace(base, key=f"{key}-em{g:g}", ssd_root=root, emulate_gbps=g,
                                     label=f"{base.label}, L3 emulated at {g:g} GB/s (RAM)")
            print(f"== ({em.key}) {em.label}", flush=True)
            try:
                results[em.key] = run_tiered(em, sizes, contexts, device, ceil, args.controller)
                print(json.dumps(summary_line(results[em.key])), flush=True)
                write(args.out, head, results, started)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    if "d" in wanted:
        from bench.e2e_hf import run_hf

        print("== (d) transformers, DynamicCache(offloading=True)", flush=True)
        results["d"] = run_hf(sizes, contexts, device)
        print(json.dumps(summary_line(results["d"])), flush=True)
    # Again at the end: the link and the disk move between minutes (the disk by 10-20%). A
    # ceiling is what they can do, so the resumes are held against the faster of the two.
    head["ceilings_gbps_start"] = dict(ceil)
    head["ceilings_gbps_end"] = end = ceilings(device, ssd_root)
    print("ceilings at the end (GB/s):", {k: round(v, 2) for k, v in end.items()}, flush=True)
    disk_reads["at_end"] = round(raw_odirect_read(aged), 3)
    aged.unlink()
    head["disk_read_diagnostic_gbps"] = disk_reads
    print(f"disk reads of a file written at the start (GB/s): {disk_reads}", flush=True)
    moved = {k: round(end[k] / ceil[k], 2) for k in ceil if abs(end[k] / ceil[k] - 1) > 0.1}
    if moved:
        print(f"warning: ceilings moved by more than 10% during the run (end / start): {moved}",
              flush=True)
    if any(end[k] > ceil[k] for k in ceil):
        best = {k: max(ceil[k], end[k]) for k in ceil}
        head["ceilings_gbps"] = best
        for key, r in results.items():
            if key not in ("d", "e"):
                g = r.get("emulate_gbps")
                rerate(r, {**best, "disk_read": g, "disk_write": g} if g else best)
    out = write(args.out, head, results, started)
    print(json.dumps(out["ratios"], indent=1))
    if not args.ssd_dir:
        shutil.rmtree(ssd_root, ignore_errors=True)


def write(path: str, head: dict[str, Any], results: dict[str, Any], started: float
          ) -> dict[str, Any]:
    if "c" in results:  # (e): the transfer time of the bytes (c) resumed, at measured speeds
        c = results["c"]
        results["e"] = {"label": "ceiling: resumed bytes at measured PCIe / disk speed",
                        **{k: v for k, v in c.items() if k.startswith("ceiling_ms_p50_")}}
    out = {**head, "configs": results, "ratios": ratios(results),
           "wall_s": round(time.time() - started, 1)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def summary_line(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("sessions_held", "oom_or_failures", "decode_tokens_per_s", "step_ms_p50",
            "step_ms_p99", "resume_ms_p50", "returning_ttft_ms_p50", "returning_ttft_ms_p99",
            "wall_s")
    out = {k: r.get(k) for k in keys}
    if r.get("failures"):
        out["failures"] = r["failures"]
    if "bound" in r:
        out["throughput_vs_bound"] = r["bound"].get("throughput_vs_bound")
        out["bound_limited_by"] = r["bound"]["limited_by"]
    return out


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Against (a) and against the ceiling (e), with the goals of the benchmark's issue."""
    out: dict[str, Any] = {}
    a = results.get("a")
    for key, r in results.items():
        if key == "e":
            continue
        row: dict[str, Any] = {}
        if a and key != "a":
            if a["sessions_held"]:
                row["sessions_held_vs_a"] = round(r["sessions_held"] / a["sessions_held"], 2)
            if a["decode_tokens_per_s"] and r["decode_tokens_per_s"] is not None:
                row["decode_tokens_per_s_vs_a"] = round(
                    r["decode_tokens_per_s"] / a["decode_tokens_per_s"], 2)
        for q in (50, 99):
            mine, theirs = r.get(f"returning_ttft_ms_p{q}"), (a or {}).get(
                f"returning_ttft_ms_p{q}")
            if mine is not None:
                row[f"returning_ttft_ms_p{q}"] = mine
                if theirs and key != "a":
                    row[f"returning_ttft_p{q}_vs_a"] = round(mine / theirs, 2)
        if "bound" in r:
            row["throughput_vs_bound"] = r["bound"].get("throughput_vs_bound")
            row["bound_limited_by"] = r["bound"]["limited_by"]
        if r.get("emulated"):
            row["emulated_l3_gbps"] = r.get("emulate_gbps")
        for tier, e in r.get("resume_vs_ceiling", {}).items():
            row[f"resume_{tier}_vs_ceiling_p50"] = e
        if r.get("step_ms_traffic_vs_quiet") is not None:
            row["step_traffic_vs_quiet_p50"] = r["step_ms_traffic_vs_quiet"]
        if r.get("step_ms_p99_traffic") and r.get("step_ms_p50_quiet"):  # issue 30: <= 1.10
            row["step_p99_traffic_vs_quiet_p50"] = round(
                r["step_ms_p99_traffic"] / r["step_ms_p50_quiet"], 3)
        if r.get("step_ms_traffic_vs_matched_quiet") is not None:
            row["step_traffic_vs_matched_quiet_p50"] = r["step_ms_traffic_vs_matched_quiet"]
        row.update(ray_vs_local(results, key))
        out[key] = row
    out["goals"] = {"sessions_held_vs_a": ">= 16 (c), 0 failures",
                    "decode_tokens_per_s_vs_a": ">= 2.5", "resume_vs_ceiling": "<= 1.15",
                    "step_traffic_vs_quiet": "<= 1.05 (matched: the same batch size, batch "
                                             "changed or not, nearest in KV tokens)",
                    "step_ms_ray_vs_local": "p50 <= 1.03, p99 <= 1.05 (b2, c)",
                    "issue_30": "one config with L1+L2+L3 and the default policy (c2): "
                                "sessions_held_vs_a >= 16 with 0 failures, throughput >= "
                                "max(a, b) and throughput_vs_bound >= 0.85, decode step p99 "
                                "with traffic <= 1.10x quiet, returning TTFT p50/p99 against "
                                "(a)'s; emulated at 14 GB/s (c2-em14): sessions_held_vs_a >= 16 "
                                "and decode_tokens_per_s_vs_a >= 2.5"}
    return out


def ray_vs_local(results: dict[str, Any], key: str) -> dict[str, float]:
    """Through the Ray actor against in process, for the runs of `key` that --compare-local
    made: each step time's mean over the actor's runs over its mean over the in-process runs
    (one pair, or two in the order actor, in process, in process, actor)."""
    ray_runs = [r for r in (results.get(key), results.get(f"{key}-2")) if r]
    local_runs = [r for r in (results.get(f"{key}-local"), results.get(f"{key}-local-2")) if r]
    row: dict[str, float] = {}
    if not local_runs:
        return row
    for k in ("step_ms_p50", "step_ms_p99", "decode_tokens_per_s"):
        mine = [r[k] for r in ray_runs if r.get(k)]
        theirs = [r[k] for r in local_runs if r.get(k)]
        if len(mine) == len(ray_runs) and len(theirs) == len(local_runs) and mine and theirs:
            row[f"{k}_ray_vs_local"] = round(statistics.fmean(mine) / statistics.fmean(theirs),
                                             3)
    return row


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
