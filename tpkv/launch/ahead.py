"""Steps planned ahead: rank 0 sends step N+1's schedule while step N's forward runs.

The engine names the batch it expects next (PagedEngine.predict_next) once a forward is
launched; rank 0 sends that schedule at once and reads its answer at the next begin_step. When
the batch then asked for is the one expected (same sessions, same token counts), the answer is
the step: no controller round trip waits before the forward. When it is not (a turn arrived, a
session was closed), the step planned ahead is still applied on every rank, as a step whose
forward never ran, and the real one is scheduled then.

Tokens such a step added at the controller but the engine never fed stay as a credit of their
session here (`Credits`): the next schedule of that session asks for that many fewer, so the
controller's count is always the engine's after the step that feeds them, and names them as
`rewrite`: the L2/L3 copies of their blocks made in between (a demotion into a kept copy, a
spill) lack their K/V, and the controller voids them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.launch.link import Reply


class Credits:
    """Per session: tokens the controller counts that no step has fed yet (rank 0 only)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def ask(self, session_ids: Sequence[str], num_new_tokens: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """For a step that feeds num_new_tokens[i] tokens of session i: the counts to send
        (less what each holds already) and schedule's `rewrite` (the credit of each session
        it feeds, whose tokens come first in what it writes: the controller counted them
        already, so the L2/L3 copies of their blocks made since lack their K/V; None when
        there is none)."""
        if not self.tokens:
            return num_new_tokens, None
        held = np.asarray([self.tokens.get(s, 0) for s in session_ids], dtype=np.int64)
        # (a negative count goes as it is: the controller refuses it, naming the session)
        sent = np.where(num_new_tokens < 0, num_new_tokens,
                        np.maximum(num_new_tokens - held, 0))
        held[num_new_tokens <= 0] = 0
        return sent, held if held.any() else None

    def fed(self, session_ids: Sequence[str], num_new_tokens: np.ndarray,
            sent: np.ndarray) -> None:
        """A step that asked for `sent` ran, feeding num_new_tokens."""
        if not self.tokens:
            return
        for s, n, k in zip(session_ids, num_new_tokens.tolist(), sent.tolist()):
            left = self.tokens.get(s, 0) + k - n
            if left > 0:
                self.tokens[s] = left
            else:
                self.tokens.pop(s, None)

    def unfed(self, session_ids: Sequence[str], sent: np.ndarray) -> None:
        """A step that asked for `sent` was applied without its forward."""
        for s, k in zip(session_ids, sent.tolist()):
            if k:
                self.tokens[s] = self.tokens.get(s, 0) + k

    def drop(self, session_id: str) -> None:
        self.tokens.pop(session_id, None)


@dataclass
class Ahead:
    """A schedule sent ahead of its step (rank 0): the batch it expects and its reply."""

    session_ids: tuple[str, ...]
    num_new_tokens: np.ndarray  # what the engine will feed
    sent: np.ndarray  # what the controller was asked for (less credits)
    reply: Reply

    def matches(self, session_ids: Sequence[str], num_new_tokens: np.ndarray) -> bool:
        return (tuple(session_ids) == self.session_ids
                and np.array_equal(num_new_tokens, self.num_new_tokens))


def as_upcoming(upcoming: Mapping[str, int] | Sequence[str] | None) -> Any:
    """A copy of an `upcoming` hint (the caller may change its own before the call is sent)."""
    if upcoming is None:
        return None
    return dict(upcoming) if isinstance(upcoming, Mapping) else list(upcoming)
