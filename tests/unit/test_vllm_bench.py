"""bench/vllm.py without vLLM: the seeded workload, the order of turns and the summary math."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.vllm import (
    TOKEN_HI,
    TOKEN_LO,
    _error_line,
    all_fit_blocks,
    combine,
    make_workload,
    max_prompt_tokens,
    percentile,
    prompt_of,
    schedule,
    summarize,
)


def test_workload_is_seeded_and_shaped() -> None:
    a = make_workload(3, sessions=4, turns=3, system_tokens=10, context_tokens=20, user_tokens=5)
    assert a == make_workload(3, 4, 3, 10, 20, 5)
    assert a != make_workload(4, 4, 3, 10, 20, 5)
    assert (a.sessions, a.turns, len(a.system)) == (4, 3, 10)
    assert all(len(c) == 20 for c in a.contexts)
    assert all(len(u) == 5 for per in a.users for u in per)
    tokens = a.system + [t for c in a.contexts for t in c] + [
        t for per in a.users for u in per for t in u]
    assert min(tokens) >= TOKEN_LO and max(tokens) <= TOKEN_HI
    assert len({tuple(c) for c in a.contexts}) == 4  # every session has a context of its own
    with pytest.raises(ValueError, match="sessions must be at least 1, got 0"):
        make_workload(0, 0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="user_tokens must be at least 0, got -1"):
        make_workload(0, 1, 1, 1, 1, -1)


def test_schedule_asks_every_session_before_any_returns() -> None:
    order = schedule(3, 2)
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert len(set(schedule(5, 4))) == 20


def test_prompts_grow_by_turn_and_share_the_system_prompt() -> None:
    w = make_workload(1, sessions=2, turns=3, system_tokens=8, context_tokens=16, user_tokens=4)
    answers = [[7, 7], [9, 9]]
    p0, p1, p2 = (prompt_of(w, 1, t, answers) for t in range(3))
    assert p0 == w.system + w.contexts[1] + w.users[1][0]
    assert p1 == p0 + answers[0] + w.users[1][1]
    assert p2 == p1 + answers[1] + w.users[1][2]
    assert prompt_of(w, 0, 0, [])[:8] == p0[:8] == w.system
    assert len(p2) == max_prompt_tokens(w, answer_tokens=2)
    with pytest.raises(ValueError, match="session 0 turn 2 needs 2 earlier answers, has 1"):
        prompt_of(w, 0, 2, [[5]])


def test_all_fit_blocks_holds_every_session() -> None:
    assert all_fit_blocks(6, 768, 32) == 7 * 24
    assert all_fit_blocks(2, 33, 32) == 3 * 2


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [float(v) for v in range(17, 0, -3)],
                                    [0.1 * i * i for i in range(18)]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_and_bad_q() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def _req(session: int, turn: int, prompt_len: int, cached: int, tokens: list[int],
         ttft_s: float | None, wall_s: float) -> dict[str, Any]:
    return {"session": session, "turn": turn, "prompt": [2] * prompt_len, "tokens": tokens,
            "num_cached_tokens": cached, "ttft_s": ttft_s, "wall_s": wall_s}


def _run(reqs: list[dict[str, Any]], by_source: dict[str, int], run_s: float) -> dict[str, Any]:
    return {"kv_blocks": 8, "start_s": 1.0, "run_s": run_s, "requests": reqs,
            "prompt_tokens_by_source": by_source}


def test_summary_counts_saved_tokens_and_times_returning_turns_only() -> None:
    reqs = [_req(0, 0, 100, 0, [3, 4], 0.5, 0.9), _req(1, 0, 100, 32, [5, 6], 0.4, 0.8),
            _req(0, 1, 120, 96, [7, 8], 0.010, 0.2), _req(1, 1, 120, 64, [9, 9], 0.030, 0.3)]
    src = {"local_compute": 148, "local_cache_hit": 32, "external_kv_transfer": 160}
    ref = _run(reqs, src, 2.0)
    s = summarize(ref, ref)
    assert s["prompt_tokens"] == 440
    assert (s["prefill_computed_tokens"], s["prefix_cache_hit_tokens"],
            s["connector_loaded_tokens"]) == (148, 32, 160)
    assert s["prefill_saved_tokens"] == 192 and s["prefill_saved_frac"] == round(192 / 440, 4)
    assert s["returning_requests"] == 2
    assert s["returning_computed_tokens"] == (120 - 96) + (120 - 64)
    assert s["ttft_ms_p50"] == pytest.approx(20.0)  # turn 0's 400-500 ms left out
    assert s["ttft_ms_p99"] == pytest.approx(29.8)
    assert s["wall_ms_p50"] == pytest.approx(250.0)
    assert s["decode_ms_per_token_p50"] == pytest.approx((190 + 270) / 2)  # (wall - ttft) / 1
    assert s["generated_tokens"] == 8 and s["gen_tokens_per_s"] == 4.0
    assert s["tokens_equal"] is True
    assert "disk_loaded_blocks" not in s


def test_summary_flags_different_or_missing_tokens() -> None:
    reqs = [_req(0, 0, 10, 0, [3, 4], 0.1, 0.2), _req(0, 1, 14, 0, [5, 6], None, 0.2)]
    ref = _run(reqs, {}, 1.0)
    changed = _run([reqs[0], _req(0, 1, 14, 0, [5, 7], None, 0.2)], {}, 1.0)
    assert summarize(changed, ref)["tokens_equal"] is False
    assert summarize(_run(reqs[:1], {}, 1.0), ref)["tokens_equal"] is False
    alone = summarize(ref, None)
    assert "tokens_equal" not in alone
    assert alone["ttft_ms_p50"] is None  # no returning turn had a TTFT
    assert alone["decode_ms_per_token_p50"] is None
    assert alone["prefill_saved_frac"] == 0.0


def test_error_line_finds_the_root_cause_in_vllm_output() -> None:
    log = "\n".join([
        "INFO starting",
        "(Worker pid=1) ERROR 12-01 21:33:39 [multiproc_executor.py:1063] Traceback (most",
        "(Worker pid=1) ERROR 12-01 21:33:39 [multiproc_executor.py:1063] Exception: CPU "
        "Offloading is currently only supported on CUDA-alike and XPU GPUs",
        "RuntimeError: Worker failed with error 'CPU Offloading ...'",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert _error_line(log) == ("Exception: CPU Offloading is currently only supported on "
                                "CUDA-alike and XPU GPUs")
    assert _error_line("killed\n\n") == "killed"
    assert _error_line("") == "(no output)"


def test_combine_takes_medians_and_all_of_the_flags() -> None:
    reps = [{"ttft_ms_p50": 10.0, "prompt_tokens": 400, "tokens_equal": True, "x": 1.0},
            {"ttft_ms_p50": 30.0, "prompt_tokens": 400, "tokens_equal": False, "x": None},
            {"ttft_ms_p50": 20.0, "prompt_tokens": 400, "tokens_equal": True, "x": 3.0}]
    c = combine(reps)
    assert c["reps"] == 3 and c["ttft_ms_p50"] == 20.0 and c["prompt_tokens"] == 400
    assert c["tokens_equal"] is False  # one repetition differed
    assert c["x"] is None
    assert c["by_rep"] == reps
    assert combine(reps[:1])["tokens_equal"] is True
    with pytest.raises(ValueError, match="no repetitions"):
        combine([])
