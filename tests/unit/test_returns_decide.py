"""Returns' decisions (models/returns.py) on a fake rank: who reads ahead, who goes in, when."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from tpkv.models.returns import Returns
from tpkv.protocol.plan import Tier


@dataclass
class FakeAhead:
    done_now: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    waited: list[list[str]] = field(default_factory=list)
    pending: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    finish_on_wait: set[str] = field(default_factory=set)

    def wait_any(self, names: list[str], timeout_s: float) -> None:
        self.waited.append(list(names))
        self.done_now |= self.finish_on_wait & set(names)

    def pending_bytes(self) -> int:
        return self.pending


class FakeWorker:
    """Its own `returning` (ReturningReads): start answers from `status`; `on3` / `on2`
    blocks per session in the mirror."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}
        self.on3: dict[str, int] = {}
        self.on2: dict[str, int] = {}
        self.started: list[str] = []
        self.dropped: list[str] = []
        self.busy: set[str] = set()
        self.waited_spills: list[set[str]] = []
        self.ahead = FakeAhead()
        self.returning = self
        self.store = SimpleNamespace(ahead=self.ahead, block_bytes=1 << 20)
        self.mirror = SimpleNamespace(session_logical=self._logical)
        self.executor = SimpleNamespace(
            spills=SimpleNamespace(busy=lambda n: n in self.busy,
                                   wait_written=self._wait_written),
            wait_spills=self._wait_spills)

    def _logical(self, name: str, tier: int) -> np.ndarray:
        n = (self.on3 if tier == int(Tier.SSD) else self.on2).get(name, 0)
        return np.arange(n)

    def _wait_spills(self, deadline: float, names: set[str]) -> None:
        self.waited_spills.append(set(names))
        self.busy -= names

    def _wait_written(self, timeout_s: float) -> None:
        self.waited_spills.append({"*"})
        self.busy = set()

    def start(self, name: str) -> str:
        if name in self.ahead.held:
            return "held"
        if name in self.busy:
            return "busy"
        status = self.status.get(name, "none")
        if status == "started":
            self.ahead.held.add(name)
            self.started.append(name)
        return status

    def done(self, name: str) -> bool:
        return name in self.ahead.done_now

    def on_l3(self, name: str) -> int:
        return self.on3.get(name, 0)

    def needed(self, name: str) -> bool:
        return self.on3.get(name, 0) > 0 and self.status.get(name) != "too_big"

    def drop(self, name: str) -> None:
        self.dropped.append(name)
        self.ahead.held.discard(name)
        self.ahead.done_now.discard(name)


def returns(rank: int = 0, **policy: Any) -> tuple[Returns, FakeWorker]:
    worker = FakeWorker()
    pol = SimpleNamespace(prefill_tokens_per_s=policy.get("prefill", 10.0),
                          ssd_read_bytes_per_s=policy.get("read", 1e12), gpu_share_weight=1.0)
    cfg = SimpleNamespace(wait_timeout_s=5.0, policy=pol,
                          geometry=SimpleNamespace(block_tokens=16))
    rt = SimpleNamespace(config=cfg, rank=rank, worker=worker,
                         from_rank0=lambda fn, what: fn())
    return Returns(rt), worker  # type: ignore[arg-type]


def seqs(*names: str) -> list[Any]:
    return [SimpleNamespace(session=n) for n in names]


def test_a_session_on_l3_waits_outside_until_its_read_ahead_is_done() -> None:
    r, w = returns()
    w.status = {"a": "started"}
    w.on3 = {"a": 4}
    assert r.admit(["a", "b"], [], idle=False) == ["b"]  # b has nothing on L3
    assert w.started == ["a"] and r.reading == {"a"} and r.num_read_ahead == 1
    assert r.admit([], ["a"], idle=False) == []  # still reading
    w.ahead.done_now.add("a")
    assert r.admit([], ["a"], idle=False) == ["a"]
    assert r.hints(["a", "b"]) == {"a": "load"}
    r.loaded(["a", "b"])
    assert w.dropped == ["a"] and not r.reading and r.hints(["a"]) is None


