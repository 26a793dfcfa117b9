"""The paged engine against a dense recompute: batched decode, moves between turns, the loop."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tpkv.errors import ArgumentError, BadRequestError, ConfigError, TierFullError
from tpkv.models.engine import PagedEngine
from tpkv.models.graphs import graph_keys
from tpkv.models.llama import Llama, ModelConfig, build_model, dense_generate
from tpkv.models.paged import paged_attention_ref
from tpkv.models.turns import Finished, StepReport

BT = 4
ATOL = 1e-4  # float32 logits: paged (masked fp32 softmax) vs dense (SDPA) differ by reduction order


@functools.cache
def _model(tied: bool = False) -> Llama:
    return build_model(ModelConfig.preset("tiny", tie_embeddings=tied), seed=0)


def _pool(model: Llama, slots: int) -> torch.Tensor:
    g = model.kv_geometry(block_tokens=BT)
    return torch.full((slots, *g.block_shape), float("nan"))  # reading unwritten KV shows


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


@pytest.mark.parametrize("tied", [False, True])
def test_batched_decode_over_scattered_blocks_matches_dense(tied):
    model, steps = _model(tied), 8
    prompts = _prompts([1, 4, 7, 13, 16, 22], seed=1)
    pool = _pool(model, 64)
    perm = np.random.default_rng(2).permutation(64)
    nb = [-(-(len(p) + steps) // BT) for p in prompts]
    tables = dict(zip("abcdef", np.split(perm[:sum(nb)], np.cumsum(nb)[:-1])))
    engine = PagedEngine(model, pool)
    got: dict[str, list[int]] = {s: [] for s in tables}
    logits: dict[str, list[torch.Tensor]] = {s: [] for s in tables}
    for s, p in zip(tables, prompts):  # each prompt prefilled alone
        out = engine.prefill(s, p, tables[s])
        got[s].append(out.tokens[0])
        logits[s].append(out.logits[0])
    for _ in range(steps - 1):  # then one batch of six sessions of different lengths
        out = engine.decode_step(list(tables.items()))
        for s, t, row in zip(out.session_ids, out.tokens, out.logits):
            got[s].append(t)
            logits[s].append(row)
    for s, p in zip(tables, prompts):
        want, want_logits = dense_generate(model, p, steps)
        assert got[s] == want, s
        torch.testing.assert_close(torch.stack(logits[s]), want_logits, atol=ATOL, rtol=ATOL)


def test_moving_blocks_between_turns_leaves_tokens_unchanged():
    model = _model()
    turn1, turn2 = _prompts([10, 7], seed=3)
    results = []
    for move in (False, True):
        engine = PagedEngine(model, _pool(model, 40), scheduler_seed=5)
        engine.add_turn("s", turn1, 6)
        (first,) = engine.run()
        assert engine.scheduler is not None
        if move:  # the controller moved the blocks (e.g. to L2 and back) to other L1 slots
            old = engine.scheduler.session_slots("s")
            new = engine.scheduler.relocate("s", engine.pool)
            assert not set(old) & set(new)
            engine.pool[torch.from_numpy(old)] = float("nan")  # the old copies must not be read
        engine.add_turn("s", turn2, 6)
        (second,) = engine.run()
        results.append((first.token_ids, second.token_ids))
    assert results[0] == results[1]
    want1, _ = dense_generate(model, turn1, 6)
    want2, _ = dense_generate(model, turn1 + want1 + turn2, 6)
    assert results[1] == (tuple(want1), tuple(want2))


def test_lost_blocks_are_recomputed_after_invalidate():
    model, (turn1, turn2) = _model(), _prompts([13, 6], seed=8)
    engine = PagedEngine(model, _pool(model, 16), scheduler_seed=2)
    engine.add_turn("s", turn1, 4)
    (first,) = engine.run()
    assert engine.scheduler is not None
    slots = engine.scheduler.session_slots("s")
    engine.pool[torch.from_numpy(slots[1:])] = float("nan")  # blocks 1.. lost
    assert engine.invalidate("s", keep_tokens=BT) == 13 + 4 - BT
    engine.add_turn("s", turn2, 4)
    (second,) = engine.run()
    want, _ = dense_generate(model, turn1 + list(first.token_ids) + turn2, 4)
    assert list(second.token_ids) == want


def test_a_report_counts_the_tokens_a_schedule_sends_back_for_recompute():
    """A schedule that loses blocks (engine.invalidate, as the tiers do for a recompute): the
    step feeds those tokens again, and its report counts every token it wrote."""
    model, (turn1, turn2) = _model(), _prompts([13, 6], seed=8)
    engine = PagedEngine(model, _pool(model, 16))
    local = engine.schedule
    reports: list[StepReport] = []

    def losing(sessions: list[str], new: list[int]):  # type: ignore[no-untyped-def]
        if engine.seqs["s"].num_cached:  # the second turn: all but the first block lost
            engine.invalidate("s", keep_tokens=BT)
        return local(sessions, new)

    engine.schedule, engine.report = losing, reports.append
    engine.add_turn("s", turn1, 1)
    engine.run()
    engine.add_turn("s", turn2, 1)
    engine.run()
    assert [r.num_new_tokens for r in reports] == [(13,), (13 + 1 + 6 - BT,)]


def test_step_loop_runs_multi_turn_sessions_like_dense():
    model = _model()
    prompts = dict(zip(["x", "y", "z", "w"], _prompts([3, 18, 9, 5], seed=4)))
    calls: list[str] = []
    reports: list[StepReport] = []

    def report(r: StepReport) -> None:
        calls.append("report")
        reports.append(r)

    engine = PagedEngine(model, _pool(model, 48), scheduler_seed=0, max_prefill_tokens=20,
                         wait=lambda tables: calls.append("wait"), report=report)
    for s, p in prompts.items():
        engine.add_turn(s, p, 1 + len(p) % 5)
    first = {f.session: f.token_ids for f in engine.run()}
    assert calls[:2] == ["wait", "report"] and len(calls) == 2 * len(reports)
    kinds = [r.kind for r in reports]
    assert kinds[:2] == ["prefill", "prefill"] and "decode" in kinds  # x+y > 20: two prefills
    second_prompts = _prompts([4, 4], seed=5)
    for s, p in zip(["y", "w"], second_prompts):
        engine.add_turn(s, p, 3)
    second = {f.session: f.token_ids for f in engine.run()}
    for s, p in prompts.items():
        want, _ = dense_generate(model, p, 1 + len(p) % 5)
        assert first[s] == tuple(want), s
    for s, p in zip(["y", "w"], second_prompts):
        history = prompts[s] + list(first[s])
        want, _ = dense_generate(model, history + p, 3)
        assert second[s] == tuple(want), s
    assert engine.scheduler is not None
    used = engine.scheduler.slots.num_used
    engine.close_session("y")
    assert engine.scheduler.slots.num_used == used - -(-(3 + 18 + 4 + 4 - 1) // BT)


def test_attention_mass_sums_to_layers_heads_and_tokens():
    model = _model()
    cfg = model.config
    reports: list[StepReport] = []
    engine = PagedEngine(model, _pool(model, 32), report=reports.append)
    for s, p in zip("ab", _prompts([11, 5], seed=6)):
        engine.add_turn(s, p, 4)
    engine.run()
    for r in reports:
        for i, mass in enumerate(r.output.block_mass):
            blocks = len(r.tables.session_slots(i))
            assert mass.shape == (blocks,) and (mass >= 0).all()
            total = cfg.num_layers * cfg.num_heads * r.num_new_tokens[i]
            assert mass.sum() == pytest.approx(total, rel=1e-5)


def test_chunked_reference_in_the_engine_gives_the_same_tokens():
    model, prompt = _model(), _prompts([30], seed=7)[0]
    tiny_chunks = functools.partial(paged_attention_ref, max_score_bytes=1)
    outs = []
    for impl in (paged_attention_ref, tiny_chunks):
        engine = PagedEngine(model, _pool(model, 16), attention=impl)
        engine.add_turn("s", prompt, 5)
        outs.append(engine.run())
    assert outs[0] == outs[1] == [Finished("s", tuple(dense_generate(model, prompt, 5)[0]))]


def test_misuse_is_refused():
    model = _model()
    with pytest.raises(ConfigError, match="needs"):
        PagedEngine(model, torch.zeros(8, 3, 2, 4, 3, 16))  # wrong head count
    engine = PagedEngine(model, _pool(model, 4))
    with pytest.raises(ArgumentError, match="max_tokens 17 is 5 blocks, more than L1's 4"):
        engine.capture_graphs(17)
    with pytest.raises(BadRequestError, match="max_tokens"):
        engine.capture_graphs(0)
    assert engine.capture_graphs(16) == 0  # on the CPU: no graphs
    engine.add_turn("s", [1, 2], 2)
    with pytest.raises(BadRequestError, match="before the first turn.*holds 1 sessions"):
        engine.capture_graphs(16)
    with pytest.raises(BadRequestError, match="in progress"):
        engine.add_turn("s", [3], 2)
    with pytest.raises(BadRequestError, match="max_new_tokens"):
        engine.add_turn("t", [3], 0)
    with pytest.raises(ArgumentError, match="more than L1's 4 slots"):
        engine.add_turn("never", list(range(40)), 1)  # 10 blocks of a 4-slot L1: never runs
    assert "never" not in engine.seqs and len(engine.waiting) == 1
    engine.add_turn("big", list(range(16)), 1)  # 4 blocks: fits alone, not beside "s"
    with pytest.raises(TierFullError, match="free of 4"):
        engine.run()
    assert len(engine.waiting) == 2 and not engine.running  # nothing half-done: retry works
    engine.waiting.pop()
    del engine.seqs["big"]
    assert engine.run() == [Finished("s", tuple(dense_generate(model, [1, 2], 2)[0]))]


def test_graph_keys_cover_every_batch_width_and_turn_bucket():
    # decode: batches 1-3 x widths 64, 128 blocks; turns: rows 16..512, all under 64 blocks
    assert len(graph_keys(3, 1202, 16, 64, 512)) == 3 * 2 + 6 * 2
    assert len(graph_keys(3, 17408, 16, 64, 512)) == 153  # bench/e2e.py --full's sessions
    assert graph_keys(2, 100, 16, 64, 0) == [(1, 64, 0), (2, 64, 0)]  # no turn graphs
    keys = graph_keys(1, 100, 4, 8, 64)  # widths 8..32 blocks of 4 tokens: rows that fit
    assert [k for k in keys if k[0] == 1] == [(1, 8, 0), (1, 16, 0), (1, 24, 0), (1, 32, 0)]
    assert sorted(k[1:] for k in keys if k[0] == -1) == [
        (16, 8), (16, 16), (16, 24), (16, 32), (32, 16), (32, 24), (32, 32), (64, 24), (64, 32)]


def test_capture_graphs_refuses_more_graphs_than_it_should_capture_ahead():
    model = _model()
    engine = PagedEngine(model, _pool(model, 4096), max_batch=64)
    captured = []
    engine.graphs = SimpleNamespace(  # stands in for a GPU's DecodeGraphs
        ahead_keys=lambda b, t: graph_keys(b, t, BT, 64, 512),
        capture_ahead=lambda keys: captured.append(keys) or len(keys))
    with pytest.raises(ArgumentError, match=r"would capture 4477 graphs \(max_batch 64, "
                                            r"max_tokens 16384\), more than 1024"):
        engine.capture_graphs(16384)
    assert not captured
    assert engine.capture_graphs(256) == 64 + 4 and len(captured) == 1  # width 64, rows < 256


@pytest.mark.parametrize("turn", [1, 6, 17])
def test_padded_turn_of_the_prefill_graphs_matches_the_turn_run_eagerly(turn):
    """The form the prefill graphs replay (rows padded with copies of the last token, the table
    with slot 0, PagedMeta.write_src), run eagerly here: the logits and every byte written to
    the pool (padding rows store nowhere else; unwritten slots stay NaN) match the plain turn."""
    from tpkv.models.graphs import prefill_inputs, prefill_meta
    from tpkv.models.paged import PagedAttention, paged_attention_sdpa

    model = _model()
    slots = np.array([9, 3, 14, 0, 7, 11, 5, 2, 12, 8])  # 40 tokens of room
    pool = _pool(model, 16)
    engine = PagedEngine(model, pool, attention=paged_attention_sdpa, cuda_graphs=False)
    context, new = _prompts([21, turn], seed=turn)
    engine.prefill("s", context, slots)
    seq = engine.seqs["s"]
    fed = seq.token_ids[seq.num_cached:] + new  # the last answer token, then the turn
    seq_len = len(seq.token_ids) + len(new)
    padded_pool = pool.clone()
    want = engine.prefill("s", new, slots).logits

    host, qb, width = prefill_inputs(fed, slots, seq_len, BT, bucket_blocks=8)
    assert qb == (16 if len(fed) <= 16 else 32)  # padded: rows past the turn repeat its last
    assert width == (8 if seq_len <= 8 * BT else 16)
    meta, ids, last = prefill_meta(torch.from_numpy(host), qb, width, BT)
    with torch.inference_mode():
        got = model(ids, meta.positions, PagedAttention(padded_pool, meta, paged_attention_sdpa),
                    last)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(padded_pool, pool, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.isnan(pool[[1, 4, 6, 10, 13, 15]]).all()  # slots outside the table: untouched


def test_the_decode_graphs_inputs_run_eagerly_match_the_engine_decode():
    """The form the decode graphs replay (decode_inputs: one token a session, the tables
    padded with slot 0 to the width bucket), run eagerly here through the graphs' own forward:
    the logits and every byte written to the pool match the engine's eager decode step. The
    dummy a capture runs is the same builder's one-token session."""
    from tpkv.models.graphs import _FIELDS, DecodeGraphs, decode_inputs

    model = _model()
    pool = _pool(model, 32)
    engine = PagedEngine(model, pool, cuda_graphs=False)
    tables = {"a": np.array([9, 3]), "b": np.array([14, 0, 7, 11, 5]), "c": np.array([30])}
    for s, n in zip(tables, (6, 17, 2)):
        engine.prefill(s, _prompts([n], seed=n)[0], tables[s])
    seqs = [engine.seqs[s] for s in tables]
    seq_lens = [len(q.token_ids) for q in seqs]
    host, width, used = decode_inputs([q.token_ids[-1] for q in seqs], list(tables.values()),
                                      seq_lens, BT, bucket_blocks=4)
    assert (width, used) == (8, 5)  # 18 tokens: 5 blocks of 4, in the bucket of 8
    graph_pool = pool.clone()
    want = engine.decode_step(list(tables.items())).logits
    runner = SimpleNamespace(model=model, pool=graph_pool, attention=engine.attention,
                             block_tokens=BT)
    with torch.inference_mode():
        got, _ = DecodeGraphs._run(runner, torch.from_numpy(host), 3, width)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(graph_pool, pool, atol=1e-5, rtol=1e-5, equal_nan=True)

    dummy, w, _ = decode_inputs([0] * 2, [np.zeros(1, np.int64)] * 2, [1] * 2, BT, 4, width=12)
    want_dummy = np.zeros(2 * (_FIELDS + 12), dtype=np.int64)
    want_dummy[2 * 2:3 * 2] = 1  # sequence length 1; token, position, slot, offset 0
    assert w == 12 and np.array_equal(dummy, want_dummy)


