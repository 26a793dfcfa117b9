"""Rank 0's commits and reports on their way to the controller, and what their answers say."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tpkv.errors import ControllerError, ControllerRecoveringError, TpkvError
from tpkv.launch.link import Reply
from tpkv.protocol.plan import MoveResult

log = logging.getLogger(__name__)


class SentCalls:
    """Commits and reports sent without waiting (through the link's `post`). Their answers come
    in the order sent, so a look stops at the first not yet in (through Ray each look at a
    reply is a call into Ray). A commit the controller refused after the ranks agreed (a bug
    somewhere) sets `refused`: the runtime resyncs every rank at its next step."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.commits: list[Reply] = []
        self.reports: list[tuple[str, Reply]] = []
        self.refused = False
        self.num_refusals = 0  # epochs the controller refused after agreement

    def commit(self, link: Any, results: Sequence[MoveResult]) -> None:
        self.commits.append(link.post("commit", results))

    def report(self, link: Any, method: str, *args: Any, **kwargs: Any) -> None:
        """A call whose loss costs nothing but accuracy (attention mass, prefill speed)."""
        self.reports.append((method, link.post(method, *args, **kwargs)))

    def check(self, wait: bool = False) -> None:
        """Read the answers that are in (every commit's when `wait`)."""
        self._check_reports()
        keep: list[Reply] = []
        for reply in self.commits:
            if keep or not (wait or reply.done()):
                keep.append(reply)
                continue
            try:
                outcome = reply.result(timeout=self.timeout_s)
            except ControllerRecoveringError:  # the next scheduling call rebuilds it
                log.warning("controller restarted before a commit reached it")
                continue
            except ControllerError as exc:  # not committed: the runtime resyncs every rank
                log.error("controller failed a commit (%s); resyncing", exc)
                self.refused = True
                self.num_refusals += 1
                continue
            if not outcome.committed:
                log.error("controller refused epoch %d (ranks %s) after the all-gather "
                          "agreed; resyncing", outcome.epoch, outcome.mismatch_ranks)
                self.refused = True
                self.num_refusals += 1
        self.commits = keep

    def take_refusal(self) -> bool:
        """Whether a commit was refused since the last call (after waiting for all)."""
        self.check()
        if not self.refused:
            return False
        self.check(wait=True)
        self.refused = False
        return True

    def forget(self) -> None:
        """The controller they went to is gone (it restarted)."""
        self.commits, self.refused = [], False

    def _check_reports(self) -> None:
        while self.reports and self.reports[0][1].done():
            method, reply = self.reports.pop(0)
            try:
                reply.result()
            except ControllerRecoveringError:
                log.warning("controller restarting: %s report dropped", method)
            except TpkvError as exc:
                log.warning("controller refused a %s report: %s", method, exc)