def test_the_next_step_lets_in_those_sampled_at_the_launch_not_those_done_since() -> None:
    """The step planned ahead expected exactly the sample: a read ahead done after the launch
    waits one more step (else the plan made ahead would be for another batch)."""
    r, w = returns()
    w.status = {"a": "started", "b": "started"}
    w.on3 = {"a": 4, "b": 4}
    r.admit(["a", "b"], [], idle=False)
    w.ahead.done_now.add("a")
    assert r.sample(seqs("a", "b")) == ["a"]
    w.ahead.done_now.add("b")  # done after the launch
    assert r.admit([], ["a", "b"], idle=False) == ["a"]
    assert r.admit([], ["b"], idle=False) == ["b"]  # no sample since: done is enough


def test_one_outside_whose_blocks_left_l3_goes_in_once_sampled() -> None:
    """Its blocks were loaded up or dropped meanwhile (nothing to read): it goes in at the
    step after the launch that saw it so, as that step's plan made ahead expects."""
    r, w = returns()
    w.status = {"a": "started"}
    w.on3 = {"a": 4}
    r.admit(["a"], [], idle=False)
    assert r.sample(seqs("a")) == []
    w.on3, w.ahead.held = {}, set()  # off L3; its read ahead discarded
    w.status = {}
    assert r.admit([], ["a"], idle=False) == []  # not in the sample: not yet
    assert r.sample(seqs("a")) == ["a"]
    assert r.admit([], ["a"], idle=False) == ["a"]


def test_with_nothing_to_run_it_waits_for_a_read_ahead() -> None:
    r, w = returns()
    w.status = {"a": "started"}
    w.on3 = {"a": 4}
    w.ahead.finish_on_wait = {"a"}
    assert r.admit(["a"], [], idle=True) == ["a"]
    assert w.ahead.waited == [["a"]]


def test_a_session_whose_spill_is_running_waits_and_idle_finishes_the_spill() -> None:
    r, w = returns()
    w.status = {"a": "started"}
    w.on3 = {"a": 4}
    w.busy = {"a"}
    assert r.admit(["a"], [], idle=False) == [] and not w.started  # busy: outside, no read
    assert r.admit([], ["a"], idle=False) == []
    w.ahead.finish_on_wait = {"a"}
    assert r.admit([], ["a"], idle=True) == ["a"]  # idle: spills finished, read, waited
    assert w.waited_spills == [{"a"}] and w.started == ["a"] and r.reading == {"a"}


def test_full_waits_and_too_big_goes_straight_in() -> None:
    r, w = returns()
    w.status = {"a": "full", "b": "too_big"}
    w.on3 = {"a": 4, "b": 400}
    assert r.admit(["a", "b"], [], idle=False) == ["b"]
    w.status["a"] = "started"  # room freed
    assert r.admit([], ["a"], idle=False) == [] and w.started == ["a"]


def test_a_session_the_gpu_recomputes_sooner_goes_in_to_be_recomputed() -> None:
    """8 blocks of 16 tokens at 1e5 tokens/s: 1.3 ms alone, 3.8 ms beside two decoding turns;
    its 4 blocks of 1 MiB on L3 behind 8 MiB queued at 1 GB/s: 12.6 ms."""
    r, w = returns(prefill=1e5, read=1e9)
    w.status = {"a": "started"}
    w.on3, w.on2 = {"a": 4}, {"a": 4}
    w.ahead.pending = 8 << 20
    r.num_running = lambda: 2
    assert r.admit(["a"], [], idle=False) == ["a"]
    assert r.recompute == {"a"} and r.num_recomputed == 1 and not w.started
    assert r.hints(["a"]) == {"a": "recompute"}
    r.loaded(["a"])
    assert not r.recompute
    # with the disk idle and fast, the same session is read ahead
    r2, w2 = returns(prefill=1e5, read=1e12)
    w2.status, w2.on3, w2.on2 = {"a": "started"}, {"a": 4}, {"a": 4}
    assert r2.admit(["a"], [], idle=False) == [] and w2.started == ["a"]


