"""Counts and arguments at the controller's edge (issue #28, items 3 and 8): a huge, negative or
mistyped count or session id gets a typed error naming it, and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_controller import run
from tpkv.controller import Controller, SlotMapReplica
from tpkv.errors import ArgumentError, ArgumentTypeError, TierFullError, TpkvError
from tpkv.limits import MAX_SESSION_TOKENS
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MoveResult, Tier

BIG = 2**63 - 1


def _state(c: Controller) -> tuple:
    """Everything a refused call must leave as it was."""
    m, S, T = c.slot_map(), c.sessions, c.table
    live = S.open_indices()
    return (m["digest"], c.tick, c.next_epoch, c.committed_epoch, len(c.pending),
            tuple(sorted(S.index)), tuple(S.tokens[live].tolist()),
            tuple(S.pending[live].tolist()), tuple(S.attn_sum[live].tolist()),
            repr(sorted(S.pins.items())), int(T.pinned.sum()), float(T.attn.sum()),
            repr(c.rates.as_dict()), tuple(sorted(c.ranks)),
            tuple(T.num_free(t) for t in (Tier.HBM, Tier.DRAM, Tier.SSD)))


def _step(c: Controller, reps: list[SlotMapReplica], batch: list[str], tokens: list[int]) -> Any:
    return run(c, reps, batch, tokens)  # schedule, apply on every replica, commit, digests agree


@pytest.fixture
def setup(make_config: Any, fake_clock: Any) -> Callable[[], tuple[Controller, list[Any]]]:
    """A controller with sessions a (12 tokens, 3 blocks) and b (5 tokens) after one step."""

    def make() -> tuple[Controller, list[Any]]:
        c = Controller(make_config(), fake_clock, check_invariants=True, warm=False)
        reps = [SlotMapReplica(r, 16, 32) for r in range(2)]
        c.open_session("a", 12)
        c.open_session("b", 5)
        _step(c, reps, ["a", "b"], [0, 0])
        return c, reps
    return make


def test_extend_past_the_token_limit_is_refused(setup: Any) -> None:
    """2bd07df took extend_session(a, 2**63 - 1); the next step summed it into a negative token
    count and the table's integrity check failed."""
    c, reps = setup()
    before = _state(c)
    for n in (BIG, MAX_SESSION_TOKENS + 1, MAX_SESSION_TOKENS - 11):  # the last: 12 + n > MAX
        with pytest.raises(ArgumentError, match=f"{n}.*MAX_SESSION_TOKENS"):
            c.extend_session("a", n)
        assert _state(c) == before
    c.extend_session("a", MAX_SESSION_TOKENS - 12)  # exactly at the limit: taken
    with pytest.raises(ArgumentError, match="MAX_SESSION_TOKENS"):
        c.extend_session("a", 1)  # the sum passes it
    with pytest.raises(ArgumentError, match=r"'a' would hold 2147483648 tokens"):
        c.schedule(["a"], [1])
    with pytest.raises(TierFullError, match="L1 holds 16"):
        c.schedule(["a"], [0])  # 2**29 blocks: never fits, and no overflow on the way
    c.check_integrity()
    c.close_session("a")
    assert _step(c, reps, ["b"], [3]).num_tokens.tolist() == [8]
    c.check_integrity()


def test_huge_and_mistyped_counts_in_open_and_schedule_are_refused(setup: Any) -> None:
    c, reps = setup()
    before = _state(c)
    for n in (BIG, 2**64, MAX_SESSION_TOKENS + 1, -1):
        with pytest.raises(ArgumentError, match="num_tokens got"):
            c.open_session("n", n)
    for n in (1.0, True, "3", None):
        with pytest.raises(ArgumentTypeError, match="num_tokens must be an integer"):
            c.open_session("n", n)
    for tokens in ([2**62], [BIG], np.array([2**63], dtype=np.uint64), [2**70]):
        with pytest.raises(ArgumentError):
            c.schedule(["a"], tokens)
    for tokens in ([1.0], [True], ["1"], np.array([0.5])):
        with pytest.raises(ArgumentTypeError, match="num_new_tokens must be integers"):
            c.schedule(["a"], tokens)
    with pytest.raises(ArgumentError, match=r"got -1"):
        c.schedule(["a"], [-1])
    assert _state(c) == before and "n" not in c.sessions.index
    assert _step(c, reps, ["a", "b"], [1, 1]).num_tokens.tolist() == [13, 6]


