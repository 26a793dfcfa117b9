"""Bring a restarted controller back: every rank's slot map and the L3 manifests rebuild it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tpkv.errors import DuplicateSessionError, UnknownSessionError
from tpkv.protocol.wire import decode, encode

if TYPE_CHECKING:
    from tpkv.workers.worker import Worker

log = logging.getLogger(__name__)


def rebuild_controller(worker: Worker, gather: Callable[[bytes], list[bytes]],
                       from_rank0: Callable[[Callable[[], Any], str], Any],
                       call: Callable[..., Any], closing: Iterable[str],
                       pins: Mapping[str, Sequence[tuple[int, int]]],
                       opened: Iterable[str] = ()) -> dict[str, Any]:
    """A collective: every rank calls it when the controller answered ControllerRecoveringError
    (its actor restarted with an empty table). Each rank finishes its background spills (so the
    manifests are complete) and sends its slot map (`gather`: every rank's bytes on rank 0);
    rank 0 adds the sessions its L3 lists and has the controller rebuild (`call`, run through
    `from_rank0`, so every rank gets the answer or the error). Sessions `closing` (closed since
    the last step) are closed again, sessions `opened` that no map or manifest lists (opened,
    no block written yet) are opened again, and the explicit `pins` set again; attention mass
    and access history start afresh. Returns the rebuild summary; the caller (TpkvRuntime) then
    restores its rank from the controller's map, where blocks no rank holds a copy of are
    lost."""
    started = time.perf_counter()
    worker.executor.synchronize()
    maps = gather(encode(worker.slot_map()))

    def rebuild() -> Any:
        store = worker.store
        manifests: dict[str, Any] = {}
        records: dict[str, int] = {}
        if store is not None:  # and the records each holds, dead ones too (L3 room)
            for sid in store.list_sessions():
                manifests[sid] = store.session_indices(sid)
                records[sid] = store.session_records(sid)
        summary = call("rebuild", slot_maps=[decode(m) for m in maps],
                       ssd_manifests=manifests, ssd_records=records)
        # Sessions closed just before the restart are still in the ranks' maps (their blocks
        # go with the next step): close them again, or a new session of the same name would
        # find their blocks.
        for name in sorted(closing):
            try:
                call("close_session", session_id=name)
            except UnknownSessionError:
                pass
        for name in sorted(set(opened) - set(closing)):  # open with no block anywhere yet
            try:
                call("open_session", session_id=name)
            except DuplicateSessionError:
                pass
        for name, ranges in sorted(pins.items()):  # explicit pins live only in the table
            for start, stop in ranges:
                try:
                    call("pin", session_id=name, start=start, stop=stop)
                except UnknownSessionError:
                    pass
        return summary

    summary = dict(from_rank0(rebuild, "controller rebuild"))
    log.warning("rank %d: the controller restarted and was rebuilt from %d slot maps and %d L3 "
                "sessions in %.2f s: %s", worker.rank, len(maps),
                summary.get("from_manifests", 0), time.perf_counter() - started, summary)
    return summary
