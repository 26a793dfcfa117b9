"""Which saved keys a merged step report does not show every rank holding."""

from __future__ import annotations

import logging

from tpkv.integrations.vllm.plan import StepReport

log = logging.getLogger(__name__)


def unconfirmed_saves(report: StepReport, num_ranks: int) -> set[bytes]:
    """The keys `report` names as saved when it lacks the report of one of the ranks
    0..num_ranks-1: every rank gets the same saves, so a rank that has something to say about
    a step's saves always reports, and a key one rank saved is held by every rank only when
    all reports are in. Empty when they are (or nothing was saved)."""
    if not report.saved:
        return set()
    missing = sorted(set(range(num_ranks)) - report.ranks)
    if not missing:
        return set()
    log.warning("tpkv vLLM connector: a step's report lacks ranks %s of %d; its %d saved "
                "blocks are forgotten and dropped (a later prompt recomputes them)",
                missing, num_ranks, len(report.saved))
    return set(report.saved)