def test_wrong_session_ids_and_ranges_leave_nothing_behind(setup: Any) -> None:
    """On 2bd07df: close_session([1]) raised TypeError, pin("a", 0.5) raised TypeError after
    recording the pin range, unpin("a", 1.5) stored a float range and then raised."""
    c, _ = setup()
    before = _state(c)
    for sid in ([1], {"a": 1}, None, 3, b"a"):
        for call in (c.close_session, c.session_blocks, lambda s: c.extend_session(s, 1),
                     lambda s: c.pin(s), lambda s: c.schedule([s], [1])):
            with pytest.raises(TpkvError, match="session ids are str"):
                call(sid)
    with pytest.raises(ArgumentTypeError, match="session_ids must be a list"):
        c.schedule("ab", [1, 1])  # a str is not a list of ids
    for args in ((0.5,), (0, 2.5), (True,), (-1,), (0, 2**40), (3, 1)):
        with pytest.raises(ArgumentError):
            c.pin("a", *args)
        with pytest.raises(ArgumentError):
            c.unpin("a", *args)
    with pytest.raises(ArgumentTypeError, match="start must be an integer, got float"):
        c.report_attention("a", [0.1], start=1.0)
    with pytest.raises(ArgumentError, match="start got -1"):
        c.report_attention("a", [0.1], start=-1)
    with pytest.raises(ArgumentTypeError, match="attention mass"):
        c.report_attention("a", "0.5")
    with pytest.raises(ArgumentError, match="seconds got nan"):
        c.report_prefill(100, float("nan"))
    with pytest.raises(ArgumentTypeError):
        c.mark_lost([1.5])  # 2bd07df truncated it to block 1
    with pytest.raises(ArgumentTypeError, match=r"results\[0\] must be a MoveResult"):
        c.commit([{"epoch": 1}])
    assert _state(c) == before


BAD: list[Any] = [None, True, False, -1, -(2**63), 2**31, BIG, 2**63, 2**64 + 5, 1.5, 2.0,
                  math.nan, math.inf, "3", b"3", [1], [[1, 2], [3]], {"a": 1}, object(),
                  np.int64(2), np.uint64(2**64 - 1), np.float32(1.0), np.array([1, 2]),
                  np.array([[1]]), "a/b", "", "x" * 300, "nope"]


def _calls(c: Controller) -> dict[str, Callable[[Any], Any]]:
    g = c.config.geometry
    return {
        "open_session.session_id": lambda v: c.open_session(v),
        "open_session.num_tokens": lambda v: c.open_session("n", v),
        "extend_session.session_id": lambda v: c.extend_session(v, 1),
        "extend_session.num_tokens": lambda v: c.extend_session("a", v),
        "close_session.session_id": lambda v: c.close_session(v),
        "pin.session_id": lambda v: c.pin(v),
        "pin.start": lambda v: c.pin("a", v),
        "pin.stop": lambda v: c.pin("a", 0, v),
        "unpin.start": lambda v: c.unpin("a", v),
        "unpin.stop": lambda v: c.unpin("a", 0, v),
        "schedule.session_ids": lambda v: c.schedule(v, [1]),
        "schedule.session_ids[0]": lambda v: c.schedule([v], [1]),
        "schedule.num_new_tokens": lambda v: c.schedule(["a"], v),
        "schedule.num_new_tokens[0]": lambda v: c.schedule(["a"], [v]),
        "schedule.upcoming": lambda v: c.schedule(["a"], [1], v),
        "schedule.upcoming[b]": lambda v: c.schedule(["a"], [1], {"b": v}),
        "schedule.upcoming[0]": lambda v: c.schedule(["a"], [1], [v]),
        "report_attention.session_id": lambda v: c.report_attention(v, [0.5]),
        "report_attention.mass": lambda v: c.report_attention("a", v),
        "report_attention.start": lambda v: c.report_attention("a", [0.5], v),
        "report_prefill.num_tokens": lambda v: c.report_prefill(v, 1.0),
        "report_prefill.seconds": lambda v: c.report_prefill(1000, v),
        "register_rank.rank": lambda v: c.register_rank(v, g),
        "register_rank.geometry": lambda v: c.register_rank(0, v),
        "register_rank.host": lambda v: c.register_rank(0, g, v),
        "mark_lost.block_ids": lambda v: c.mark_lost(v),
        "commit.results": lambda v: c.commit(v),
        "commit.results[0]": lambda v: c.commit([v]),
        "commit.results[0].epoch": lambda v: c.commit([MoveResult(v, 0, 0, 0)]),
        "snapshot.max_sessions": lambda v: c.snapshot(v),
        "session_blocks.session_id": lambda v: c.session_blocks(v),
        "rebuild.slot_maps": lambda v: c.rebuild(v, {}),
        "rebuild.ssd_manifests": lambda v: c.rebuild([], v),
        "rebuild.ssd_manifests[a]": lambda v: c.rebuild([], {"a": v}),
        "rebuild.ssd_records": lambda v: c.rebuild([], {}, v),
    }