def test_a_read_that_ends_before_the_gpu_reaches_the_turn_is_never_traded_for_a_recompute(
        ) -> None:
    """The same turn as above (recompute 3.8 ms, read 12.6 ms), with 10 ms of decoding
    ahead of it (the batch's tokens, 2 ms each): the read ends first, so
    it is read ahead; turns that arrive before it and go in add their tokens to that work."""
    def setup(ahead_tokens: int) -> tuple[Returns, FakeWorker]:
        r, w = returns(prefill=1e5, read=1e9)
        w.status = {"a": "started"}
        w.on3, w.on2 = {"a": 4}, {"a": 4}
        w.ahead.pending = 8 << 20
        r.num_running = lambda: 2
        r.decoded(2, 0.004)  # a 4 ms step of two: 2 ms a token
        r.decode_ahead = lambda: ahead_tokens
        r.turn_tokens = lambda names: 3 * len(names)
        return r, w

    r, w = setup(5)
    assert r.decode_token_s == 0.002
    assert r.admit(["a"], [], idle=False) == [] and w.started == ["a"] and not r.recompute
    r, w = setup(2)  # 4 ms ahead: the recompute still ends first
    assert r.admit(["a"], [], idle=False) == ["a"] and r.recompute == {"a"}
    r, w = setup(2)  # with b (3 tokens: 6 ms more) going in before it, the read ends first
    assert r.admit(["b", "a"], [], idle=False) == ["b"] and w.started == ["a"]


def test_a_new_session_with_more_kv_than_l2_room_waits_while_the_batch_runs() -> None:
    """l2_room 40 blocks of 16 tokens: new sessions a (200 tokens, 13 blocks) and b (400,
    25) fit; c (20 blocks) waits outside while anything runs, and goes in once the room is
    back; with nothing running the first turn goes in after this rank's spills are written;
    one kept out max_held times goes in anyway."""
    r, w = returns()
    fresh = {"a": 200, "b": 400, "c": 320, "d": 16}
    r.new_session_tokens = lambda n: fresh[n]
    r.l2_room = 40
    assert r.admit(["a", "b", "c", "d"], [], idle=False) == ["a", "b", "d"]
    assert r.num_held == 1 and not w.waited_spills
    r.l2_room = 10  # (their step's)
    assert r.sample(seqs("c")) == []  # still no room: kept out at the launch too
    r.l2_room = 20
    assert r.sample(seqs("c")) == ["c"] and r.admit([], ["c"], idle=False) == ["c"]
    r.l2_room = 0
    assert r.admit(["a"], [], idle=False) == []
    assert r.admit([], ["a"], idle=True) == ["a"] and w.waited_spills == [{"*"}]
    r.l2_room = -1  # no limit (no L3, or the disk never left behind)
    assert r.admit(["b"], [], idle=False) == ["b"]
    r.l2_room, r.max_held = 0, 3
    held = [r.admit(["c"] if i == 0 else [], [] if i == 0 else ["c"], idle=False)
            for i in range(4)]
    assert held == [[], [], [], ["c"]] and r.num_held == 2 + 3 + 1
    # a turn of a session that holds K/V (no new-session tokens) is never held
    fresh["e"], r.l2_room = 0, 0
    assert r.admit(["e"], [], idle=False) == ["e"]


def test_other_ranks_start_what_rank_0_decided() -> None:
    r, w = returns(rank=1)
    decided = {"go": ["b"], "read": ["a"]}
    r.rt.from_rank0 = lambda fn, what: decided  # type: ignore[attr-defined]
    w.status = {"a": "started"}
    assert r.admit(["a", "b"], [], idle=False) == ["b"]
    assert w.started == ["a"] and r.reading == {"a"}
    assert r.sample(seqs("a")) == []  # only rank 0 samples


def test_a_long_queue_outside_costs_one_look_a_step_while_the_budget_is_full() -> None:
    """40 turns outside the batch, the budget full after the first: each step asks one read
    ahead (the first in line), the sample looks at none of those not read ahead, and once
    room frees the next in line starts."""
    r, w = returns()
    names = [f"s{i}" for i in range(40)]
    w.on3 = {n: 4 for n in names}
    w.status = {n: "full" for n in names}
    w.status["s0"] = "started"
    asked: list[str] = []
    looked: list[str] = []
    read_ahead, needs = w.start, w.needed
    w.start = lambda n: asked.append(n) or read_ahead(n)  # type: ignore[method-assign]
    w.needed = lambda n: looked.append(n) or needs(n)  # type: ignore[method-assign]
    assert r.admit(names, [], idle=False) == [] and w.started == ["s0"]
    assert len(asked) == 40  # arriving: each is looked at once
    asked.clear()
    for _ in range(3):
        assert r.sample(seqs(*names)) == []
        assert r.admit([], names, idle=False) == []
    # only the one read ahead: by the sample, and by admit weighing the line (the GPU's
    # work ahead of its last turn)
    assert looked == ["s0"] * 6
    assert asked == ["s0", "s1"] * 3  # s0 held, s1 full: the rest wait in line
    w.status["s1"] = "started"
    w.ahead.done_now.add("s0")
    assert r.sample(seqs(*names)) == ["s0"]
    assert r.admit([], names, idle=False) == ["s0"] and w.started == ["s0", "s1"]


