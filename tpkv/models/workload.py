"""Seeded multi-turn chat workload, closed loop: users think between turns; many sessions."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from tpkv.errors import BadRequestError, ConfigError, UnknownSessionError

Range = tuple[int, int]  # inclusive bounds


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes in tokens, times in seconds; every range is inclusive."""

    num_sessions: int = 32  # sessions over the whole run
    num_users: int = 8  # users at once (closed loop): each runs one session at a time
    turns: Range = (2, 6)  # turns per session (fewer when a session reaches max_session_tokens)
    system_prompt_tokens: int = 512  # shared by every session, at the start of its first turn
    num_documents: int = 8  # long documents shared by all sessions
    doc_tokens: Range = (1024, 4096)
    doc_probability: float = 0.3  # a turn pastes one document
    user_tokens: Range = (16, 128)  # what the user types in a turn
    gen_tokens: Range = (16, 128)  # tokens a turn generates
    think_s: tuple[float, float] = (2.0, 60.0)  # log-uniform pause before each next turn
    ramp_s: float = 10.0  # users start evenly spread over this long
    max_session_tokens: int = 16384
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_users", "system_prompt_tokens", "num_documents",
                     "max_session_tokens", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "system_prompt_tokens" else 1):
                raise ConfigError(f"workload {name} must be a positive integer, got {value!r}")
        for name in ("turns", "doc_tokens", "user_tokens", "gen_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"workload {name} needs 1 <= low <= high, got {low}, {high}")
        if not 0 < self.think_s[0] <= self.think_s[1] or self.ramp_s < 0:
            raise ConfigError(f"workload think_s needs 0 < low <= high and ramp_s >= 0, got "
                              f"{self.think_s}, {self.ramp_s}")
        if not 0.0 <= self.doc_probability <= 1.0:
            raise ConfigError(f"doc_probability must be in [0, 1], got {self.doc_probability}")
        first = self.system_prompt_tokens + self.user_tokens[1] + self.gen_tokens[1]
        if first > self.max_session_tokens:
            raise ConfigError(f"a first turn may need {first} tokens, above "
                              f"max_session_tokens={self.max_session_tokens}")


@dataclass(frozen=True)
class TurnPlan:
    document: int  # index into the shared documents, -1 for none
    user_tokens: int
    gen_tokens: int
    think_s: float  # pause after this turn's answer before the next turn


@dataclass(frozen=True)
class TurnEvent:
    """A user sends a turn at `time_s`: feed `prompt_token_ids` (new tokens only), generate up to
    `max_new_tokens`. After the last turn the session can be closed."""

    time_s: float
    session: str
    turn: int
    prompt_token_ids: np.ndarray  # [n] int64, new tokens of this turn
    max_new_tokens: int
    last_turn: bool


def session_name(index: int) -> str:
    return f"s{index:05d}"


def plan_session(cfg: WorkloadConfig, index: int) -> tuple[TurnPlan, ...]:
    """The turns of session `index`, from its own random stream (independent of timing)."""
    rng = np.random.default_rng([cfg.seed, 1, index])
    budget = cfg.max_session_tokens - cfg.system_prompt_tokens
    turns: list[TurnPlan] = []
    for _ in range(int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))):
        doc = int(rng.integers(cfg.num_documents)) if rng.random() < cfg.doc_probability else -1
        user = int(rng.integers(cfg.user_tokens[0], cfg.user_tokens[1] + 1))
        gen = int(rng.integers(cfg.gen_tokens[0], cfg.gen_tokens[1] + 1))
        think = math.exp(rng.uniform(math.log(cfg.think_s[0]), math.log(cfg.think_s[1])))
        need = user + gen + (document_length(cfg, doc) if doc >= 0 else 0)
        if need > budget:
            if turns:
                break
            doc, need = -1, user + gen  # the first turn always fits without a document
        budget -= need
        turns.append(TurnPlan(doc, user, gen, think))
    return tuple(turns)


def session_tokens(cfg: WorkloadConfig, plan: tuple[TurnPlan, ...]) -> int:
    """Tokens a session holds after its last turn (system prompt, documents, user, answers)."""
    return cfg.system_prompt_tokens + sum(
        t.user_tokens + t.gen_tokens + (document_length(cfg, t.document) if t.document >= 0
                                        else 0) for t in plan)


def document_length(cfg: WorkloadConfig, doc: int) -> int:
    rng = np.random.default_rng([cfg.seed, 2, doc])
    return int(rng.integers(cfg.doc_tokens[0], cfg.doc_tokens[1] + 1))


