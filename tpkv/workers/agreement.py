"""SpillLedger: which sessions' L3 spills the TP group agrees are settled, and which it forgets."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.confirm import encode_names


class SpillLedger:
    """One rank's view of the spill outcomes the TP group has agreed on (TP > 1).

    A session's L3 data is usable only if every rank wrote and committed it: a rank whose
    spill or manifest write failed (a full disk) forgets the session's records, and the
    others must forget theirs too, or their loads would wait for a manifest that can never
    complete. Each rank reports the sessions it forgot, and the epoch below which its own
    spills are all finished, in its next confirmation (PendingConfirm.report); every rank
    then forgets the union and takes the lowest mark as settled. A plan that loads a
    session whose latest spill is not settled yet agrees first, at once (the same report
    through the confirmation thread), after every rank has finished its spills of it.

    Everything here that decides whether a collective runs follows the plans and the
    gathered reports only, which are the same on every rank, so every rank makes the same
    collectives in the same order.
    """

    def __init__(self) -> None:
        self.forgotten: list[str] = []  # forgotten here, not yet reported
        self.reported: set[str] = set()  # reported, not yet agreed
        # session -> epoch of its latest spill not yet settled on every rank
        self.unsettled: dict[str, int] = {}
        self.settled_below = 0  # every rank's spills of epochs below this are finished
        self.num_agreements = 0  # agreements before a load (not with a confirmation)
        self.num_forgotten_elsewhere = 0  # sessions forgotten here on another rank's report

    def spilled(self, plan: MovePlan) -> None:
        """Note the sessions `plan` spills (every L2 -> L3 move, applied here or not)."""
        idx = np.flatnonzero(plan.mask(Tier.DRAM, Tier.SSD))
        for s in set(plan.session_idx[idx].tolist()):
            self.unsettled[plan.session_names[s]] = plan.epoch

    def forgot(self, name: str) -> None:
        """This rank deleted the session's L3 records after a failed spill or manifest write."""
        if name not in self.forgotten:
            self.forgotten.append(name)

    def needs_agreement(self, names: Iterable[str]) -> bool:
        """Whether a load of these sessions must agree first (a spill of one not settled)."""
        return any(name in self.unsettled for name in names)

    def report(self, finished_below: int) -> tuple[bytes, int]:
        """This rank's report for the next collective: the sessions it forgot since its last
        report, and `finished_below` (the epoch below which its spills are all finished,
        their failures among those reported now or before)."""
        names, self.forgotten = self.forgotten, []
        self.reported.update(names)
        return encode_names(names), finished_below

    def agreed(self, forgotten: frozenset[str], settled_below: int,
               loaded: Iterable[str] = ()) -> list[str]:
        """Take what every rank agreed on; returns the sessions to forget here (all of
        `forgotten`, those this rank forgot too: it may have spilled them again since).
        `loaded`: sessions every rank finished its spills of before this agreement."""
        self.settled_below = max(self.settled_below, settled_below)
        done = set(forgotten) | set(loaded)
        self.unsettled = {name: epoch for name, epoch in self.unsettled.items()
                          if epoch >= self.settled_below and name not in done}
        self.num_forgotten_elsewhere += len(forgotten - self.reported)
        self.reported -= forgotten
        return sorted(forgotten)

    def closed(self, names: Iterable[str]) -> None:
        """Sessions whose L3 records every rank deletes (closed or dropped by the controller)."""
        for name in names:
            self.unsettled.pop(name, None)
