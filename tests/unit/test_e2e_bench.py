"""bench/e2e.py at toy size on the CPU: TTFT of returning turns, the bound, arrivals, the paced
emulated L3 and the 8B shape."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.e2e import CPU, FULL, ray_vs_local, settings
from bench.e2e_arrive import schedule
from bench.e2e_bound import TERMS, bound, quiet_decode_s
from bench.e2e_emulate import Pace, dir_speed, fit, kv_bytes_per_token, model_config, mount_of
from bench.e2e_run import run_tiered

# 8 sessions of 128..256 tokens of the tiny model (1.5 KiB of KV per token); L1 holds 2 of
# them at once, (b)'s L2 about 3, so returns recompute (a) or load from L2 / L3 (c2).
TOY = dataclasses.replace(CPU, sessions=8, context=(128, 256), l1_gib=0.0011, l2_gib=0.0012,
                          l3_gib=0.01, l3_all_gib=0.01, user_tokens=8, gen_tokens=3,
                          arrival_per_s=50.0, think_s=0.05)
CEIL = {"disk_read": 2.0, "disk_write": 2.0}  # GB/s: no probe of this machine's disk here
CPU_DEV = torch.device("cpu")


def _contexts(sizes: Any) -> list[int]:
    rng = np.random.default_rng(sizes.seed)
    return rng.integers(sizes.context[0], sizes.context[1] + 1, sizes.sessions).tolist()


def _run(key: str, tmp: Path, sizes: Any = TOY, gbps: float = 0.0) -> dict[str, Any]:
    s = settings(sizes, str(tmp))[key]
    if gbps:
        s = dataclasses.replace(s, key=f"{key}-em{gbps:g}", emulate_gbps=gbps)
    return run_tiered(s, sizes, _contexts(sizes), CPU_DEV, dict(CEIL), "local")


def _check(r: dict[str, Any], sizes: Any) -> None:
    """Every returning turn timed, a bound whose terms add up, no failure."""
    assert r["oom_or_failures"] == 0, r["failures"]
    returning = sizes.sessions * (sizes.rounds - 1)
    assert r["returning_turns_timed"] == returning
    assert r["returning_turns_without_first_token"] == 0
    back = [t for t in r["ttft_records"] if t["returning"]]
    assert len(back) == returning and all(t["ttft_ms"] > 0 for t in back)
    assert 0 < r["returning_ttft_ms_p50"] <= r["returning_ttft_ms_p99"]
    b = r["bound"]
    assert 0 < b["throughput_vs_bound"] <= 1.5
    assert b["gpu_s"] == pytest.approx(b["work"]["gpu_decode_s"] + b["work"]["gpu_prefill_s"],
                                       abs=2e-4)
    assert b["work"]["gpu_decode_s"] > 0 and b["work"]["gpu_prefill_s"] > 0
    assert b["bound_s"] == max(b[k] for k in ("gpu_s", "disk_read_s", "disk_write_s"))
    assert b["work"]["tokens"] == returning * sizes.gen_tokens
    assert b["bound_tokens_per_s"] == pytest.approx(b["work"]["tokens"] / b["bound_s"], rel=1e-2)
    # the window's wall time, accounted: its steps by kind and the time outside them
    w = r["window_s"]
    assert w["measured_s"] == pytest.approx(b["work"]["measured_s"], abs=2e-3)
    steps = [v for k, v in w.items() if k.endswith("_s") and "forward" not in k
             and k not in ("measured_s", "outside_steps_s")]
    assert w["decode_s"] > 0 and w["resume_s"] > 0 and w["admit_s"] > 0
    assert "admit_forward_s" not in w
    assert 0 <= w["outside_steps_s"] < w["measured_s"]
    assert sum(steps) + w["outside_steps_s"] == pytest.approx(w["measured_s"], abs=1e-2)
    assert 0 < w["resume_forward_s"] <= w["resume_s"]


def test_rounds_report_returning_ttft_and_bound(tmp_path: Path) -> None:
    # (c) spills whatever leaves L2 (what (c2) spills depends on the speeds it measures)
    a, c = _run("a", tmp_path), _run("c", tmp_path)
    for r in (a, c):
        _check(r, TOY)
        assert r["mode"] == "rounds"
        assert r["decode_steps_capturing_a_graph"] == 0  # (no CUDA graphs on the CPU)
        assert r["resume_steps_capturing_a_graph"] == 0
        assert all(x["captured_graph"] is False for x in r["resume_records"])
        assert r["graphs_captured_ahead"]["graphs"] == 0
    assert a["reads_later"] == 0  # (no L3)
    assert a["recompute_tokens"] > 0  # (a) recomputes what L1 lost
    # each resume says how many tokens it recomputed, out of those its session held before
    for r in (*a["resume_records"], *c["resume_records"]):
        assert (r["recomputed_tokens"] > 0) == (r["source"] == "recompute")
        assert 0 <= r["recomputed_tokens"] <= r["context_tokens"]
    assert sum(r["recomputed_tokens"] for r in a["resume_records"]) <= a["recompute_tokens"]
    assert c["bound"]["work"]["bytes"]["l2_l3"] > 0  # (c) spilled to L3
    # where each step's L3 blocks came from: read-ahead buffers or the disk
    loads = [r for r in (*c["resume_records"], *c["traffic_records"]) if r["moved"]["l3_l2"]]
    assert loads and all(r["l3_from_read_ahead"] >= 0 and r["l3_from_disk"] >= 0 for r in loads)
    assert sum(r["l3_from_read_ahead"] + r["l3_from_disk"] for r in loads) > 0
    assert c["bound"]["disk_write_s"] == pytest.approx(
        c["bound"]["work"]["bytes"]["l2_l3"] / 2e9, abs=1e-4)
    # every step's record says how long Python's collections held the process during it
    recs = [*c["resume_records"], *c["traffic_records"]]
    assert recs and all(r["gc_ms"] >= 0 for r in recs)
    assert c["gc"]["ms"] >= sum(r["gc_ms"] for r in recs) - 1e-6
    assert len(c["gc"]["collections_by_generation"]) == 3


def test_the_gc_clock_times_each_collection_by_generation() -> None:
    import gc

    from bench.gc_clock import GcClock

    clock = GcClock().install()
    try:
        mark = clock.mark()
        gc.collect()  # a full collection
        gc.collect(0)
        got = clock.since(mark)
    finally:
        clock.uninstall()
    assert got["collections_by_generation"][2] >= 1 and got["collections_by_generation"][0] >= 1
    assert got["ms"] >= got["max_ms"] > 0
    n = len(clock.events)
    gc.collect()  # uninstalled: not counted
    assert len(clock.events) == n


def test_arrivals_time_turns_from_add_and_arrival(tmp_path: Path) -> None:
    sizes = dataclasses.replace(TOY, arrivals=1)
    r = _run("c2", tmp_path, sizes)
    _check(r, sizes)
    assert r["mode"] == "arrivals"
    arr = r["arrivals"]
    # (busy_s is rounded to the millisecond)
    assert arr["admit"] >= 1 and arr["busy_s"] == pytest.approx(r["bound"]["work"]["measured_s"],
                                                              abs=6e-4)
    # turns past the admission limit waited in the driver's queue: counted from arrival
    if any(t["queued_ms"] for t in r["ttft_records"] if t["returning"]):
        assert r["returning_ttft_from_arrival_ms_p50"] >= r["returning_ttft_ms_p50"]


def test_emulated_l3_paces_every_read_and_write(tmp_path: Path) -> None:
    # (c3): every return loads (the cost model, told 20 MB/s, would recompute them otherwise)
    r = _run("c3", tmp_path, gbps=0.02)  # 20 MB/s: slower than any disk here
    _check(r, TOY)
    em = r["emulated_l3"]
    assert r["emulated"] and r["emulate_gbps"] == 0.02
    assert em["writes"]["bytes"] == r["bytes"]["l2_l3"] > 0  # every spill, paced
    assert em["reads"]["bytes"] > 0 and em["paced_read_share"] == 1.0
    assert r["bound"]["rates_gbps"]["disk_read"] == 0.02  # the bound uses the pace
    assert em["reads"]["sleep_s"] > 0  # the reads waited for the pace
    # the returns were read ahead at the pace while they waited outside the batch, and their
    # steps took the blocks from memory
    assert r["returns"]["read_ahead"] > 0 and r["returns"]["served_blocks"] > 0, r["returns"]


def test_the_emulated_l3_directory_is_described_and_timed(tmp_path: Path) -> None:
    """The run records which mount holds the emulated L3 and whether it gives huge pages (a
    tmpfs with huge=always writes several times faster than /dev/shm's 4 KiB pages), and one
    thread's write and read speed there."""
    mounts = ("overlay / overlay rw,relatime 0 0\n"
              "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
              "tmpfs /mnt/em tmpfs rw,relatime,size=50331648k,huge=always 0 0\n"
              "tmpfs /mnt/em\\040two tmpfs rw,huge=within_size 0 0\n"
              "tmpfs /mnt/never tmpfs rw,huge=never 0 0\n")
    assert mount_of("/dev/shm/tpkv-e2e-em-1", mounts) == {
        "mount": "/dev/shm", "fs": "tmpfs", "options": ["rw", "nosuid", "nodev"],
        "huge_pages": False}
    assert mount_of("/mnt/em/x", mounts)["huge_pages"] is True
    assert mount_of("/mnt/em two/x", mounts)["mount"] == "/mnt/em two"
    assert mount_of("/mnt/emx", mounts)["mount"] == "/"  # a prefix of a name is no parent
    assert mount_of("/mnt/never", mounts)["huge_pages"] is False
    speed = dir_speed(str(tmp_path), num_bytes=4 << 20, request_bytes=1 << 20)
    assert speed["write"] > 0 and speed["read"] > 0
    assert list(tmp_path.iterdir()) == []  # its file is gone


def test_arrival_schedule_is_seeded_poisson() -> None:
    sizes = dataclasses.replace(TOY, arrival_per_s=4.0, think_s=3.0, rounds=3)
    arrive, think = schedule(sizes, 4000)
    again, _ = schedule(sizes, 4000)
    assert np.array_equal(arrive, again) and arrive[0] == 0.0
    assert np.all(np.diff(arrive) > 0)
    assert np.mean(np.diff(arrive)) == pytest.approx(0.25, rel=0.05)
    assert think.shape == (4000, 2) and np.mean(think) == pytest.approx(3.0, rel=0.05)


def test_bound_is_the_busiest_resource() -> None:
    work = {"gpu_decode_s": 1.0, "gpu_prefill_s": 0.5, "measured_s": 3.0, "tokens": 300,
            "bytes": {"l2_l1": 10 * 10**9, "l1_l2": 0, "l3_l2": 8 * 10**9, "l2_l3": 2 * 10**9}}
    b = bound(work, {"h2d": 50.0, "d2h": 50.0, "disk_read": 4.0, "disk_write": 4.0})
    assert b["gpu_s"] == 1.5 and b["pcie_h2d_s"] == 0.2 and b["disk_read_s"] == 2.0
    assert b["limited_by"] == "disk_read_s" and b["bound_s"] == 2.0
    assert b["throughput_vs_bound"] == pytest.approx(2 / 3, abs=1e-3)
    assert b["bound_tokens_per_s"] == 150.0
    assert set(TERMS) >= {k for k in b if k not in ("work", "rates_gbps")}


def test_quiet_decode_takes_steps_alike() -> None:
    # (ms, moved, batch, kv tokens, changed, captured): quiet steps of batch 2 take 5 ms, of
    # batch 3 7 ms; the steps with traffic (20 ms) count at the quiet time of their batch size
    steps = [(5.0, False, 2, 100, False, False)] * 4 + [(7.0, False, 3, 150, False, False)] * 4
    steps += [(20.0, True, 3, 150, True, False), (20.0, True, 2, 100, True, False)]
    assert quiet_decode_s(steps, 8) == pytest.approx(0.012)
    assert quiet_decode_s(steps, 0) == pytest.approx((4 * 5 + 4 * 7 + 12) / 1e3)


def test_pace_holds_the_rate_across_threads() -> None:
    import threading

    pace = Pace(0.1)  # 100 MB/s: 8 I/Os of 2 MB take at least 160 ms however many threads
    t0 = time.perf_counter()
    threads = [threading.Thread(target=pace.wait, args=(2_000_000, time.perf_counter()))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    assert took >= 0.155 and pace.bytes == 16_000_000 and pace.calls == 8


def test_8b_shape_fits_one_h200_and_its_host() -> None:
    cfg = model_config("8b")
    assert kv_bytes_per_token(cfg) == 128 * 1024
    assert cfg.num_params() == pytest.approx(8.03e9, rel=0.01)
    from bench.e2e import FULL

    sizes = dataclasses.replace(FULL, model="8b", context=(2048, 4096))
    f = fit(cfg, sizes, ["a", "b", "b2", "c", "c2", "c3"], ["c2"])
    assert f["fits"] and f["gpu_gib"] < 139 and f["host_gib"] < 128
    assert f["mean_session_gib"] == pytest.approx(0.375)  # as the 1b table's sessions
    too_big = dataclasses.replace(sizes, l2_all_gib=130.0)
    assert not fit(cfg, too_big, ["b2"], [])["fits"]


class _LoadingEngine:
    """An engine whose returning turns first wait in a queue of their own (`loading`, neither
    waiting nor running) and whose Seq takes the turn's prompt, and drops the last turn's
    tokens, only when it leaves that queue."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from tpkv.models.turns import Seq

        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
        self.seqs = {"s0": Seq("s0", token_ids=[1, 2, 3, 9], num_cached=3, generated=[9])}
        self.loading: list[tuple[str, list[int]]] = []
        self.waiting: list[Any] = []
        self.running: list[Any] = []

    def add_turn(self, session: str, tokens: list[int], gen: int) -> None:
        self.loading.append((session, list(tokens)))

    def prefill(self) -> None:  # the load is done: the turn is prefilled, one token sampled
        session, tokens = self.loading.pop(0)
        seq = self.seqs[session]
        seq.token_ids.extend(tokens)
        seq.generated = [7]
        seq.token_ids.append(7)


def test_ttft_counts_time_in_any_engine_queue() -> None:
    from types import SimpleNamespace

    from bench.e2e_run import Rounds

    engine = _LoadingEngine()
    rounds = Rounds(SimpleNamespace(engine=engine), TOY, [8], 1, {})  # type: ignore[arg-type]
    rounds.add_turn("s0", [4, 5], 3, returning=True, turn=1)
    time.sleep(0.05)
    rounds._first_tokens(time.perf_counter())  # a step went by: the turn is still loading
    assert rounds.ttft == [] and "s0" in rounds._first_token
    engine.prefill()
    rounds._first_tokens(time.perf_counter())
    (rec,) = rounds.ttft
    assert rec["returning"] and rec["turn"] == 1 and rec["ttft_ms"] >= 50.0
    assert rounds._first_token == {}


def test_emulated_setting_tells_the_cost_model_its_pace(tmp_path: Path) -> None:
    from bench.e2e_setup import config_for, model_for

    s = dataclasses.replace(settings(TOY, str(tmp_path))["c2"], emulate_gbps=14.0)
    cfg = config_for(s, model_for("tiny", CPU_DEV), TOY.block_tokens, cuda=True)
    assert cfg.policy.ssd_read_bytes_per_s == 14e9  # not the 2.1 GB/s start value
    assert not cfg.l3.o_direct  # a RAM file system takes no O_DIRECT
    plain = config_for(settings(TOY, str(tmp_path))["c2"], model_for("tiny", CPU_DEV),
                       TOY.block_tokens, cuda=True)
    assert plain.l3.o_direct and plain.policy.ssd_read_bytes_per_s != 14e9


def test_the_warm_up_goes_through_every_tier_path() -> None:
    """The run before the measured configurations demotes into L2, spills to L3 and loads back
    from both, at the CPU preset's sizes."""
    from bench.e2e_warm import WARM_SESSIONS, warm_sizes, warm_up

    small = warm_sizes(CPU)
    assert small.sessions == WARM_SESSIONS and small.rounds == 2
    assert small.context == CPU.context and small.l2_gib < CPU.l2_gib
    r = warm_up(CPU, CPU_DEV, dict(CEIL), "local")
    assert r["oom_or_failures"] == 0 and r["seconds"] > 0
    assert all(r["moves"][k] > 0 for k in ("l1_l2", "l2_l1", "l2_l3", "l3_l2")), r["moves"]


@pytest.mark.parametrize("sizes", [CPU, FULL], ids=["cpu", "full"])
def test_the_warm_up_meets_every_prefill_width_of_the_run(sizes) -> None:
    """The warm-up's sessions run from the run's shortest context to its longest in steps
    narrower than one key width bucket of the prefill graphs, so no measured turn is the first
    of its width."""
    from bench.e2e_warm import warm_contexts, warm_sizes
    from tpkv.models.paged import PREFIX_BUCKET_BLOCKS

    lengths = sorted(warm_contexts(warm_sizes(sizes)))
    assert lengths[0] == sizes.context[0] and lengths[-1] == sizes.context[1]
    step = max(b - a for a, b in zip(lengths, lengths[1:]))
    assert 0 < step < PREFIX_BUCKET_BLOCKS * sizes.block_tokens, (step, lengths)


def test_resume_timeline_wraps_only_what_exists() -> None:
    """bench/resume_timeline.py times these by name: a rename in tpkv must show here, not as
    an AttributeError on the GPU machine."""
    import bench.resume_timeline as timeline

    missing = [f"{getattr(owner, '__name__', owner)}.{name}"
               for owner, name, _ in timeline.WRAPPED if not callable(getattr(owner, name, None))]
    assert not missing, missing


def test_ray_vs_local_is_the_ratio_of_the_means_of_each_transports_runs() -> None:
    run = {"step_ms_p50": 7.0, "step_ms_p99": 15.0, "decode_tokens_per_s": 280.0}
    results = {"b2": run, "b2-local": {**run, "step_ms_p50": 6.0, "decode_tokens_per_s": 300.0}}
    assert ray_vs_local(results, "b2") == {"step_ms_p50_ray_vs_local": round(7 / 6, 3),
                                           "step_ms_p99_ray_vs_local": 1.0,
                                           "decode_tokens_per_s_ray_vs_local": round(280 / 300,
                                                                                     3)}
    # two pairs, actor / in process / in process / actor: means over each transport's runs
    results["b2-local-2"] = {**run, "step_ms_p50": 7.0}
    results["b2-2"] = {**run, "step_ms_p50": 6.5}
    got = ray_vs_local(results, "b2")
    assert got["step_ms_p50_ray_vs_local"] == round(6.75 / 6.5, 3)
    assert ray_vs_local(results, "c") == {} and ray_vs_local(results, "b2-local") == {}
    results["b2-2"] = {**run, "step_ms_p50": None}  # a run that measured none: no ratio
    assert "step_ms_p50_ray_vs_local" not in ray_vs_local(results, "b2")

