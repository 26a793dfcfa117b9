"""capture(): a consistent copy of what snapshot() shows, taken fast, rendered later elsewhere.

The capture runs where the controller runs (the actor's loop) and copies only what the view
needs: scalars, small containers (copied, never referenced), and numpy copies of the columns of
the sessions shown (one vectorized gather of their rows). Everything else (per-session rows,
heat, percentiles, the dict itself) is `snapshot.render`'s work, on any thread, from the copy.
It reads the controller through `View` (read-only), so it does not import it.
"""

from __future__ import annotations

import copy
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from tpkv.config import TpkvConfig
from tpkv.controller.cost import RateMeter
from tpkv.controller.epochs import Epochs
from tpkv.controller.sessions import SessionTable
from tpkv.controller.snapshot import TIERS, Capture, SessionCols
from tpkv.controller.table import BlockTable
from tpkv.protocol.plan import Tier

__all__ = ["Capture", "SessionCols", "View", "capture"]


class View(Protocol):
    """What capture() reads of the controller (Controller is one): read-only."""

    @property
    def config(self) -> TpkvConfig: ...
    @property
    def table(self) -> BlockTable: ...
    @property
    def sessions(self) -> SessionTable: ...
    @property
    def epochs(self) -> Epochs: ...
    @property
    def rates(self) -> RateMeter: ...
    @property
    def marks(self) -> Mapping[int, tuple[float, float]]: ...
    @property
    def draining(self) -> Mapping[int, bool]: ...
    @property
    def l3_enabled(self) -> bool: ...
    @property
    def tick(self) -> int: ...
    @property
    def last_step_s(self) -> float | None: ...
    @property
    def restarts(self) -> int: ...
    @property
    def awaiting_rebuild(self) -> bool: ...
    @property
    def recovery(self) -> dict[str, Any] | None: ...
    @property
    def ranks(self) -> Mapping[int, str]: ...
    @property
    def events(self) -> deque[dict[str, Any]]: ...
    @property
    def event_counts(self) -> Counter[str]: ...
    @property
    def latency_us(self) -> deque[float]: ...
    @property
    def pin_threshold(self) -> float: ...

    def now_s(self) -> float: ...

    def metadata_bytes(self) -> int: ...


def capture(ctl: View, max_sessions: int = 256) -> Capture:
    """On the controller's thread: copy what `snapshot.render` needs (no per-block lists, no
    loop over all sessions; the shown ones' rows in one gather)."""
    T, S, E = ctl.table, ctl.sessions, ctl.epochs
    open_idx = S.open_indices()
    recent = open_idx[np.argsort(-S.run_hist[0, open_idx].astype(np.int64), kind="stable")]
    sel = recent[:max(max_sessions, 0)]
    rows, offsets = S.arena.gather(sel)
    pins = S.pins
    cols = SessionCols(
        names=[S.names[s] or "" for s in sel.tolist()], tokens=S.tokens[sel],
        pending=S.pending[sel], run_hist=S.run_hist[:, sel], runs=S.runs[sel],
        attn_sum=S.attn_sum[sel], counts=S.counts[:, sel], choice=S.choice[sel],
        load_s=S.load_s[sel], recompute_s=S.recompute_s[sel],
        pins={i: list(pins[s]) for i, s in enumerate(sel.tolist()) if s in pins},
        offsets=offsets, tier=T.tier[rows], pinned=T.pinned[rows], attn=T.attn[rows],
        in_flight=T.in_flight[rows], last_tick=T.last_tick[rows], hist=T.hist[rows],
        count=T.count[rows], runs_seen=T.runs_seen[rows])
    tiers: dict[int, dict[str, Any]] = {
        t: {"slots": T.slots(t), "used": T.used(t), "free": T.num_free(t), "marks": ctl.marks[t],
            "draining": bool(ctl.draining[t]), "enabled": t != Tier.SSD or ctl.l3_enabled}
        for t in TIERS}
    events = ctl.events
    return Capture(
        tick=ctl.tick, uptime_s=ctl.now_s(), next_epoch=E.next_epoch,
        committed_epoch=E.committed_epoch,
        pending_epochs=[p.plan.epoch for _, p in zip(range(32), E.pending)],
        num_pending=len(E.pending), restarts=ctl.restarts,
        awaiting_rebuild=ctl.awaiting_rebuild, recovery=copy.deepcopy(ctl.recovery),
        ranks=dict(ctl.ranks), tiers=tiers, num_kept=T.num_kept, l3_other=T.l3_other,
        unplaced=T.used(Tier.NONE), num_sessions=len(open_idx), sessions=cols,
        latency_us=list(ctl.latency_us), pin_threshold=ctl.pin_threshold,
        rates=ctl.rates.as_dict(), policy=ctl.config.policy, capacity=T.capacity,
        live_blocks=T.capacity - T.free_rows.top, metadata_bytes=ctl.metadata_bytes(),
        events=[dict(e) for e in list(events)[-64:]] if events else [],
        event_counts=dict(ctl.event_counts), l3_held=T.l3_held, last_step_s=ctl.last_step_s,
        spill_pace=T.pace.as_dict())
