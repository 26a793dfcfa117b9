"""The multi-turn workload: deterministic under a seed, within its bounds, a closed loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tpkv.errors import ConfigError, UnknownSessionError
from tpkv.models.demo import run_workload
from tpkv.models.engine import PagedEngine
from tpkv.models.llama import build_model, dense_generate
from tpkv.models.workload import TurnEvent, Workload, WorkloadConfig, document_length

CFG = WorkloadConfig(num_sessions=24, num_users=5, turns=(2, 5), system_prompt_tokens=300,
                     num_documents=3, doc_tokens=(500, 900), doc_probability=0.4,
                     user_tokens=(10, 40), gen_tokens=(5, 30), think_s=(1.0, 20.0), ramp_s=4.0,
                     max_session_tokens=2500, vocab_size=1000, seed=11)


def _service_s(event: TurnEvent) -> float:
    return 0.001 * len(event.prompt_token_ids) + 0.05 * event.max_new_tokens


def _run(cfg: WorkloadConfig) -> tuple[Workload, list[TurnEvent]]:
    workload = Workload(cfg)
    return workload, list(workload.simulate(_service_s))


def _key(e: TurnEvent) -> tuple:
    return (e.time_s, e.session, e.turn, e.prompt_token_ids.tobytes(), e.max_new_tokens,
            e.last_turn)


def test_same_seed_same_events_other_seed_other_events():
    _, a = _run(CFG)
    _, b = _run(CFG)
    _, c = _run(dataclasses.replace(CFG, seed=12))
    assert [_key(e) for e in a] == [_key(e) for e in b]
    assert [_key(e) for e in a] != [_key(e) for e in c]


def test_events_respect_the_bounds():
    workload, events = _run(CFG)
    by_session: dict[str, list[TurnEvent]] = {}
    for e in events:
        by_session.setdefault(e.session, []).append(e)
    assert len(by_session) == CFG.num_sessions and workload.done
    doc_lens = {document_length(CFG, d) for d in range(CFG.num_documents)}
    for session, turns in by_session.items():
        plan = workload.plan(session)
        assert 1 <= len(plan) <= CFG.turns[1]  # fewer than turns[0] only at the token bound
        assert [t.turn for t in turns] == list(range(len(plan)))
        assert [t.last_turn for t in turns] == [False] * (len(plan) - 1) + [True]
        assert np.array_equal(turns[0].prompt_token_ids[:300], workload.system_prompt)
        total = sum(len(t.prompt_token_ids) + t.max_new_tokens for t in turns)
        assert total == workload.planned_tokens(session) <= CFG.max_session_tokens
        for t, p in zip(turns, plan):
            ids = t.prompt_token_ids
            assert ids.dtype == np.int64 and 0 <= ids.min() and ids.max() < CFG.vocab_size
            assert CFG.gen_tokens[0] <= t.max_new_tokens <= CFG.gen_tokens[1]
            doc = document_length(CFG, p.document) if p.document >= 0 else 0
            assert p.document < 0 or doc in doc_lens
            assert CFG.user_tokens[0] <= len(ids) - doc - (300 if t.turn == 0 else 0) \
                <= CFG.user_tokens[1]
            assert CFG.think_s[0] <= p.think_s <= CFG.think_s[1]
    assert any(p.document >= 0 for s in by_session for p in workload.plan(s))


def test_closed_loop_timing_and_concurrency():
    workload, events = _run(CFG)
    times = [e.time_s for e in events]
    assert times == sorted(times)
    open_at: dict[str, float] = {}
    ends: list[tuple[float, float]] = []  # (first turn start, last turn done) per session
    previous: dict[str, TurnEvent] = {}
    for e in events:
        if e.session in previous:  # next turn = previous answer done + that turn's think time
            p = previous[e.session]
            think = workload.plan(e.session)[p.turn].think_s
            assert e.time_s == pytest.approx(p.time_s + _service_s(p) + think)
        else:
            open_at[e.session] = e.time_s
        previous[e.session] = e
        if e.last_turn:
            ends.append((open_at[e.session], e.time_s + _service_s(e)))
    for t in sorted(times):  # never more sessions open than users
        assert sum(start <= t < end for start, end in ends) <= CFG.num_users


def test_sessions_outnumber_l1():
    cfg = dataclasses.replace(CFG, num_sessions=64)
    workload, events = _run(cfg)
    total = sum(workload.planned_tokens(s) for s in {e.session for e in events})
    l1_tokens = 512 * 16  # an L1 of 512 blocks of 16 tokens
    assert total > 4 * l1_tokens


def test_driving_it_by_hand():
    workload = Workload(dataclasses.replace(CFG, num_sessions=2, num_users=2, ramp_s=10.0))
    assert [e.session for e in workload.pop_ready(0.0)] == ["s00000"]
    assert workload.next_time_s() == 5.0 and workload.pop_ready(4.9) == []
    with pytest.raises(UnknownSessionError):
        workload.complete("s00001", 1.0)
    workload.complete("s00000", 1.0)
    assert not workload.done
    with pytest.raises(UnknownSessionError):
        workload.complete("s00000", 1.0)


def test_bad_sizes_fail_at_construction():
    with pytest.raises(ConfigError, match="low <= high"):
        dataclasses.replace(CFG, user_tokens=(50, 10))
    with pytest.raises(ConfigError, match="first turn may need"):
        dataclasses.replace(CFG, max_session_tokens=200)
    with pytest.raises(ConfigError, match="num_users"):
        dataclasses.replace(CFG, num_users=0)
    with pytest.raises(ConfigError, match="doc_probability"):
        dataclasses.replace(CFG, doc_probability=1.5)


def test_workload_through_the_engine_matches_dense_and_frees_l1():
    model = build_model("tiny", seed=0)
    cfg = WorkloadConfig(num_sessions=5, num_users=3, turns=(1, 3), system_prompt_tokens=24,
                         num_documents=2, doc_tokens=(30, 60), doc_probability=0.5,
                         user_tokens=(3, 9), gen_tokens=(1, 5), think_s=(0.5, 3.0), ramp_s=1.0,
                         max_session_tokens=200, vocab_size=model.config.vocab_size, seed=2)
    geometry = model.kv_geometry(block_tokens=8)
    pool = torch.full((3 * 26, *geometry.block_shape), float("nan"))  # 3 users x 200 tokens
    engine = PagedEngine(model, pool, scheduler_seed=1)
    prompts: dict[str, list[list[int]]] = {}
    stats = run_workload(engine, Workload(cfg), step_s=lambda measured: 0.05,
                         on_event=lambda e: prompts.setdefault(e.session, []).append(
                             e.prompt_token_ids.tolist()))
    assert len(stats.turns) == 5 and stats.num_steps > 0
    for session, turns in stats.turns.items():
        history: list[int] = []
        for prompt, got in zip(prompts[session], turns, strict=True):
            want, _ = dense_generate(model, history + prompt, len(got))
            assert list(got) == want, session
            history += prompt + want
    assert engine.scheduler is not None and engine.scheduler.slots.num_used == 0
    assert not engine.seqs
