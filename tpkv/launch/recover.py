"""Bring a restarted controller back: every rank's slot map and the L3 manifests rebuild it."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tpkv.errors import UnknownSessionError
from tpkv.protocol.wire import decode, encode

if TYPE_CHECKING:
    from tpkv.launch.runtime import TpkvRuntime

log = logging.getLogger(__name__)


def rebuild_controller(rt: TpkvRuntime) -> dict[str, Any]:
    """A collective: every rank calls it when the controller answered ControllerRecoveringError
    (its actor restarted with an empty table). Each rank finishes its background spills (so the
    manifests are complete) and sends its slot map; rank 0 adds the sessions its L3 lists and
    has the controller rebuild; every rank then restores the controller's map (blocks some rank
    holds no copy of are marked lost and recomputed). Sessions closed since the last step are
    closed again and explicit pins set again; attention mass and access history start afresh.
    Returns the rebuild summary."""
    started = time.perf_counter()
    rt.worker.executor.synchronize()
    mine = encode(rt.worker.slot_map())
    maps = rt.ctx.ctl.gather_bytes(mine, "slot maps for a controller rebuild") \
        if rt.world_size > 1 else [mine]

    def rebuild() -> Any:
        store = rt.worker.store
        manifests: dict[str, Any] = {}
        records: dict[str, int] = {}
        if store is not None:  # and the records each holds, dead ones too (L3 room)
            for sid in store.list_sessions():
                manifests[sid] = store.session_indices(sid)
                records[sid] = store.session_records(sid)
        summary = rt._call("rebuild", slot_maps=[decode(m) for m in maps],
                           ssd_manifests=manifests, ssd_records=records)
        # Sessions closed just before the restart are still in the ranks' maps (their blocks
        # go with the next step): close them again, or a new session of the same name would
        # find their blocks.
        for name in sorted(rt.closing):
            try:
                rt._call("close_session", session_id=name)
            except UnknownSessionError:
                pass
        for name, ranges in sorted(rt.pins.items()):  # explicit pins live only in the table
            for start, stop in ranges:
                try:
                    rt._call("pin", session_id=name, start=start, stop=stop)
                except UnknownSessionError:
                    pass
        return summary

    summary = dict(rt.from_rank0(rebuild, "controller rebuild"))
    rt.forget_commits()
    full = rt.from_rank0(lambda: dict(rt._call("resync")), "resync after a controller rebuild")
    rt._resync(full)
    rt.num_rebuilds += 1
    rt._l2_told = -1  # the rebuilt controller hears again how much of L2 is pinned
    log.warning("rank %d: the controller restarted and was rebuilt from %d slot maps and %d L3 "
                "sessions in %.2f s: %s", rt.rank, len(maps), summary.get("from_manifests", 0),
                time.perf_counter() - started, summary)
    return summary