def test_predict_next_names_the_batch_the_next_step_runs():
    """Inside each step (its `launched` hook) the engine names the next step's batch: prefills
    of the turns waiting (as many as the token budget and the batch take), then the decoding
    turns less those this step ends, one token each; and the turns decoding after this step.
    With no turn added in between, every prediction is the batch the next step() runs."""
    model = _model()
    predicted: list[object] = []
    engine = PagedEngine(model, _pool(model, 64), max_batch=3, max_prefill_tokens=12,
                         launched=lambda: predicted.append(engine.predict_next()))
    ran: list[tuple[list[str], list[int]]] = []
    running: list[list[str]] = []  # the turns decoding when each step starts
    schedule = engine.schedule

    def spy(ids, new):  # the batch each step runs
        ran.append((list(ids), list(new)))
        running.append([s.session for s in engine.running])
        return schedule(ids, new)
    engine.schedule = spy
    prompts = _prompts([7, 4, 9, 3], seed=5)
    for i, p in enumerate(prompts):
        engine.add_turn(f"s{i}", p, 2 + i)
    engine.run()
    assert engine.predict_next() is None  # outside a step
    assert len(predicted) == len(ran) >= 6
    for (ids, new, after), nxt, now in zip(predicted[:-1], ran[1:], running[1:]):
        assert (ids, new) == nxt and after == now
    last = predicted[-1]
    assert last[0] == [] and last[2] == []  # every turn ends with the last step
    # prefills first while the batch (3) has room, then the decode steps, one token each;
    # s3 waits until s0's turn (2 tokens) is over
    assert ran[0] == (["s0", "s1"], [7, 4]) and ran[1] == (["s2"], [9])
    assert ran[2] == (["s0", "s1", "s2"], [1, 1, 1]) and ran[3] == (["s3"], [3])
    assert all(n == [1] * len(ids) for ids, n in ran[4:])
    assert max(len(r) for r in running) == 3


