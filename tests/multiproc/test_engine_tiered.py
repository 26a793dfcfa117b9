"""The engine on tiny tiers (L1 -> L2 -> L3 and back) decodes exactly the greedy tokens of the
same model with a large L1 where nothing moves: TP 1 in process, TP 2 on CPU (gloo)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.multiproc.harness import run_ranks
from tpkv.config import PolicyConfig
from tpkv.models.engine import PagedEngine
from tpkv.models.llama import Llama, build_model
from tpkv.models.tp import apply_tp

BT = 4
SESSIONS, TURNS, GROUP = 6, 3, 2
L1_BLOCKS, L2_BLOCKS = 32, 16  # the 6 sessions end with about 80 blocks: L3 must hold some
L3_SMALL = 48  # mode "l3small": less than the sessions in L3 and the copies of the others
Turns = dict[str, list[tuple[int, ...]]]


def drive(engine: PagedEngine, seed: int = 0, stagger: bool = False) -> Turns:
    """Turns of two sessions at a time, round robin over the six: between two turns of a session
    the four others run, so a small L1 has to demote it (and a small L2 spill it). `stagger`:
    the second turn of a pair arrives after the first has decoded two steps (the step planned
    ahead for the first alone is then not the step that runs)."""
    rng = np.random.default_rng(seed)
    out: Turns = {}
    for turn in range(TURNS):
        for first in range(0, SESSIONS, GROUP):
            done = []
            for i in range(first, first + GROUP):
                n = int(rng.integers(12, 21)) if turn == 0 else int(rng.integers(3, 9))
                engine.add_turn(f"s{i}", rng.integers(0, 512, n).tolist(),
                                int(rng.integers(4, 7)))
                if stagger and i == first:
                    done += engine.step() + engine.step() + engine.step()
            for f in done + engine.run():
                out.setdefault(f.session, []).append(f.token_ids)
    for i in range(SESSIONS):
        engine.close_session(f"s{i}")
    return out


def reference(model: Llama, stagger: bool = False) -> Turns:
    """The same model and workload with an L1 that holds everything (no tiers, no moves)."""
    g = model.kv_geometry(tp_size=1, block_tokens=BT)
    heads = model.blocks[0].attn.wk.out_features // model.config.head_dim
    shape = (g.num_layers, 2, BT, heads, g.head_dim)
    pool = torch.full((256, *shape), float("nan"), device=model.device)
    return drive(PagedEngine(model, pool, scheduler_seed=3), stagger=stagger)


def tiered_rank(rank: int, world: int, ssd_root: str, mode: str = "load",
                device: str = "cpu", controller: str = "local") -> dict[str, Any]:
    """One rank: the reference run, then the tiered run (mode "load": resuming always loads;
    "recompute": always recomputes; "miss": loads, and the first L3 read on rank 0 misses;
    "kept": an L2 that holds every block, so demotions of promoted blocks are kept moves;
    "l3small": loads, with an L3 too small for the copies of loaded sessions besides the
    sessions in it, so their segments are given back and written again; "stagger": loads, with
    turns that arrive while another decodes, drive's `stagger`). `controller`: "local" (in
    process) or "ray" (the actor; the caller runs Ray)."""
    import tpkv
    from tpkv.models.tiered import TieredEngine, tiered_config

    torch.set_num_threads(1)
    model = build_model("tiny", seed=0, device=device)
    rate = 1e12 if mode == "recompute" else 10.0  # prefill tokens/s the cost model assumes
    # "l3small" must fill L3: unpaced, no spill is left unwritten because the disk (as this
    # machine's load makes it measure) is behind
    # "recompute": a read also so slow that no read ends before the GPU reaches its turn
    policy = PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=rate,
                          ssd_read_bytes_per_s=1.0 if mode == "recompute" else 2.1e9,
                          spill_pacing=mode != "l3small")
    cfg = tiered_config(model, world, block_tokens=BT, l1_blocks=L1_BLOCKS,
                        l2_blocks=4 * L2_BLOCKS if mode == "kept" else L2_BLOCKS,
                        ssd_root=ssd_root, policy=policy,
                        l3_blocks=L3_SMALL if mode == "l3small" else 4096)
    rt = tpkv.init(cfg, controller=controller, device=device)
    try:
        model = apply_tp(model, rank, world)
        stagger = mode == "stagger"
        want = reference(model, stagger)
        if mode == "miss" and rank == 0:
            rt.worker.fault_miss_from = 1
        tiered = TieredEngine(rt, model, report_prefill=False)
        watched = _watch_steps(tiered, device == "cuda")
        got = drive(tiered.engine, stagger=stagger)
        if rank == 0:  # every token a step planned ahead added was fed by a later step
            assert not rt.credits.tokens, rt.credits.tokens
        events: dict[str, int] = {}
        if rank == 0:
            for e in rt.controller.snapshot()["events"]:
                events[e["kind"]] = events.get(e["kind"], 0) + 1
        s = tiered.stats
        out = {"got": got, "want": want, "moves": dict(s.moves), "events": events,
               "recompute_tokens": s.recompute_tokens, "retries": s.retries,
               "mismatches": rt.num_mismatches, "steps": s.steps,
               "commit_refusals": rt.num_commit_refusals, "late": rt.worker.num_late,
               "kept": s.kept_moves, "ahead": (rt.num_ahead_used, rt.num_ahead_unused),
               "kept_spills": s.kept_spills, "watched": watched,
               "chained": rt.worker.executor.num_chained,
               "direct": rt.worker.executor.direct.num_blocks,
               "read_ahead": (tiered.returns.num_read_ahead, rt.worker.store.ahead.num_served,
                              rt.worker.store.ahead.held_bytes)}
    except BaseException as exc:
        rt.close(exc)
        raise
    rt.close()
    return out


def _watch_steps(tiered: Any, cuda: bool) -> dict[str, int]:
    """Counts steps whose plans at report() (TieredEngine.step_plans) lack one they had when
    scheduled ("lost") or gained some once the forward was launched (late plans: "later");
    on CUDA, with TieredEngine.trace on, the same for the trace's copy batches ("lost_spans",
    "later_spans")."""
    tiered.trace = cuda
    eng = tiered.engine
    counts = {"steps": 0, "lost": 0, "later": 0, "lost_spans": 0, "later_spans": 0}
    schedule, report = eng.schedule, eng.report
    seen: dict[str, set[Any]] = {"plans": set(), "spans": set()}

    def now() -> dict[str, set[Any]]:
        spans = tiered.last_trace.spans if tiered.last_trace is not None else []
        return {"plans": {id(a) for a in tiered.step_plans()},
                "spans": {(direction, id(start)) for _, direction, start, _ in spans}}

    def traced_schedule(*args: Any) -> Any:
        step = schedule(*args)
        seen.update(now())
        return step

    def traced_report(r: Any) -> None:
        got = now()
        counts["steps"] += 1
        for key, name in (("plans", ""), ("spans", "_spans")):
            counts["lost" + name] += bool(seen[key] - got[key])
            counts["later" + name] += bool(got[key] - seen[key])
        report(r)
        assert tiered.last_times["blocked"] >= 0

    eng.schedule, eng.report = traced_schedule, traced_report
    return counts


def check(out: dict[str, Any], mode: str = "load") -> None:
    """Same tokens as the reference, and the tiers really were used."""
    assert out["want"] and sum(len(t) for t in out["want"].values()) == SESSIONS * TURNS
    assert out["got"] == out["want"]
    moves = out["moves"]
    assert moves["l1_l2"] > 0, moves  # demoted
    # then spilled (spill="cost" spills as fast as the disk writes, whatever a load costs)
    assert moves["l2_l3"] > 0, moves
    assert out["mismatches"] == 0
    assert out["commit_refusals"] == 0
    if mode == "recompute":  # the cost model recomputes the returns: nothing loaded back
        assert out["recompute_tokens"] > 0 and moves["l3_l2"] == 0, out
    else:
        assert moves["l3_l2"] > 0 and moves["l2_l1"] > 0, moves  # loaded back
        # and spilled again onto the records they were loaded from (PolicyConfig.
        # keep_l3_copies): the later loads of those records gave the same tokens
        assert out["kept_spills"] > 0, out
        # copied into L1 while the rest of their reads went on (chain.find_chain)
        assert out["chained"] > 0, out["chained"]
        # those read ahead, straight from the read-ahead buffers (workers/direct.py)
        assert out["direct"] > 0, out["direct"]
        # their turns waited outside the batch while their records were read ahead, and the
        # steps that loaded them took those from memory (models/returns.py)
        started, served, held = out["read_ahead"]
        assert started > 0 and served > 0 and held == 0, out["read_ahead"]
    if mode == "miss":  # the step that needed the missed block ran again and recomputed it
        assert out["retries"] >= 1 and out["recompute_tokens"] > 0, out
    else:  # ("load" may still recompute blocks the planner dropped when L2 was full)
        assert out["retries"] == 0, out
    # steps whose plans only demote and spill were applied once the forward was launched
    assert out["late"] > 0, out["late"]
    if out["events"]:  # rank 0: most steps were planned ahead (launch/ahead.py); with
        # staggered turns some were planned for a batch that did not come and applied
        # without their forward
        used, unused = out["ahead"]
        assert used > out["steps"] // 2 and (unused > 0) == (mode == "stagger"), out["ahead"]
    # and a step's plans, as TieredEngine.step_plans gives them at its report, are those it
    # was scheduled with and those applied once its forward was launched
    watched = out["watched"]
    assert watched["steps"] > 0 and watched["lost"] == 0, watched
    assert watched["later"] > 0, watched
    if out["events"]:  # rank 0: the controller saw the same
        assert out["events"].get("demote", 0) > 0
        assert out["events"].get("spill", 0) > 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["load", "miss", "stagger"])
def test_tp2_tiered_engine_gives_the_tokens_of_a_large_l1(tmp_path, mode):
    results = run_ranks(tiered_rank, 2, str(tmp_path / "l3"), mode, "cpu", timeout_s=80)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert results[r]["ok"], results[r].get("trace")
        check(results[r], mode)
        assert results[r]["commit_refusals"] == 0
    assert results[0]["got"] == results[1]["got"]
    assert results[0]["moves"] == results[1]["moves"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["load", "recompute", "miss", "stagger"])
def test_tp1_tiered_engine_gives_the_tokens_of_a_large_l1(tmp_path, monkeypatch, mode):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tiered_rank(0, 1, str(tmp_path / "l3"), mode, "cpu")
    check(out, mode)


def check_kept(out: dict[str, Any]) -> None:
    """Same tokens as the reference with L1 <-> L2 traffic only, and demotions that copied
    nothing (MovePlan.kept) among it: the L2 copies they went back to held the right bytes."""
    assert out["want"] and out["got"] == out["want"]
    moves = out["moves"]
    assert moves["l2_l1"] > 0 and moves["l2_l3"] == 0, moves
    assert out["kept"] > 0 and out["mismatches"] == 0 and out["retries"] == 0, out


@pytest.mark.timeout(60)
def test_tp1_kept_l2_copies_give_the_tokens_of_a_large_l1(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    check_kept(tiered_rank(0, 1, str(tmp_path / "l3"), "kept"))


@pytest.mark.timeout(90)
def test_tp2_kept_l2_copies_give_the_tokens_of_a_large_l1(tmp_path):
    results = run_ranks(tiered_rank, 2, str(tmp_path / "l3"), "kept", timeout_s=80)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert results[r]["ok"], results[r].get("trace")
        check_kept(results[r])
    assert results[0]["kept"] == results[1]["kept"]


@pytest.mark.timeout(60)
def test_tiered_demo_summarizes_a_short_run(tmp_path, monkeypatch):
    import tpkv
    from tpkv.models.tiered import tiered_config
    from tpkv.models.tiered_demo import run_tiered_demo
    from tpkv.models.workload import WorkloadConfig

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = build_model("tiny", seed=0)
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=40, l2_blocks=16,
                        ssd_root=str(tmp_path / "l3"),
                        policy=PolicyConfig(cooldown_s=0.0, prefill_tokens_per_s=10.0))
    # 8 users at once: every session's first turn arrives at the start and is prefilled
    # before any decodes, so their blocks (6-16 each) overflow the 40 of L1 whatever the
    # steps' times (the workload's clock advances by them; with 4 users the sessions
    # sometimes ran one after another and nothing moved)
    wl = WorkloadConfig(num_sessions=8, num_users=8, turns=(2, 3), system_prompt_tokens=8,
                        doc_tokens=(8, 16), user_tokens=(4, 8), gen_tokens=(4, 6),
                        think_s=(0.01, 0.1), ramp_s=0.0, max_session_tokens=64,
                        vocab_size=512)
    with tpkv.init(cfg, controller="local", device="cpu") as rt:
        out = run_tiered_demo(rt, model, wl, seconds=20.0, max_batch=2, report_prefill=False)
    assert out["turns"] > 8 and out["decode_tokens_per_s"] > 0
    # demoted (with a copy, or into the L2 copy a promoted block kept)
    assert out["moves"]["l1_l2"] + out["kept_moves"] > 0, (out["moves"], out["kept_moves"])
    assert set(out["resume_latency"]) == {"l1", "l2", "l3"}
    assert sum(out["tiers"]["blocks"].values()) >= 0


@pytest.mark.timeout(90)
def test_segments_of_copies_given_back_and_written_again_give_the_tokens_of_a_large_l1(
        tmp_path, monkeypatch):
    """L3 copies with an L3 too small to keep them: the controller gives whole segments back
    (the ranks delete their files) and the sessions' next spills write them afresh; tokens stay
    those of the all-L1 run, at TP 1 in process and TP 2."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tiered_rank(0, 1, str(tmp_path / "l3-tp1"), "l3small")
    check(out, "l3small")
    assert out["events"].get("drop_l3_copies", 0) > 0, out["events"]
    results = run_ranks(tiered_rank, 2, str(tmp_path / "l3-tp2"), "l3small", timeout_s=80)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert results[r]["ok"], results[r].get("trace")
        check(results[r], "l3small")
    assert results[0]["got"] == results[1]["got"]
    assert results[0]["events"].get("drop_l3_copies", 0) > 0, results[0]["events"]
