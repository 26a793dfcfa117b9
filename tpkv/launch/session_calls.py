"""TpkvRuntime's session calls: each runs on rank 0 and its answer reaches every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from tpkv import errors
from tpkv.launch.ahead import Credits
from tpkv.workers.worker import Worker

log = logging.getLogger(__name__)


class _Runtime(Protocol):
    """What the session calls use of TpkvRuntime."""

    worker: Worker
    rank: int
    timeout_s: float
    credits: Credits
    opened: set[str]
    closing: set[str]
    pins: dict[str, list[tuple[int, int]]]

    def _on_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def _check_commits(self, wait: bool = False) -> None: ...

    def _drop_l3(self, session_id: str) -> None: ...

    def settle_ahead(self) -> None: ...

    def from_rank0(self, fn: Callable[[], Any], what: str) -> Any: ...


class SessionCalls:
    """Open, extend, close and pin sessions, and the controller's map, on every rank alike
    (TpkvRuntime's; the runtime keeps what a rebuilt controller needs back: sessions opened,
    closing, pins)."""

    def open_session(self: _Runtime, session_id: str, num_tokens: int = 0) -> int:
        handle = int(self._on_rank0("open_session", session_id=session_id,
                                    num_tokens=num_tokens))
        self.opened.add(session_id)  # a rebuilt controller gets it back even with no block
        return handle

    def extend_session(self: _Runtime, session_id: str, num_tokens: int) -> None:
        self._on_rank0("extend_session", session_id=session_id, num_tokens=num_tokens)

    def close_session(self: _Runtime, session_id: str) -> int:
        freed = int(self._on_rank0("close_session", session_id=session_id))
        self.opened.discard(session_id)
        self.credits.drop(session_id)
        self.closing.add(session_id)  # the ranks release its blocks with the next step
        self.pins.pop(session_id, None)
        self._drop_l3(session_id)
        return freed

    def _drop_l3(self: _Runtime, session_id: str) -> None:
        """Closed means deleted: this rank's L3 files of the session go now, not with the next
        step (which may never come); its spills not begun write nothing, and the delete waits
        for one writing, so none lands after."""
        store = self.worker.store
        if store is None:
            return
        self.worker.executor.spills.abandon({session_id})
        try:
            store.drop_session(session_id)
        except (errors.SsdError, OSError) as exc:  # the next step's delete tries again
            log.warning("rank %d: L3 files of closed session %r not deleted: %s", self.rank,
                        session_id, exc)

    def pin(self: _Runtime, session_id: str, start: int = 0, stop: int | None = None) -> int:
        n = int(self._on_rank0("pin", session_id=session_id, start=start, stop=stop))
        # kept here too: a rebuilt controller gets its pins back from the ranks
        self.pins.setdefault(session_id, []).append((start, start + n if stop is None else stop))
        return n

    def controller_slot_map(self: _Runtime) -> dict[str, Any]:
        """The controller's authoritative map on every rank (for checks and tests)."""

        def fetch() -> dict[str, Any]:
            self._check_commits(wait=True)
            return dict(self._call("slot_map"))

        self.settle_ahead()
        return dict(self.from_rank0(fetch, "slot map"))
