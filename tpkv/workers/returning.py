"""ReturningReads: a rank's reads ahead of returning sessions' L3 blocks, and when they count."""

from __future__ import annotations

import numpy as np

from tpkv.protocol.plan import MovePlan, Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers.mirror import SlotMirror
from tpkv.workers.reads import plan_sessions
from tpkv.workers.spills import SpillTracker


class ReturningReads:
    """The blocks this rank's map places on L3 for a returning session, read ahead into the
    store's memory (SsdStore.read_ahead) while its turn waits outside the batch, for the step
    that loads them. A read ahead counts as done only while no spill of the session runs (a
    load would wait for that write, and its manifest, on a disk that may be seconds behind),
    and goes back to the budget once a plan has brought up the session's last L3 block here.
    Without L3 every session reads as having nothing there."""

    def __init__(self, store: SsdStore | None, mirror: SlotMirror, spills: SpillTracker) -> None:
        self.store, self.mirror, self.spills = store, mirror, spills

    def start(self, session: str) -> str:
        """Start reading the session's L3 blocks here into memory. Returns "none" (no block on
        L3, or no L3), "started", "full" (they do not fit the read-ahead budget now),
        "too_big" (they never will), "held" (read or being read ahead already: nothing
        started) or "busy" (a spill of the session is not finished: its records are not all
        readable yet)."""
        logical = self._on_l3(session)
        if self.store is None or not len(logical):
            return "none"
        if self.store.ahead.done(session) is not None:
            return "held"
        if self.spills.busy(session):
            return "busy"
        if not self.store.ahead.holds(len(logical)):
            return "too_big"
        return "started" if self.store.read_ahead(session, logical) else "full"

    def needed(self, session: str) -> bool:
        """Whether start() would read anything of the session: it has blocks on L3 here, and
        they fit the read-ahead budget when it is empty."""
        n = self.on_l3(session)
        return self.store is not None and 0 < n and self.store.ahead.holds(n)

    def on_l3(self, session: str) -> int:
        """How many of the session's blocks this rank's map places on L3 (0 without L3)."""
        return len(self._on_l3(session))

    def _on_l3(self, session: str) -> np.ndarray:
        if self.store is None:
            return np.zeros(0, dtype=np.int64)
        return self.mirror.session_logical(session, int(Tier.SSD))

    def done(self, session: str) -> bool:
        """Whether this rank holds the session's read ahead, done, of every block its map
        places on L3 now, and no spill of the session runs (the spill's end discards the
        read ahead anyway: ReadAhead.changed, and the turn is read ahead again). Blocks that
        came to L3 since the read ahead began without a write (their records were on disk
        since an earlier load) are read ahead now, as the budget allows; until they are in,
        it is not done (those the budget leaves out the step reads from the disk)."""
        if (self.store is None or not self.store.ahead.done(session)
                or self.spills.busy(session)):
            return False
        logical = self._on_l3(session)
        if self.store.ahead.covers(session, logical):
            return True
        self.store.read_ahead(session, logical)  # the rest, as the budget allows
        return bool(self.store.ahead.done(session))

    def drop(self, session: str) -> None:
        """Give back what was read ahead of the session (its load is planned, or it closed)."""
        if self.store is not None:
            self.store.ahead.drop(session)

    def staged(self, plan: MovePlan) -> None:
        """`plan` was applied here: give back the read ahead of each session whose last L3
        block it brought up (a turn in line staged before it runs), so that the budget takes
        the next returning turn's read ahead sooner."""
        if self.store is None or not self.store.ahead.held_bytes:
            return
        reads = plan.mask(Tier.SSD, Tier.DRAM)
        if reads.any():
            for name in plan_sessions(plan, reads):
                if not self.on_l3(name):
                    self.store.ahead.drop(name)
