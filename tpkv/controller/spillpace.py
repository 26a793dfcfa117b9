"""SpillPacer: how far ahead of need L2 spills to L3, from the ranks' reports of spills written."""

from __future__ import annotations

import math
from collections import deque

from tpkv.config import PolicyConfig
from tpkv.controller.slotstack import SlotStack

_EMA = 0.25  # weight of a new sample in the moving averages
_RECENT_STEPS = 32  # a step's L2 intake is planned for as the largest of this many


class SpillPacer:
    """What the controller knows of the ranks' spills (background L2 -> L3 writes): the L2
    slots they may still read lie in the L2 SlotStack as cooling slots (handed out last),
    until a confirmation reports them written (MoveResult.spills_written_below); from those
    reports, the disk's write rate as the ranks' spills measure it (spill_write_bytes_per_s)
    and the steps a spill takes until reported; and the L2 intake (demotions, L3 reads) of
    recent steps.

    From them, ahead(): how many blocks a step spills beyond its need, so that by the time
    the next steps copy into L2 their slots are clean (no spill reads them, so no copy waits
    for the disk): L2 keeps free the largest recent intake plus the mean intake over the
    steps a spill takes, as long as the spills in flight stay within what the disk writes in
    `spill_queue_s` (PolicyConfig) at its measured rate, or the largest recent intake (room()).
    A watermark's drain spills within the same room, so the writes queued before a copy into
    L2 never outgrow it. Off (`enabled` False): spilled slots are freed like others
    (PlanBuilder) and nothing is spilled ahead."""

    def __init__(self, policy: PolicyConfig | None = None, block_bytes: int = 1,
                 l3: bool = True) -> None:
        p = policy or PolicyConfig(spill_pacing=False)
        self.enabled = p.spill_pacing
        # whether a step may leave L2 blocks unwritten when the disk is behind (with L3 and
        # spill="cost": planner._unwritten_room)
        self.may_leave = self.enabled and l3 and p.spill == "cost"
        self.block_bytes = max(int(block_bytes), 1)
        self.queue_s = p.spill_queue_s
        self.rate = float(p.ssd_write_bytes_per_s)  # bytes/s per rank; measured by the ranks
        self.samples = 0  # confirmations that carried a measured rate
        self.lag = 1.0  # steps from a spill's plan until a confirmation reports it written
        self.step = 0  # steps planned
        self.recent: deque[int] = deque(maxlen=_RECENT_STEPS)  # L2 intake of recent steps
        self.pressed = -_RECENT_STEPS - 1  # the last step L2 had to spill (need, watermark)

    def written(self, stack: SlotStack, below: int, rate: int = 0) -> None:
        """A confirmation: every rank's spills of plans before `below` are written (0: not
        reported), and the disk writes `rate` bytes/s as the slowest rank's spills measure it
        (0: not measured). Those spills' slots are clean; their lag in steps is sampled."""
        if not self.enabled:
            return
        if rate > 0:
            self.rate = float(rate)
            self.samples += 1
        done = stack.cooled_below(below) if below > 0 else []
        if done:
            # (a decaying maximum: planned for, a spill slower than the average costs a wait)
            self.lag = max(float(max(self.step - d[3] for d in done)), (1 - _EMA) * self.lag)

    def stepped(self, intake: int) -> None:
        """A step was planned that copies `intake` blocks into L2."""
        self.step += 1
        self.recent.append(intake)

    def ahead(self, stack: SlotStack, free: int, intake: int, short: int, pressed: bool) -> int:
        """Blocks to spill in this step beyond `short` (those its `intake` needs, `free` free
        L2 slots now, kept copies among them). `pressed`: L2 spills in this step anyway (at
        need or past its high watermark), or blocks live in L3. Nothing is spilled ahead
        unless L2 was pressed within the last _RECENT_STEPS steps: an L2 that holds what it
        gets needs no pacing (so the first overflow of an L2 is not paced: its spills at need
        may still hold a copy into their slots)."""
        if not self.enabled:
            return 0
        if pressed:
            self.pressed = self.step
        if self.step - self.pressed > _RECENT_STEPS:
            return 0
        peak = max(self.recent, default=0)
        mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
        # clean by the next step's copies: the largest intake; and as many again as the
        # steps a spill takes will copy in on average, cooling meanwhile
        want = max(peak, intake) + math.ceil(mean * self.lag)
        return max(0, min(want - (free - intake + short), self.room(stack, short)))

    def room(self, stack: SlotStack, short: int) -> int:
        """Blocks a step may spill beyond its need (`short`, spilled whatever the queue):
        spills in flight stay within what the disk writes in `spill_queue_s`, or the largest
        recent intake if that is more (else a demotion larger than the queue never finds its
        slots clean); a large number when pacing is off."""
        if not self.enabled:
            return 1 << 62
        cap = max(self._queue_blocks(), max(self.recent, default=0))
        return max(0, cap - stack.in_flight() - short)

    def would_hold(self, stack: SlotStack, blocks: int) -> bool:
        """Copies into L2 that find no clean slot for `blocks` blocks would wait longer than
        `spill_queue_s` for the disk: the spills in flight and those blocks' own, at the
        measured rate (False when pacing is off)."""
        if not self.enabled or blocks <= 0:
            return False
        return (stack.in_flight() + blocks) * self.block_bytes > self.rate * self.queue_s

    def intake_room(self, stack: SlotStack, kept: int) -> int:
        """Blocks the next step may copy into L2 before any is left unwritten for want of a
        clean slot (planner._unwritten_room): the clean slots, the kept copies (given back
        without a write), and the spills the queue still takes at the measured rate. -1 when
        nothing is ever left unwritten (no L3, spill="always", pacing off)."""
        if not self.may_leave:
            return -1
        return stack.clean + kept + max(0, self._queue_blocks() - stack.in_flight())

    def _queue_blocks(self) -> int:
        """Blocks the disk writes in `spill_queue_s` at the measured rate."""
        return int(self.rate * self.queue_s / self.block_bytes)

    def as_dict(self) -> dict[str, float | int]:
        return {"enabled": int(self.enabled), "write_bytes_per_s": self.rate,
                "samples": self.samples, "lag_steps": self.lag,
                "peak_intake": max(self.recent, default=0)}
