"""SpillPacer: how far ahead of need L2 spills to L3, from the ranks' reports of spills written."""

from __future__ import annotations

import math
import time
from collections import deque

from tpkv.config import PolicyConfig
from tpkv.controller.slotstack import SlotStack

_EMA = 0.25  # weight of a new sample in the moving averages
_RECENT_STEPS = 32  # a step's L2 intake is planned for as the largest of this many


class SpillPacer:
    """What the controller knows of the ranks' spills (background L2 -> L3 writes): the L2
    slots they may still read lie in the L2 SlotStack as cooling slots (handed out last),
    until a confirmation reports them written (MoveResult.spills_written_below); from those
    reports, the disk's write rate and the steps a spill takes until reported; and the L2
    intake (demotions, L3 reads) of recent steps.

    From them, ahead(): how many blocks a step spills beyond its need, so that by the time
    the next steps copy into L2 their slots are clean (no spill reads them, so no copy waits
    for the disk): L2 keeps free the largest recent intake times (1 + the steps a spill
    takes), as long as the spills in flight stay within what the disk writes in
    `spill_queue_s` (PolicyConfig) at its measured rate. Off (`enabled` False): spilled slots
    are freed like others and nothing is spilled ahead."""

    def __init__(self, policy: PolicyConfig | None = None, block_bytes: int = 1) -> None:
        p = policy or PolicyConfig(spill_pacing=False)
        self.enabled = p.spill_pacing
        self.block_bytes = max(int(block_bytes), 1)
        self.queue_s = p.spill_queue_s
        self.rate = float(p.ssd_write_bytes_per_s)  # bytes/s per rank; measured from reports
        self.samples = 0
        self.lag = 1.0  # steps from a spill's plan until a confirmation reports it written
        self.step = 0  # steps planned
        self.recent: deque[int] = deque(maxlen=_RECENT_STEPS)  # L2 intake of recent steps
        self._last_ns = 0  # when a report last marked spills written (monotonic)

    def stamp(self) -> tuple[int, int]:
        """(step, monotonic ns) a spill is made at, for SlotStack.push_cooling."""
        return self.step, time.monotonic_ns()

    def written(self, stack: SlotStack, below: int) -> None:
        """A confirmation: every rank's spills of plans before `below` are written (0: no
        report). Their slots are clean; the disk's rate and the spills' lag are sampled."""
        if not self.enabled or below <= 0:
            return
        done = stack.cooled_below(below)
        if not done:
            return
        now = time.monotonic_ns()
        lag = sum(self.step - d[3] for d in done) / len(done)
        self.lag = (1 - _EMA) * self.lag + _EMA * lag
        start = max(self._last_ns, min(d[4] for d in done))
        self._last_ns = now
        if now <= start:
            return
        sample = sum(d[2] for d in done) * self.block_bytes / ((now - start) / 1e9)
        # The disk was busy all along only while spills remain: else the sample counts idle
        # time, and only one above the estimate is taken
        if stack.cooling or sample > self.rate:
            self.samples += 1
            self.rate = sample if self.samples == 1 else (1 - _EMA) * self.rate + _EMA * sample

    def stepped(self, intake: int) -> None:
        """A step was planned that copies `intake` blocks into L2."""
        self.step += 1
        self.recent.append(intake)

    def ahead(self, stack: SlotStack, free: int, intake: int, short: int) -> int:
        """Blocks to spill in this step beyond `short` (those its `intake` needs, `free` free
        L2 slots now, kept copies among them)."""
        if not self.enabled:
            return 0
        peak = max(self.recent, default=0)
        mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
        # clean by the next step's copies: the largest intake; and as many again as the
        # steps a spill takes will copy in on average, cooling meanwhile
        want = max(peak, intake) + math.ceil(mean * self.lag)
        room = int(self.rate * self.queue_s / self.block_bytes) - stack.in_flight() - short
        return max(0, min(want - (free - intake + short), room))

    def as_dict(self) -> dict[str, float | int]:
        return {"enabled": int(self.enabled), "write_bytes_per_s": self.rate,
                "samples": self.samples, "lag_steps": self.lag,
                "peak_intake": max(self.recent, default=0)}
