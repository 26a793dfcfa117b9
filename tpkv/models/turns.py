"""What the paged engine's step loop passes around: a session's tokens (Seq), one forward's
output, the report after each step, a finished turn, and the hooks' signatures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from torch import Tensor

from tpkv.models.scheduler import StepTables


@dataclass(eq=False)
class Seq:
    """One session: every token so far; the first `num_cached` have K/V in the cache."""

    session: str
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    max_new_tokens: int = 0  # of the current turn
    generated: list[int] = field(default_factory=list)  # tokens of the current turn

    @property
    def num_uncached(self) -> int:
        return len(self.token_ids) - self.num_cached


@dataclass(frozen=True)
class StepOutput:
    """One forward: the greedy token, its logits and the attention mass of every session."""

    session_ids: tuple[str, ...]
    tokens: tuple[int, ...]  # [B]
    logits: Tensor  # [B, vocab] float32
    block_mass: tuple[np.ndarray, ...]  # B arrays [blocks of the session], float32; empty: none


@dataclass(frozen=True)
class StepReport:
    """What `report` gets after every step (the controller adapter turns it into its calls)."""

    tick: int
    kind: Literal["prefill", "decode"]
    tables: StepTables  # as `schedule` returned them
    num_new_tokens: tuple[int, ...]  # [B] tokens whose K/V this step wrote (recomputed too)
    output: StepOutput
    forward_s: float  # wall time of forward + sample (includes the device sync of sampling)


@dataclass(frozen=True)
class Finished:
    """A turn that is done: the tokens it generated. The session stays cached for its next turn."""

    session: str
    token_ids: tuple[int, ...]


ScheduleFn = Callable[[Sequence[str], Sequence[int]], StepTables]
WaitFn = Callable[[StepTables], None]
ReportFn = Callable[[StepReport], None]
ReleaseFn = Callable[[str], object]
# admit(arrived, returning, idle): of the turns added since the last step (arrived) and those
# waiting outside the batch (returning), the sessions whose turns may queue for the batch now;
# `idle`: nothing else would run this step (the hook may wait for one to be ready); `room()`
# says how many the batch has places for.
AdmitFn = Callable[[Sequence[str], Sequence[str], bool], Sequence[str]]