def test_room_counts_the_places_the_next_step_has_for_turns_outside():
    """Outside a step: max_batch less the turns decoding and waiting (turns the admit hook
    keeps outside take none); at a launch: those after this step (prefilled turns decode,
    ended ones leave). One prefill a step, max_batch 2: s0 (3 tokens), s1 and s2 (2 each)."""
    model = _model()
    rooms: list[int] = []
    engine = PagedEngine(model, _pool(model, 64), max_batch=2, max_prefill_tokens=1,
                         launched=lambda: rooms.append(engine.room()),
                         admit=lambda new, back, idle: [])
    engine.add_turn("s0", [1, 2, 3], 3)
    assert engine.room() == 2 and engine.step() == [] and engine.room() == 2
    engine.admit = lambda new, back, idle: [*back, *new]
    engine.add_turn("s1", [4, 5], 2)
    engine.add_turn("s2", [6], 2)
    engine.step()  # s0's prefill; s1 and s2 queue
    assert rooms == [0] and engine.room() == 0  # s0 decodes, s1 and s2 wait: 2 - 1 - 2 < 0
    engine.run()
    # s1's prefill (2 decode, s2 waits), both decode (s1 ends, s2 waits), s2's prefill (2
    # decode), both decode and end
    assert rooms == [0, 0, 0, 0, 2] and engine.room() == 2
