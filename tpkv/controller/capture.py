"""capture(): a consistent copy of what snapshot() shows, taken fast, rendered later elsewhere.

The capture runs where the controller runs (the actor's loop) and copies only what the view
needs: scalars, small containers (copied, never referenced), and numpy copies of the columns of
the sessions shown (one vectorized gather of their rows). Everything else (per-session rows,
heat, percentiles, the dict itself) is `snapshot.render`'s work, on any thread, from the copy.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tpkv.controller.policy import fold_access, heat
from tpkv.protocol.plan import Tier

if TYPE_CHECKING:
    from tpkv.config import PolicyConfig
    from tpkv.controller.controller import Controller

TIERS = (Tier.HBM, Tier.DRAM, Tier.SSD)


@dataclass
class SessionCols:
    """The shown sessions (most recently run first), and the rows of their blocks, concatenated
    in that order: session i's are `[offsets[i], offsets[i + 1])`."""

    names: list[str]
    tokens: np.ndarray
    pending: np.ndarray
    run_hist: np.ndarray  # [K, n] newest first
    runs: np.ndarray
    attn_sum: np.ndarray
    counts: np.ndarray  # [4, n]: NONE, L1, L2, L3
    choice: np.ndarray
    load_s: np.ndarray
    recompute_s: np.ndarray
    pins: dict[int, list[tuple[int, int]]]  # by position in `names`
    offsets: np.ndarray  # [n + 1]
    # per block row
    tier: np.ndarray
    pinned: np.ndarray
    attn: np.ndarray
    in_flight: np.ndarray
    last_tick: np.ndarray
    hist: np.ndarray
    count: np.ndarray
    runs_seen: np.ndarray


@dataclass
class Capture:
    """What `snapshot.render` turns into the snapshot dict: copies only, safe on any thread."""

    tick: int
    uptime_s: float
    next_epoch: int
    committed_epoch: int
    pending_epochs: list[int]  # the first 32
    num_pending: int
    restarts: int
    awaiting_rebuild: bool
    recovery: dict[str, Any] | None
    ranks: dict[int, str]
    tiers: dict[int, dict[str, Any]]  # raw counts and marks per tier
    num_kept: int
    l3_other: int
    unplaced: int  # blocks in no tier
    num_sessions: int
    sessions: SessionCols
    latency_us: list[float]
    pin_threshold: float
    rates: dict[str, Any]
    policy: PolicyConfig  # frozen
    capacity: int
    live_blocks: int
    metadata_bytes: int
    events: list[dict[str, Any]]
    event_counts: dict[str, int]
    l3_held: int = 0  # L3 room freed but held until the ranks apply the last step
    last_step_s: float | None = None  # now_s() when the last step started (None: no step yet)
    _index: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        from tpkv.controller.snapshot import render

        return render(self)

    @functools.cached_property
    def block_heat(self) -> np.ndarray:
        """Heat of every captured block row, its session's runs folded in (as session_blocks
        does, without writing the fold back)."""
        S = self.sessions
        sess = np.repeat(np.arange(len(S.names)), np.diff(S.offsets))
        last = fold_access(S.last_tick, S.hist, S.count, S.runs_seen, S.runs[sess],
                           S.run_hist[:, sess].T)[0]
        since = self.tick - last.astype(np.int64)
        return heat(S.attn, since, self.policy.w_attn, self.policy.w_recency)

    def blocks(self, session_id: str) -> dict[str, Any]:
        """What the heat map needs of one shown session's blocks: tier codes (0 none, 1 L1,
        2 L2, 3 L3) and heat, in logical order; LookupError for a session not shown."""
        if not self._index:
            self._index = {name: i for i, name in enumerate(self.sessions.names)}
        i = self._index[session_id]
        a, b = int(self.sessions.offsets[i]), int(self.sessions.offsets[i + 1])
        return {"session": session_id, "tier_code": self.sessions.tier[a:b].astype(np.int8) + 1,
                "heat": self.block_heat[a:b]}


def capture(ctl: Controller, max_sessions: int = 256) -> Capture:
    """On the controller's thread: copy what `snapshot.render` needs (no per-block lists, no
    loop over all sessions; the shown ones' rows in one gather)."""
    T, S = ctl.table, ctl.sessions
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
        tick=ctl.tick, uptime_s=ctl.now_s(), next_epoch=ctl.next_epoch,
        committed_epoch=ctl.committed_epoch,
        pending_epochs=[p.plan.epoch for _, p in zip(range(32), ctl.pending)],
        num_pending=len(ctl.pending), restarts=ctl.restarts,
        awaiting_rebuild=ctl.awaiting_rebuild, recovery=copy.deepcopy(ctl.recovery),
        ranks=dict(ctl.ranks), tiers=tiers, num_kept=T.num_kept, l3_other=T.l3_other,
        unplaced=T.used(Tier.NONE), num_sessions=len(open_idx), sessions=cols,
        latency_us=list(ctl.latency_us), pin_threshold=ctl.pin_threshold,
        rates=ctl.rates.as_dict(), policy=ctl.config.policy, capacity=T.capacity,
        live_blocks=T.capacity - T.free_rows.top, metadata_bytes=ctl.metadata_bytes(),
        events=[dict(e) for e in list(events)[-64:]] if events else [],
        event_counts=dict(ctl.event_counts), l3_held=T.l3_held, last_step_s=ctl.last_step_s)
