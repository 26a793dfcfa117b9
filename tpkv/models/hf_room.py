"""StepRoom: the tokens a TpkvCache's last step counted ahead, and the steps it plans ahead."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tpkv.launch.runtime import TpkvRuntime


class StepRoom:
    """A step of a TpkvCache counts its pass's tokens up to the end of the block the pass ends
    in (`ask`); what the pass does not feed is lent to the session as a credit (rt.credits,
    rank 0), which later passes feed. A pass that fits that room (`fits`) while the worker's
    tick and epoch are what that step left (no other step applied since: every block of the
    session is where it put them, and no copy of them was made) runs with no step. The step
    of the pass after a block's last token is planned ahead (`plan_next`), and HfTiers.generate
    plans a turn's first (`TpkvCache.plan_turn`); none past the turn's last pass (`turn_end`,
    the tokens fed once it is), so a turn that runs to max_new_tokens leaves none unused."""

    def __init__(self, rt: TpkvRuntime, session_id: str, block_tokens: int) -> None:
        self.rt, self.session_id, self.block_tokens = rt, session_id, block_tokens
        self.room = 0  # tokens the last step's blocks hold room for (counted at the controller)
        self.applied: tuple[int, int] | None = None  # the worker's (tick, epoch) after it
        self.turn_end: int | None = None

    def fits(self, base: int, new: int) -> bool:
        """A pass of `new` tokens after `base` runs with no step."""
        w = self.rt.worker
        return bool(new) and base + new <= self.room and self.applied == (w.tick, w.epoch)

    def ask(self, base: int, new: int, asked: int) -> int:
        """What the step of such a pass asks the controller for: its tokens up to the end of
        the block it ends in, less the `asked` before (a pass of no tokens: none)."""
        if not new:
            return max(0, base - asked)
        bt = self.block_tokens
        return max(0, -(-(base + new) // bt) * bt - asked)

    def took(self, room: int) -> None:
        """A step was applied that counts `room` tokens of the session."""
        self.room, self.applied = room, (self.rt.worker.tick, self.rt.worker.epoch)

    def forget(self) -> None:
        self.room, self.applied = 0, None

    def credit(self, tokens: int) -> None:
        """Rank 0: `tokens` (> 0) the controller counts that a pass does not feed become a
        credit of the session; `-tokens` of its credit fed by a pass with no step (nothing
        was copied since the step that counted them, so no copy of their block is stale)."""
        if not tokens or self.rt.rank != 0:
            return
        ids, n = [self.session_id], np.asarray([abs(tokens)], dtype=np.int64)
        if tokens > 0:
            self.rt.credits.unfed(ids, n)
        else:
            self.rt.credits.fed(ids, n, np.zeros(1, dtype=np.int64))

    def plan_next(self, at: int, asked: int) -> None:
        """After a pass that fed tokens up to `at`: if the pass generate most likely makes next
        (one token at `at`) needs a step and comes in this turn, send its schedule now, while
        this pass runs (TpkvRuntime.schedule_ahead): that pass then needs no controller round
        trip. A wrong guess (the turn ended, another session's pass or any other call came
        first) is applied without a forward and its tokens become a credit of the session;
        the step that feeds them names them to the controller, which voids the L2/L3 copies
        of their block made in between (launch/ahead.py)."""
        if at >= self.room and (self.turn_end is None or at < self.turn_end):
            self.rt.schedule_ahead([self.session_id], [self.ask(at, 1, asked)])