def test_one_outside_that_needs_no_read_ahead_goes_in_at_the_next_sampled_step() -> None:
    """Its read ahead was asked while a step planned ahead was in flight and it needs none:
    the next sample names it."""
    r, w = returns()
    w.status, w.on3 = {"a": "full"}, {"a": 4}
    r.admit(["a"], [], idle=False)
    r.sample(seqs("a"))
    w.status, w.on3 = {"a": "too_big"}, {"a": 400}
    assert r.admit([], ["a"], idle=False) == []  # not in that sample
    assert r.sample(seqs("a")) == ["a"]
    assert r.admit([], ["a"], idle=False) == ["a"] and not r._straight


def test_a_read_ahead_in_flight_with_no_job_done_prices_at_the_start_rate() -> None:
    """The busy time counts from the first start: before any job ends the measured rate is
    no rate (0 bytes), and the start value stands."""
    r, w = returns(prefill=1e5, read=1e9)
    w.status, w.on3, w.on2 = {"a": "started"}, {"a": 4}, {"a": 4}
    w.ahead.read_s, w.ahead.read_bytes = 0.5, 0
    r.num_running = lambda: 2
    assert r.admit(["a"], [], idle=False) == ["a"] and r.recompute == {"a"}


def test_a_round_of_returns_is_split_between_the_gpu_and_the_disk() -> None:
    """Six sessions of 8 blocks off L1 (4 of 1 MiB on L3) come back at once. Alone, each
    recomputes in 1.3 ms (128 tokens at 1e5 tokens/s) against a 4.2 ms read at 1 GB/s; but
    the recomputes queue on the GPU: the first three end by 3.8 ms, a fourth would end at
    5.1 ms, so the rest are read ahead. Before (b2ac436) all six were recomputed and the
    disk idled (bench/e2e.py (c) on the H200: 104 recomputed, 0 read)."""
    r, w = returns(prefill=1e5, read=1e9)
    names = list("abcdef")
    w.status = {n: "started" for n in names}
    w.on3 = {n: 4 for n in names}
    w.on2 = {n: 4 for n in names}
    assert r.admit(names, [], idle=False) == ["a", "b", "c"]
    assert r.recompute == {"a", "b", "c"} and w.started == ["d", "e", "f"]
    r.loaded(["a", "b"])  # two ran: their recomputes leave the GPU's queue
    w.status["g"], w.on3["g"], w.on2["g"] = "started", 4, 4
    assert r.admit(["g"], ["d", "e", "f"], idle=False) == ["g"] and "g" in r.recompute


def test_a_finished_read_ahead_takes_the_free_place_before_straight_turns() -> None:
    """Outside the batch: x and y (nothing on L3) arrived before a, whose read ahead is done.
    The next step has one place: a takes it (its buffers hold the budget until its step),
    then x and y in arrival order; with nothing running, the same."""
    for idle in (False, True):
        r, w = returns()
        w.status, w.on3 = {"a": "started"}, {"a": 4}
        r.room = lambda: 0  # the batch is full: nobody goes in
        assert r.admit(["x", "y", "a"], [], idle=False) == [] and w.started == ["a"]
        w.ahead.done_now.add("a")
        r.room = lambda: 1
        if not idle:
            assert r.sample(seqs("x", "y", "a")) == ["a"]
        assert r.admit([], ["x", "y", "a"], idle=idle) == ["a"]
        r.room = lambda: 2
        assert r.sample(seqs("x", "y")) == ["x", "y"]
        assert r.admit([], ["x", "y"], idle=False) == ["x", "y"]


def test_turns_that_arrive_take_only_the_places_the_sample_left() -> None:
    r, w = returns()
    w.status, w.on3 = {"a": "started"}, {"a": 4}
    r.room = lambda: 0
    r.admit(["a"], [], idle=False)
    w.ahead.done_now.add("a")
    r.room = lambda: 1
    assert r.sample(seqs("a")) == ["a"]
    assert r.admit(["x", "y"], ["a"], idle=False) == ["a"]  # one place: the sampled a's
    r.room = lambda: 1
    assert r.sample(seqs("x", "y")) == ["x"]
    assert r.admit([], ["x", "y"], idle=False) == ["x"]


