"""PlanRest: what is left of a plan's run once its L3 reads are submitted (PlanExecutor)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpkv.protocol.plan import MovePlan
from tpkv.workers.outcome import ExecOutcome
from tpkv.workers.reads import ReadJobs

log = logging.getLogger(__name__)


@dataclass
class PlanRest:
    """A plan whose L3 reads run on the store's threads: `finish()` waits for them, does the
    rest of its run (`end`: the spills, after the reads) and returns its outcome."""

    plan: MovePlan
    jobs: ReadJobs
    deadline: float
    end: Callable[[], ExecOutcome]
    later: bool = False  # run_reads_later: the time is not the plan's (ExecOutcome.unmeasured)

    def finish(self) -> ExecOutcome:
        out = self.end()
        out.unmeasured = self.later
        return out

    def settle(self) -> None:
        """Wait (bounded) for its L3 reads and nothing else: what writes into L2 is done."""
        for _, job in self.jobs:
            try:
                job.exception(timeout=max(0.0, self.deadline - time.monotonic()))
            except Exception as exc:  # a timeout: the store's close waits for its threads
                log.warning("plan %d: an L3 read left at close: %s", self.plan.epoch, exc)
