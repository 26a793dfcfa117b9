"""TpkvCache counts a pass's tokens to the end of its block, runs the passes that fit that room
with no step while no other step was applied, and plans the step of the pass after a block's
last token ahead (TpkvRuntime.schedule_ahead), and HfTiers.generate the step of a turn's first
pass, never one past the turn's last pass; turns that stop early (EOS) and other sessions' turns
leave a wrong guess or a credit, which must cost nothing but time: tokens and K/V stay
DynamicCache's through L2 and L3, and the controller's count is the cache's length plus the
session's credit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.hf_cases import BT, L1_BLOCKS, L2_BLOCKS, VOCAB, one_process, tiers_config, tiny_llama
from tests.transport import session_tokens

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    one_process(monkeypatch)
    torch.set_num_threads(1)


class Chat:
    """Turns through tpkv.attach and through one DynamicCache a session, side by side."""

    def __init__(self, model: Any, tiers: Any, seed: int = 0) -> None:
        from tpkv.models.hf_attach import cache_kwarg

        self.model, self.tiers, self.kw = model, tiers, cache_kwarg(model)
        self.rng = np.random.default_rng(seed)
        self.history: dict[str, torch.Tensor] = {}
        self.refs: dict[str, Any] = {}
        # what the cache should do (`_expect`): steps, passes with no step, steps planned
        # ahead and then used; per session its room and tokens fed; whose step came last; the
        # step planned ahead (session, tokens asked)
        self.steps = self.skipped = self.sent = self.used = 0
        self.room: dict[str, int] = {}
        self.fed: dict[str, int] = {}
        self.last: str | None = None
        self.ahead: tuple[str, int] | None = None

    def turn(self, s: str, n: int, max_new: int, eos: bool = False) -> int:
        """n new user tokens, then generate; with `eos`, the turn's second generated token
        (as DynamicCache makes it) is the EOS, so generation stops there. Returns the
        tokens generated."""
        from transformers import DynamicCache

        user = torch.as_tensor(self.rng.integers(0, VOCAB, (1, n)), dtype=torch.long)
        ids = torch.cat([self.history[s], user], dim=1) if s in self.history else user
        ref = self.refs.setdefault(s, DynamicCache())
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": False}
        if eos:  # DynamicCache on a copy finds the token; the real turns then stop at it
            probe = DynamicCache()
            with torch.no_grad():
                full = self.model.generate(ids, **{self.kw: probe}, **kwargs)
            kwargs["eos_token_id"] = int(full[0, ids.shape[1] + 1])
        with torch.no_grad():
            want = self.model.generate(ids, **{self.kw: ref}, **kwargs)
            got = self.tiers.generate(s, ids, **kwargs)
        assert torch.equal(got, want), (s, got[0, ids.shape[1]:], want[0, ids.shape[1]:])
        self.history[s] = got
        out = got.shape[1] - ids.shape[1]
        base = self.fed.get(s, 0)
        last = ids.shape[1] + max_new - 1  # tokens fed once the turn's last pass is
        first = ids.shape[1] - base
        if self.ahead is None and s in self.fed and not self._fits(s, base, first):  # plan_turn
            self.sent += 1
            self.ahead = (s, -(-(base + first) // BT) * BT - base)
        for new in [first] + [1] * (out - 1):
            self._expect(s, base, new, last)
            base += new
        self.fed[s] = base
        return out

    def _fits(self, s: str, base: int, new: int) -> bool:
        return self.last == s and base + new <= self.room[s]

    def _expect(self, s: str, base: int, new: int, last: int) -> None:
        """A pass of `new` tokens of s after `base`: no step when it fits the room of s's step
        and that step was the last one applied; else a step counting to the end of the
        block, which takes the step planned ahead when it asked the same. A pass that ends
        its room plans the next one ahead (one token, to the end of its block), unless it is
        the turn's last (`last`: max_new_tokens)."""
        end = -(-(base + new) // BT) * BT
        if self._fits(s, base, new):
            self.skipped += 1
        else:
            self.steps += 1
            self.used += self.ahead == (s, end - base)
            self.ahead, self.last, self.room[s] = None, s, end
        if base + new >= self.room[s] and base + new < last:
            self.sent += 1
            self.ahead = (s, -(-(base + new + 1) // BT) * BT - base - new)

    def check(self) -> int:
        """Every session's K/V in the tiers equals DynamicCache's; the controller counts each
        session's length plus its credit. Returns the sessions checked."""
        rt = self.tiers.rt
        self.ahead, self.last = None, None  # each read_kv is a step of no tokens
        for s, ref in self.refs.items():
            self.room[s] = self.fed[s]
            for (k, v), layer in zip(self.tiers.cache(s).read_kv(), ref.layers, strict=True):
                assert torch.equal(k, layer.keys) and torch.equal(v, layer.values), s
        rt.settle_ahead()
        tokens = session_tokens(rt)
        for s in self.refs:
            counted = tokens[s]
            want = self.tiers.cache(s).num_tokens + rt.credits.tokens.get(s, 0)
            assert counted == want, (s, counted, want)
        return len(self.refs)


def attach(model: Any, ssd_root: str | None, controller: str) -> Any:
    import tpkv

    return tpkv.attach(model, tiers_config(model, L1_BLOCKS, L2_BLOCKS, ssd_root),
                       block_tokens=BT, controller=controller, device="cpu")


@pytest.mark.timeout(120)
def test_decode_steps_are_planned_ahead_and_early_stops_stay_exact(tmp_path, transport):
    """Four sessions in turn (each goes down to L2 or L3 between its turns), turns that end
    after 1 or 2 tokens, at an EOS, or run on; one session runs turns back to back."""
    model = tiny_llama()
    with attach(model, str(tmp_path / "l3"), transport) as tiers:
        chat, rt = Chat(model, tiers), tiers.rt
        plan = [("s0", 12, 6, False), ("s1", 14, 1, False), ("s2", 17, 5, True),
                ("s3", 13, 2, False), ("s0", 3, 5, True), ("s0", 4, 1, False),
                ("s1", 5, 6, False), ("s2", 2, 4, False), ("s3", 6, 3, True),
                ("s1", 1, 5, False), ("s0", 2, 2, False), ("s2", 3, 6, False)]
        generated = 0  # = the passes: a turn's first one and one per token after it
        for s, n, max_new, eos in plan:
            out = chat.turn(s, n, max_new, eos)
            assert out == (2 if eos else max_new), (s, out)
            generated += out
        assert {t for _, t in tiers.stats.resumes} >= {"l2", "l3"}, tiers.stats.resumes
        # most passes ran with no step; the steps and those planned ahead are as expected
        assert tiers.stats.passes_without_step == chat.skipped > generated // 2
        assert tiers.stats.steps == chat.steps + tiers.stats.retries
        assert chat.steps + chat.skipped == generated
        assert rt.num_ahead_used == chat.used > 0, (rt.num_ahead_used, chat.used)
        assert chat.check() == 4
        assert rt.num_ahead_unused == chat.sent - chat.used


@pytest.mark.timeout(120)
def test_a_credited_token_that_fills_its_block_stays_exact(tmp_path, transport):
    """A turn ends with its next token, the last of its block, counted by the turn's last step
    (to the block's end) and never fed; the session goes down to L2 and L3 and comes back for a
    turn that starts with that token, then goes down and back again. The controller counted the
    block full while no pass wrote the token: the copies of the block made in between must be
    voided when the token is written (schedule's `rewrite`), or the next resume brings back
    stale K/V."""
    model = tiny_llama()
    with attach(model, str(tmp_path / "l3"), transport) as tiers:
        chat = Chat(model, tiers, seed=1)
        chat.turn("x", 10, 6)  # 15 tokens fed; the unfed 16th fills block 3 (bt 4)
        assert tiers.rt.credits.tokens == {"x": 1}
        assert tiers.cache("x").num_tokens % BT == BT - 1
        for s in ("a", "b", "c"):
            chat.turn(s, 18, 2)
        chat.turn("x", 3, 2)  # back from L2 (and its copies kept), then down again
        for s in ("a", "b", "c"):
            chat.turn(s, 6, 2)
        chat.turn("x", 2, 2)
        assert len(tiers.cache("x").resumed_from) >= 2
        assert chat.check() == 4


@pytest.mark.timeout(120)
def test_a_credited_token_fed_alone_stays_exact(tmp_path, transport):
    """A turn ends with its next two tokens (the 15th and 16th, the rest of its block) counted
    by its last step and never fed. The session goes down to L2 and comes back for a turn that
    feeds only the 15th and generates one (the controller already counts it: the step adds
    nothing), then goes down again while the next token would fill the block, so nothing
    appends to it. The step that feeds the token names it (`rewrite`), so the block's copies
    are voided."""
    model = tiny_llama()
    with attach(model, str(tmp_path / "l3"), transport) as tiers:
        chat = Chat(model, tiers)
        chat.turn("x", 10, 5)  # 14 tokens fed; the 15th and 16th counted
        assert tiers.rt.credits.tokens == {"x": 2}
        for s in ("a", "b", "c"):
            chat.turn(s, 18, 2)
        chat.turn("x", 0, 1)  # feeds the 15th alone
        for s in ("a", "b", "c"):
            chat.turn(s, 6, 2)
        chat.turn("x", 3, 2)
        chat.check()


@pytest.mark.timeout(120)
def test_close_and_reset_with_a_step_planned_ahead(tmp_path, transport):
    """A session closed (or reset) right after its turn, with its next block planned ahead:
    the step is applied first and the session's credit goes with it; the cache starts empty
    and gives a fresh DynamicCache's tokens. Closing another session leaves the guess unused
    and the next turn exact."""
    from transformers import DynamicCache

    model = tiny_llama()
    with attach(model, str(tmp_path / "l3"), transport) as tiers:
        chat, rt = Chat(model, tiers, seed=2), tiers.rt
        # a turn that stops (EOS) after a pass that ends a block leaves the next one planned
        chat.turn("x", 11, 4, eos=True)
        chat.turn("y", 11, 3)
        tiers.close_session("y")
        assert rt.credits.tokens == {"x": BT}  # x's planned block: unused; y's went with it
        chat.refs.pop("y")
        chat.turn("x", 2, 4, eos=True)  # tokens 12..15 fed: the next block is planned ahead
        unused = rt.num_ahead_unused
        tiers.cache("x").reset()  # x's next token was planned: settled, then dropped
        assert rt.num_ahead_unused == unused + 1 and "x" not in rt.credits.tokens
        assert tiers.cache("x").get_seq_length() == 0
        chat.refs["x"] = DynamicCache()
        chat.history.pop("x")
        chat.turn("x", 7, 3)
        chat.turn("x", 2, 2)
        assert chat.check() == 1


@pytest.mark.timeout(120)
def test_a_controller_restart_with_a_step_planned_ahead_stays_exact(tmp_path, transport):
    """The controller restarts (in process: a fresh one; through Ray: the actor killed and
    restarted) while a turn's next block is planned ahead, and again after a session's turn
    left a credit; the runtime rebuilds it from the rank's map, and tokens, K/V and the
    controller's counts stay DynamicCache's and the cache's."""
    from tests.transport import restart

    model = tiny_llama()
    with attach(model, str(tmp_path / "l3"), transport) as tiers:
        chat, rt = Chat(model, tiers, seed=2), tiers.rt
        chat.turn("x", 11, 4, eos=True)  # stops after a pass that ends a block
        assert rt._ahead is not None  # the next one planned ahead when the controller goes
        restart(rt, 1)
        chat.turn("x", 2, 4, eos=True)
        chat.turn("y", 11, 3)
        assert rt.credits.tokens.get("y", 0) > 0
        restart(rt, 2)
        chat.turn("y", 2, 2)
        chat.turn("x", 3, 2)
        assert rt.num_rebuilds == 2
        assert chat.check() == 2
