"""A refused turn leaves the engine working (issue #28, item 5): TieredEngine.add_turn checks the
session id, the counts and the token ids before it queues anything."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.transport import TRANSPORTS, kill_actor, session_tokens  # noqa: E402


def _open(controller: str = "local") -> Any:
    import tpkv
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=4, l1_blocks=24, l2_blocks=64,
                        policy=PolicyConfig(cooldown_s=0.0))
    return tpkv.init(cfg, controller=controller, device="cpu"), model


@pytest.fixture(scope="module", params=TRANSPORTS)
def runtime(request: pytest.FixtureRequest) -> Any:
    """One runtime per transport (tests/conftest.py): in process, then through the actor."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    rt, model = _open(request.param)
    try:
        yield rt, model
    finally:
        rt.close()
        if request.param == "ray":
            kill_actor()


BAD_TURNS = [  # (session, prompt, max_new_tokens, error)
    ("", [1, 2, 3], 2, "InvalidSessionIdError"),
    ("a/b", [1, 2, 3], 2, "InvalidSessionIdError"),
    ("x" * 300, [1, 2, 3], 2, "InvalidSessionIdError"),
    ("../etc", [1, 2, 3], 2, "InvalidSessionIdError"),
    ("s1", [1, 2, 3], 1.5, "ArgumentTypeError"),
    ("s2", [1, 2, 3], True, "ArgumentTypeError"),
    ("s3", [1, 2, 3], 2**63, "ArgumentError"),
    ("s4", [1, 10**9], 2, "ArgumentError"),  # past the vocabulary: the embedding fails
    ("s5", [1, -1], 2, "ArgumentError"),
    ("s6", [1, "a", 3], 2, "ArgumentTypeError"),  # 2bd07df queued [1] then raised
    ("s7", [1.5], 2, "ArgumentTypeError"),
    ("s8", list(range(97)), 2, "ArgumentError"),  # 25 blocks: L1 holds 24
]


@pytest.mark.parametrize("session,prompt,max_new,error", BAD_TURNS,
                         ids=[f"{s[:8]!r}-{e}" for s, _, _, e in BAD_TURNS])
def test_a_refused_turn_leaves_nothing_queued_and_the_engine_working(
        runtime: Any, session: str, prompt: list[Any], max_new: Any, error: str) -> None:
    """On 2bd07df each was queued (or half-queued), raised at step time, and every later step
    failed on it: a valid session's turn never ran and could not be closed."""
    from tpkv import errors
    from tpkv.models.llama import dense_generate
    from tpkv.models.tiered import TieredEngine
    from tpkv.models.turns import Finished

    rt, model = runtime
    tiered = TieredEngine(rt, model, report_prefill=False)
    e = tiered.engine
    with pytest.raises(getattr(errors, error)):
        e.add_turn(session, prompt, max_new)
    assert not e.waiting and not e.running and session not in e.seqs
    good = list(range(5, 14))
    e.add_turn("ok", good, 3)
    assert e.run() == [Finished("ok", tuple(dense_generate(model, good, 3)[0]))]
    assert session_tokens(rt)["ok"] == 11
    e.close_session("ok")
    e.run()  # the close reaches the ranks with the next step (none: nothing to run)
    left = session_tokens(rt)
    assert "ok" not in left and session not in left
    rt.controller.check_integrity()


def test_a_session_id_refused_by_the_runtime_and_the_hf_cache(runtime: Any) -> None:
    from tpkv.errors import ArgumentError, ArgumentTypeError, InvalidSessionIdError

    rt, _ = runtime
    with pytest.raises(InvalidSessionIdError):
        rt.open_session("a/b")
    with pytest.raises(ArgumentError, match="MAX_SESSION_TOKENS"):
        rt.open_session("r", 2**63 - 1)
    with pytest.raises(ArgumentTypeError, match="num_new_tokens must be integers"):
        rt.run_step(["r"], [1.5], lambda step: step)  # 2bd07df truncated it to 1
    with pytest.raises(ArgumentTypeError, match="session_ids must be a list"):
        rt.run_step("rr", [1, 1], lambda step: step)
    assert "r" not in session_tokens(rt)
    pytest.importorskip("transformers")
    from tpkv.models.hf_cache import TpkvCache

    with pytest.raises(InvalidSessionIdError):
        TpkvCache(rt, "a/b")


REFUSED_STEPS = [  # (session ids, new tokens, error, words of its message)
    (["q1", "q2"], [1], "BadRequestError", "needs 2 integers, got 1"),
    (["q1"], [200], "TierFullError", "needs 52 L1 slots; L1 holds 24"),
    (["q1", "q1"], [1, 1], "DuplicateSessionError", "'q1' appears twice"),
    (["q1"], [-1], "ArgumentError", "session 'q1' got -1"),
    (["nope"], [1], "UnknownSessionError", "unknown session 'nope'"),
]


def test_a_step_the_controller_refuses_is_its_typed_error_and_changes_nothing(
        runtime: Any) -> None:
    """The controller's own checks of a schedule (not the runtime's): through the actor the
    same error class and message as in process, whether the step was planned ahead or at
    begin_step, and the session's count, the maps and the next step as before."""
    from tpkv import errors

    rt, _ = runtime
    for name in ("q1", "q2"):
        rt.open_session(name)
    rt.run_step(["q1"], [5], lambda step: step)
    before = session_tokens(rt)
    for ids, tokens, error, words in REFUSED_STEPS:
        for ahead in (False, True):
            if ahead and min(tokens) < 0:  # the runtime's own check refuses this one
                with pytest.raises(errors.ArgumentError, match="negative"):
                    rt.schedule_ahead(ids, tokens)
            elif ahead:  # refused there too: the step then asks again and gets the error
                rt.schedule_ahead(ids, tokens)
            with pytest.raises(getattr(errors, error), match=words):
                rt.run_step(ids, tokens, lambda step: step)
    assert session_tokens(rt) == before and before["q1"] == 5
    rt.run_step(["q1", "q2"], [2, 3], lambda step: step)
    assert {s: n for s, n in session_tokens(rt).items() if s in ("q1", "q2")} == {"q1": 7,
                                                                                 "q2": 3}
    rt.settle_ahead()
    assert rt.worker.slot_map()["digest"] == rt.controller_slot_map()["digest"]
    for name in ("q1", "q2"):
        rt.close_session(name)
