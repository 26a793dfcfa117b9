"""TpkvRuntime's recovery: a restarted controller rebuilt from the ranks, and resyncs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from tpkv.errors import ControllerRecoveringError
from tpkv.launch import recover
from tpkv.launch.ahead import Ahead
from tpkv.launch.bootstrap import RankContext
from tpkv.launch.sent import SentCalls
from tpkv.protocol.plan import MoveResult
from tpkv.protocol.wire import decode, encode
from tpkv.workers.applied import AppliedStep
from tpkv.workers.worker import Worker

T = TypeVar("T")


class _Runtime(Protocol):
    """What the recovery calls use of TpkvRuntime."""

    worker: Worker
    ctx: RankContext
    world_size: int
    sent: SentCalls
    closing: set[str]
    pins: dict[str, list[tuple[int, int]]]
    opened: set[str]
    num_rebuilds: int
    _applied: AppliedStep | None
    _ahead: Ahead | None
    _l2_told: int

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def _check_commits(self, wait: bool = False) -> None: ...

    def from_rank0(self, fn: Callable[[], Any], what: str) -> Any: ...

    def rebuild_controller(self) -> dict[str, Any]: ...

    def _resync(self, slot_map: dict[str, Any]) -> np.ndarray: ...


class Recovery:
    """Rebuilding a restarted controller from every rank's map, and resyncing the ranks to the
    controller's (TpkvRuntime's; each is a collective)."""

    _ahead: Ahead | None  # (TpkvRuntime's: the schedule sent ahead, rank 0)

    def _recovering(self: _Runtime, fn: Callable[[], T]) -> T:
        """fn() on every rank; if the controller answers that it restarted, rebuild it from the
        ranks (a collective: the answer reached every rank) and run fn() once more."""
        try:
            return fn()
        except ControllerRecoveringError:
            self.rebuild_controller()
            return fn()

    def rebuild_controller(self: _Runtime) -> dict[str, Any]:
        """A collective: rebuild the restarted controller from the ranks (recover.py), then
        restore this rank from its map. Returns the rebuild summary. A step not yet confirmed
        (plans applied once its forward was launched) is confirmed among the ranks first and
        never committed: its moves are in the maps the controller is rebuilt from."""
        if self._applied is not None:
            applied, self._applied = self._applied, None
            self.worker.finish(applied)  # (a disagreement: the rebuild resyncs every rank)
        what = "slot maps for a controller rebuild"
        gather = (lambda b: self.ctx.ctl.gather_bytes(b, what)) if self.world_size > 1 \
            else (lambda b: [b])
        summary = recover.rebuild_controller(self.worker, gather, self.from_rank0, self._call,
                                             self.closing, self.pins, self.opened)
        # commits still in flight, and a step sent ahead, were for the lost controller
        self.sent.forget()
        self._ahead = None
        self._resync(self.from_rank0(lambda: dict(self._call("resync")),
                                     "resync after a controller rebuild"))
        self.num_rebuilds += 1
        self._l2_told = -1  # the rebuilt controller hears again how much of L2 is pinned
        return summary

    def _resync(self: _Runtime, slot_map: dict[str, Any]) -> np.ndarray:
        """Every rank restores the controller's map; blocks any rank holds no copy of are
        marked lost at the controller (recomputed, never read as that rank's zeros). Returns
        the ids this rank lost. A collective: every rank calls it at the same point."""
        lost = np.asarray(self.worker.resync(slot_map), dtype=np.int64)
        every = lost
        if self.world_size > 1:
            blobs = self.ctx.ctl.gather_bytes(encode(lost), "blocks lost in a resync")
            every = np.unique(np.concatenate(
                [np.asarray(decode(b), dtype=np.int64).reshape(-1) for b in blobs]))
        if len(every):
            self.from_rank0(lambda: self._call("mark_lost", block_ids=every),
                            "mark blocks lost in a resync")
        return lost

    def _commit_and_resync(self: _Runtime, results: list[list[MoveResult]], first: int
                           ) -> dict[str, Any]:
        self._check_commits(wait=True)
        for per_plan in results:
            if per_plan[0].epoch > first:
                break
            self._call("commit", per_plan)
        return dict(self._call("resync"))

    def _resync_if_commit_failed(self: _Runtime) -> dict[str, Any] | None:
        return dict(self._call("resync")) if self.sent.take_refusal() else None