def test_a_straight_turn_passed_over_max_passed_times_goes_next() -> None:
    """x needs no read; a, b, c arrived after it, read ahead. One place a step: a and b pass
    x (twice, max_passed), then x goes before c."""
    r, w = returns()
    r.max_passed = 2
    w.status, w.on3 = {n: "started" for n in "abc"}, {n: 4 for n in "abc"}
    r.room = lambda: 0
    assert r.admit(["x", "a", "b", "c"], [], idle=False) == []
    w.ahead.done_now |= {"a", "b", "c"}
    r.room = lambda: 1
    outside, order = ["x", "a", "b", "c"], []
    while outside:
        picked = r.sample(seqs(*outside))
        went = r.admit([], outside, idle=False)
        assert went == picked and len(went) == 1
        order += went
        outside = [n for n in outside if n not in went]
    assert order == ["a", "b", "x", "c"] and not r._passed


def test_a_turn_sent_in_to_recompute_waits_for_a_place_and_reads_nothing() -> None:
    r, w = returns(prefill=1e5, read=1e9)  # (as in the recompute test above)
    w.status, w.on3, w.on2 = {"a": "started"}, {"a": 4}, {"a": 4}
    w.ahead.pending = 8 << 20
    r.num_running = lambda: 2
    r.room = lambda: 0
    assert r.admit(["a"], [], idle=False) == [] and r.recompute == {"a"}
    assert r.admit([], ["a"], idle=False) == [] and not w.started  # no sample yet
    r.room = lambda: 1
    assert r.sample(seqs("a")) == ["a"]
    assert r.admit([], ["a"], idle=False) == ["a"] and not w.started
    assert r.hints(["a"]) == {"a": "recompute"} and r.num_recomputed == 1