def _try(setup: Any, call: str, value: Any) -> str | None:
    """The call with one bad argument on a fresh controller: None if it succeeded or raised a
    typed error leaving the state as it was, with the table intact and a step still running;
    else what went wrong."""
    c, reps = setup()
    before = _state(c)
    try:
        out = _calls(c)[call](value)
    except TpkvError:
        if _state(c) != before:
            return "refused, but the state changed"
        out = None
    except Exception as exc:
        return f"untyped {type(exc).__name__}: {str(exc)[:80]}"
    try:
        c.check_integrity()
        if isinstance(out, StepResult):  # a step the call made: the ranks apply it
            reports = [r.apply_step(out) for r in reps]
            for i in range(len(out.plans)):
                assert c.commit([rep[i] for rep in reports]).committed
        if call.startswith("rebuild"):  # a rebuild that took: the ranks' maps are not it
            reps = [SlotMapReplica(r, 16, 32) for r in range(2)]
            for r in reps:
                r.restore(c.resync())
        for name in ("n", "nope"):
            if name in c.sessions.index:
                c.close_session(name)
        batch = [s for s in ("a", "b") if s in c.sessions.index]
        try:
            _step(c, reps, batch, [1] * len(batch))
        except (TierFullError, ArgumentError):  # the call announced more tokens than L1
            # holds, or so many that one more passes MAX_SESSION_TOKENS: refused, and that is all
            c.close_session(batch[0])
            _step(c, reps, batch[1:], [1] * len(batch[1:]))
        c.check_integrity()
    except Exception as exc:
        return f"after it: {type(exc).__name__}: {str(exc)[:80]}"
    return None


def test_every_public_method_answers_bad_arguments_with_a_typed_error(setup: Any) -> None:
    """Each argument of each public Controller method, each value of BAD: success, or a typed
    error with nothing changed; the table stays intact and the next step runs."""
    names = list(_calls(setup()[0]))
    failures = []
    for call in names:
        for value in BAD:
            why = _try(setup, call, value)
            if why:
                failures.append(f"{call}={repr(value)[:30]}: {why}")
    print(f"{len(names)} arguments x {len(BAD)} values = {len(names) * len(BAD)} calls, "
          f"{len(failures)} failures")
    assert not failures, "\n".join(failures)


_values = st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=6), st.none(),
                    st.booleans(), st.integers(min_value=MAX_SESSION_TOKENS - 20,
                                               max_value=MAX_SESSION_TOKENS + 20))
_COUNT_ARGS = ["open_session.num_tokens", "extend_session.num_tokens", "pin.start", "pin.stop",
               "unpin.start", "unpin.stop", "schedule.num_new_tokens[0]", "schedule.upcoming[b]",
               "report_attention.start", "report_prefill.num_tokens", "report_prefill.seconds",
               "mark_lost.block_ids", "register_rank.rank", "snapshot.max_sessions"]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=st.sampled_from(_COUNT_ARGS), value=_values)
def test_any_count_gets_success_or_a_typed_error(setup: Any, call: str, value: Any) -> None:
    why = _try(setup, call, [value] if call == "mark_lost.block_ids" else value)
    assert why is None, why