def _tokens(cfg: WorkloadConfig, stream: list[int], n: int) -> np.ndarray:
    return np.random.default_rng([cfg.seed, *stream]).integers(0, cfg.vocab_size, n,
                                                               dtype=np.int64)


class Workload:
    """Closed loop: `pop_ready(now)` hands out turns that are due; `complete(session, now)` says
    a turn's answer is done, which schedules that user's next turn (or next session) after a
    think time. `simulate(service_s)` runs the loop with a model of the server instead.

    Everything random comes from per-session and per-document streams of `seed`, so the content
    of a session does not depend on timing, and the same completions give the same events.
    """

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.system_prompt = _tokens(cfg, [3], cfg.system_prompt_tokens)
        self._docs: dict[int, np.ndarray] = {}
        self._plans: dict[str, tuple[TurnPlan, ...]] = {}
        self._next_turn: dict[str, int] = {}
        self._user: dict[str, int] = {}
        self._in_flight: set[str] = set()
        self._heap: list[tuple[float, int, str]] = []  # (time, tie-breaker, session)
        self._order = 0
        self._num_started = 0
        for user in range(min(cfg.num_users, cfg.num_sessions)):
            self._start_session(user, cfg.ramp_s * user / cfg.num_users)

    @property
    def done(self) -> bool:
        return not self._heap and not self._in_flight

    def next_time_s(self) -> float | None:
        """When the next turn is due (None: nothing pending; in-flight turns may add some)."""
        return self._heap[0][0] if self._heap else None

    def plan(self, session: str) -> tuple[TurnPlan, ...]:
        return self._plans[session]

    def planned_tokens(self, session: str) -> int:
        """Tokens the session holds after its last turn (prompts and answers)."""
        return session_tokens(self.cfg, self._plans[session])

    def pop_ready(self, now_s: float) -> list[TurnEvent]:
        """Every turn due at or before `now_s`, in time order."""
        out = []
        while self._heap and self._heap[0][0] <= now_s:
            time_s, _, session = heapq.heappop(self._heap)
            out.append(self._event(time_s, session))
        return out

    def complete(self, session: str, now_s: float) -> None:
        """The answer to `session`'s current turn finished at `now_s`."""
        if session not in self._in_flight:
            raise UnknownSessionError(f"session {session!r} has no turn in flight")
        self._in_flight.remove(session)
        plan, turn = self._plans[session], self._next_turn[session]
        pause = plan[turn - 1].think_s
        if turn < len(plan):
            self._push(now_s + pause, session)
        elif self._num_started < self.cfg.num_sessions:
            self._start_session(self._user[session], now_s + pause)

    def simulate(self, service_s: Callable[[TurnEvent], float]) -> Iterator[TurnEvent]:
        """Yield every event of the run; a turn's answer takes service_s(event) seconds."""
        finishing: list[tuple[float, int, str]] = []
        while not self.done:
            t_next = self.next_time_s()
            if finishing and (t_next is None or finishing[0][0] < t_next):
                t_done, _, session = heapq.heappop(finishing)
                self.complete(session, t_done)
                continue
            if t_next is None:
                raise BadRequestError("workload stalled: turns in flight, none finishing")
            for event in self.pop_ready(t_next):
                self._order += 1
                heapq.heappush(finishing, (event.time_s + service_s(event), self._order,
                                           event.session))
                yield event

    def _start_session(self, user: int, time_s: float) -> None:
        index, self._num_started = self._num_started, self._num_started + 1
        name = session_name(index)
        self._plans[name] = plan_session(self.cfg, index)
        self._next_turn[name], self._user[name] = 0, user
        self._push(time_s, name)

    def _push(self, time_s: float, session: str) -> None:
        self._order += 1
        heapq.heappush(self._heap, (time_s, self._order, session))

    def _event(self, time_s: float, session: str) -> TurnEvent:
        turn = self._next_turn[session]
        plan = self._plans[session][turn]
        index = int(session[1:])
        parts = [self.system_prompt] if turn == 0 else []
        if plan.document >= 0:
            parts.append(self._document(plan.document))
        parts.append(_tokens(self.cfg, [4, index, turn], plan.user_tokens))
        self._next_turn[session] = turn + 1
        self._in_flight.add(session)
        return TurnEvent(time_s, session, turn, np.concatenate(parts), plan.gen_tokens,
                         turn + 1 == len(self._plans[session]))

    def _document(self, doc: int) -> np.ndarray:
        if doc not in self._docs:
            self._docs[doc] = _tokens(self.cfg, [5, doc], document_length(self.cfg, doc))
        return self._docs[doc]