class BudgetWorker(FakeWorker):
    """Read aheads of sessions with blocks on L3, at most `budget` held at once."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.started_at: dict[str, int] = {}
        self.step = 0

    def start(self, name: str) -> str:
        if name in self.ahead.held:
            return "held"
        if not self.on3.get(name):
            return "none"
        if len(self.ahead.held) >= self.budget:
            return "full"
        self.ahead.held.add(name)
        self.started.append(name)
        self.started_at[name] = self.step
        return "started"


def _run_engine(turns: list[str], r: Returns | None, w: BudgetWorker | None, *,
                max_batch: int = 1, gen: int = 2, read_steps: int = 0,
                check: Callable[[Any], None] | None = None
                ) -> tuple[dict[str, tuple[int, ...]], list[list[str]], list[Any]]:
    """The tiny model's paged engine, `max_batch` turns in the batch, runs a 3-token prompt
    and `gen` new tokens for each of `turns` (all added at once), its admit hook `r` wired as
    TieredEngine wires Returns; a read ahead is done at the first launch `read_steps` steps
    after it started (an idle wait for one takes a step); `check(engine)` runs as each step
    starts. Returns (tokens of every turn, the sessions of each step, the batch predicted at
    each launch)."""
    import torch

    from tpkv.models.engine import PagedEngine
    from tpkv.models.llama import build_model

    model = build_model("tiny", seed=0, device="cpu")
    kv = model.kv_geometry(tp_size=1, block_tokens=4)
    pool = torch.zeros(128, kv.num_layers, 2, 4, kv.num_kv_heads, kv.head_dim)
    ran: list[list[str]] = []
    predicted: list[Any] = []

    def finish_reads() -> None:
        assert w is not None
        w.ahead.done_now |= {n for n in w.ahead.held if w.step >= w.started_at[n] + read_steps}

    def launched() -> None:
        if r is None or w is None:
            return
        finish_reads()
        predicted.append(engine.predict_next(r.sample(engine.returning)))

    def idle_wait(names: list[str], timeout_s: float) -> None:
        assert w is not None
        w.step += 1
        ran.append([])  # a step the batch waited, empty
        finish_reads()

    engine = PagedEngine(model, pool, max_batch=max_batch, launched=launched,
                         admit=None if r is None else r.admit)
    schedule = engine.schedule

    def spy(ids: Any, new: Any) -> Any:
        if check is not None:
            check(engine)
        ran.append(list(ids))
        if w is not None:
            w.step = len(ran)
        if r is not None:
            r.loaded(ids)
        return schedule(ids, new)
    engine.schedule = spy
    if r is not None and w is not None:
        r.room = engine.room
        w.ahead.wait_any = idle_wait  # type: ignore[method-assign]
    for i, name in enumerate(turns):
        engine.add_turn(name, [5 * i + 1, 5 * i + 2, 5 * i + 3], gen)
    got = {f.session: f.token_ids for f in engine.run()}
    return got, ran, predicted


def test_reads_done_go_first_so_the_next_reads_start_while_straight_turns_wait() -> None:
    """Four straight turns, then four with blocks on L3, a budget of two read aheads, one
    turn in the batch. a and b, read ahead, run right after s1; their steps give the budget
    back, so c and d are read (and run) before s2 runs: the disk is kept busy. Every step
    runs the batch predicted at the last launch, and the tokens are an engine's without the
    hook."""
    turns = ["s1", "s2", "s3", "s4", "a", "b", "c", "d"]
    want, _, _ = _run_engine(turns, None, None)
    r, _ = returns()
    w = BudgetWorker(budget=2)
    w.on3 = {n: 4 for n in "abcd"}
    r.rt.worker = w  # type: ignore[attr-defined]
    got, ran, predicted = _run_engine(turns, r, w)
    assert got == want
    first = [ids[0] for i, ids in enumerate(ran) if ids[0] not in {s[0] for s in ran[:i]}]
    assert first == ["s1", "a", "b", "c", "d", "s2", "s3", "s4"], ran
    s2_at = next(i for i, ids in enumerate(ran, 1) if ids == ["s2"])
    assert w.started == ["a", "b", "c", "d"] and w.started_at["d"] < s2_at, w.started_at
    for nxt, ids in zip(predicted, ran[1:]):
        assert nxt[0] == ids
    assert not r.reading and not w.ahead.held


def test_with_the_batch_ended_the_sampled_turns_still_go_in_as_planned() -> None:
    """The turns decoding all ended at the step whose launch sampled a and b: the step
    planned ahead for them stands. b's records went back to L3 since (a new read ahead):
    a and b go in as sampled, one place each, and nothing is waited for."""
    r, w = returns()
    w.status, w.on3 = {"a": "started", "b": "started"}, {"a": 4, "b": 4}
    r.room = lambda: 0
    r.admit(["a", "b"], [], idle=False)
    w.ahead.done_now |= {"a", "b"}
    r.room = lambda: 2
    assert r.sample(seqs("a", "b")) == ["a", "b"]
    w.ahead.done_now.discard("b")
    w.ahead.held.discard("b")  # (its buffers discarded: b is on L3 again)
    assert sorted(r.admit([], ["a", "b"], idle=True)) == ["a", "b"]
    assert not w.ahead.waited and w.started == ["a", "b"]


def test_finished_reads_go_in_first_so_the_disk_rarely_idles_and_no_step_waits() -> None:
    """24 straight turns and 12 with blocks on L3 in a random order, 3 in the batch, a budget
    of 3 read aheads of 6 steps each, 4 tokens a turn. Finished reads go in at the first
    places, so the next reads start: the disk idles (no read in flight while one waits for
    the budget) in fewer than a quarter of the steps (7 of 48 when written; before, with
    straight turns queued ahead of finished reads, 29 of 57), and the batch never waits
    empty for a read (before: 9 steps at the end). The tokens are an engine's without the
    hook."""
    import random

    l3 = [f"r{i}" for i in range(12)]
    turns = [f"s{i}" for i in range(24)] + l3
    random.Random(0).shuffle(turns)
    r, _ = returns()
    w = BudgetWorker(budget=3)
    w.on3 = {n: 4 for n in l3}
    r.rt.worker = w  # type: ignore[attr-defined]
    idle_disk: list[int] = []

    def check(engine: Any) -> None:
        outside = {s.session for s in engine.returning}
        in_flight = w.ahead.held - w.ahead.done_now
        if not in_flight and any(n in outside and n not in w.ahead.held for n in l3):
            idle_disk.append(w.step)

    got, ran, _ = _run_engine(turns, r, w, max_batch=3, gen=4, read_steps=6, check=check)
    want, _, _ = _run_engine(turns, None, None, max_batch=3, gen=4)
    assert got == want
    assert [] not in ran
    assert 0 < len(idle_disk) < len(ran) // 4, (len(ran), idle_disk)  # (the budget runs full)


def test_turns_waiting_in_line_for_the_read_budget_count_in_the_disk_s_queue() -> None:
    """Twenty sessions come back at once and the read-ahead budget takes none yet (each
    reads 4 MiB, 4.2 ms at 1 GB/s; each recomputes 128 tokens, 1.3 ms at 1e5 tokens/s).
    Before, the disk's queue counted only reads started: after three recomputes every
    later turn chose the disk (3 on the GPU, 3.8 ms; 17 on the disk, 71 ms; on the H200,
    bench/e2e.py c2 read 100 returns and recomputed 78, the GPU idling on a 1.5 GB/s disk).
    Now the turns in line count, and both queues end within one turn of each other."""
    r, w = returns(prefill=1e5, read=1e9)
    names = [f"s{i}" for i in range(20)]
    w.status = {n: "full" for n in names}
    w.on3 = {n: 4 for n in names}
    w.on2 = {n: 4 for n in names}
    assert r.admit(names, [], idle=False) == [n for n in names if n in r.recompute]
    gpu_s = len(r.recompute) * 128 / 1e5
    disk_s = (20 - len(r.recompute)) * (4 << 20) / 1e9
    assert abs(gpu_s - disk_s) < 4.2e-3, (gpu_s, disk_s)


def test_the_last_turns_in_the_disk_s_line_go_to_the_gpu_once_its_queue_drained() -> None:
    """Turns waiting in line for the read budget are weighed again each step, the last
    first: before, a turn that once chose the disk waited for it however idle the GPU."""
    r, w = returns(prefill=1e5, read=1e9)
    names = [f"s{i}" for i in range(8)]
    w.status = {n: "full" for n in names}
    w.on3 = {n: 4 for n in names}
    w.on2 = {n: 4 for n in names}
    first = r.admit(names, [], idle=False)
    line = [n for n in names if n not in first]
    assert first == ["s0", "s1", "s2", "s4", "s5", "s6"] and line == ["s3", "s7"]
    r.loaded(first)  # they ran: the GPU's queue is empty
    # the last in line first: recomputing it (1.3 ms) ends before the reads ahead of it
    # (4.2 ms of s3's, then its own); then s3 (2.6 ms after s7's against its 4.2 ms read)
    assert r.admit([], line, idle=False) == ["s7", "s3"]
    assert set(r.recompute) == {"s3", "s7"} and not w.started and r.num_recomputed == 8


def test_a_disk_faster_than_the_gpu_reads_every_turn_in_line() -> None:
    """Twenty turns come back at once, the read-ahead budget full (each reads 4 MiB: 4.2 ms
    at 1 GB/s; each recomputes 128 tokens: 1.3 ms at 1e5 tokens/s) and the GPU spends 32 ms
    decoding each turn (16 tokens at 2 ms). The first is recomputed (the GPU has nothing
    ahead of it); every later one has the decoding of the turns before it ahead of it on the
    GPU, which the disk outruns, so it is read, and the line is never moved to the GPU.
    Before, only the batch's and the ready turns' decoding counted: the turns in line were
    recomputed as the GPU's queue drained (on the H200, c2-em14 recomputed 45 of 112
    returns, the GPU the bound)."""
    r, w = returns(prefill=1e5, read=1e9)
    names = [f"s{i}" for i in range(20)]
    w.status = {n: "full" for n in names}
    w.on3 = {n: 4 for n in names}
    w.on2 = {n: 4 for n in names}
    r.decoded(1, 0.002)
    r.turn_tokens = lambda ns: 16 * len(ns)
    assert r.admit(names, [], idle=False) == ["s0"] and r.recompute == {"s0"}
    r.loaded(["s0"])
    for _ in range(3):  # the GPU's queue drained: the line still waits for the disk
        assert r.admit([], names[1:], idle=False) == []
    assert not r.recompute and r.num_recomputed == 1 and list(r._line) == names[1:]
    # with the GPU idle and the disk slow (0.1 GB/s: 42 ms a turn), the last go to the GPU
    w.ahead.read_bytes, w.ahead.read_s = 1 << 20, 0.01
    assert r.admit([], names[1:], idle=False) == ["s19", "s18", "s17", "s16"]
