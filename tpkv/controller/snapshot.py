"""snapshot(): the controller's state as a plain, JSON-friendly dict (for the dashboard).

A `Capture` (taken by tpkv.controller.capture, the only part that reads the controller) holds
copies; `render` turns it into the dict, on any thread (the dashboard's)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tpkv.controller.policy import fold_access, heat
from tpkv.controller.sessions import CHOICE_NAMES
from tpkv.controller.table import PIN_EXPLICIT, BlockTable
from tpkv.protocol.plan import Tier

if TYPE_CHECKING:
    from tpkv.config import PolicyConfig

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
    """What `render` turns into the snapshot dict: copies only, safe on any thread."""

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
    # the spill pacer's view of the disk (SpillPacer.as_dict: its measured write rate...)
    spill_pace: dict[str, float | int] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
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


_TIER_NAMES = {Tier.HBM: "L1", Tier.DRAM: "L2", Tier.SSD: "L3"}


def _num(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 9)


def _tiers(cap: Capture) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tier in TIERS:
        t = cap.tiers[tier]
        slots, used = t["slots"], t["used"]
        high, low = t["marks"]
        out[_TIER_NAMES[tier]] = {
            "slots": slots, "used": used, "free": t["free"],
            "occupancy": _num(used / slots) if slots else None, "high_watermark": high,
            "low_watermark": low, "draining": t["draining"], "enabled": t["enabled"]}
    # L2 slots holding copies of L1 blocks (counted in "free": given back on demand)
    out["L2"]["kept_copies"] = cap.num_kept
    # L3 records that are not blocks in L3: copies of blocks loaded back (a spill of their
    # block writes nothing) and dead ones; they hold room (not in "free") until their segment
    # goes
    out["L3"]["other_records"] = cap.l3_other
    # L3 room freed (blocks gone up, emptied segments' headers) but held until the ranks have
    # applied the step that freed it: slots = used + free + other_records + held
    out["L3"]["held"] = cap.l3_held
    out["none"] = {"blocks": cap.unplaced}
    return out


def _per_session(values: np.ndarray, offsets: np.ndarray) -> list[int]:
    """Sum of `values` over each session's rows (vectorized; empty sessions give 0)."""
    sums = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=sums[1:])
    return (sums[offsets[1:]] - sums[offsets[:-1]]).tolist()


def _sessions(cap: Capture) -> list[dict[str, Any]]:
    S, pol = cap.sessions, cap.policy
    nblocks = np.diff(S.offsets)
    last = S.run_hist[0].astype(np.int64)
    idle = np.where(last >= 0, cap.tick - last, cap.tick)
    mean_attn = S.attn_sum.astype(np.float64) / np.maximum(nblocks, 1)
    session_heat = heat(mean_attn, idle, pol.w_attn, pol.w_recency).tolist()
    on_l1 = S.tier == Tier.HBM
    pinned = _per_session((S.pinned & PIN_EXPLICIT) != 0, S.offsets)
    auto = _per_session(on_l1 & (S.attn >= cap.pin_threshold), S.offsets)
    in_flight = _per_session(S.in_flight, S.offsets)
    c = S.counts.tolist()
    cols = (S.tokens.tolist(), S.pending.tolist(), nblocks.tolist(), mean_attn.tolist(),
            last.tolist(), S.runs.tolist(), S.choice.tolist(), S.load_s.tolist(),
            S.recompute_s.tolist())
    out = []
    for i, (tokens, pending, n, attn, lt, runs, choice, load, recompute) in enumerate(
            zip(*cols)):
        out.append({
            "session": S.names[i], "tokens": tokens, "pending_tokens": pending,
            "blocks": n, "tiers": {"L1": c[1][i], "L2": c[2][i], "L3": c[3][i],
                                   "none": c[0][i]},
            "heat": _num(session_heat[i]), "mean_attention": _num(attn), "last_run_tick": lt,
            "ticks_idle": cap.tick - lt if lt >= 0 else None, "runs": runs,
            "pins": [list(r) for r in S.pins.get(i, [])], "pinned_blocks": pinned[i],
            "auto_pinned_blocks": auto[i], "in_flight": in_flight[i],
            "cost": {"choice": CHOICE_NAMES[choice], "load_s": _num(load),
                     "recompute_s": _num(recompute)}})
    return out


def render(cap: Capture) -> dict[str, Any]:
    """The snapshot dict of a capture (reads only the capture: call it on any thread)."""
    lat = np.asarray(cap.latency_us, dtype=np.float64)
    return {
        "tick": cap.tick,
        "uptime_s": _num(cap.uptime_s),
        "last_step_s": None if cap.last_step_s is None else _num(cap.last_step_s),
        "epoch": {"next": cap.next_epoch, "committed": cap.committed_epoch,
                  "pending": cap.pending_epochs, "num_pending": cap.num_pending},
        "restarts": cap.restarts,
        "awaiting_rebuild": cap.awaiting_rebuild,
        "recovery": cap.recovery,
        "ranks": {str(r): h for r, h in sorted(cap.ranks.items())},
        "tiers": _tiers(cap),
        "num_sessions": cap.num_sessions,
        "sessions": _sessions(cap),
        "plan_latency_us": {
            "count": len(lat),
            "p50": _num(float(np.percentile(lat, 50))) if len(lat) else None,
            "p99": _num(float(np.percentile(lat, 99))) if len(lat) else None,
            "max": _num(float(lat.max())) if len(lat) else None},
        "auto_pin_threshold": _num(cap.pin_threshold),
        "rates": cap.rates,
        "spill_pace": cap.spill_pace,
        "policy": dataclasses.asdict(cap.policy),
        "table": {"capacity": cap.capacity, "live_blocks": cap.live_blocks,
                  "metadata_bytes": cap.metadata_bytes,
                  "bytes_per_block": _num(cap.metadata_bytes / max(cap.capacity, 1))},
        "events": cap.events,
        "event_counts": dict(sorted(cap.event_counts.items())),
    }


def session_blocks(T: BlockTable, rows: np.ndarray, session_id: str, tick: int,
                   pol: PolicyConfig, pin_threshold: float) -> dict[str, Any]:
    """Per-block state of a session's `rows` (its access history folded in already)."""
    since = tick - T.last_tick[rows].astype(np.int64)
    kth = T.hist[rows, -1] if T.hist.shape[1] else T.last_tick[rows]
    return {
        "session": session_id,
        "logical": T.logical[rows].tolist(),
        "block_ids": T.ids(rows).tolist(),
        "tier": [_TIER_NAMES.get(Tier(int(t)), "none") for t in T.tier[rows]],
        "slot": T.slot[rows].tolist(),
        "attention": [float(x) for x in T.attn[rows]],
        "heat": [float(x) for x in heat(T.attn[rows], since, pol.w_attn, pol.w_recency)],
        "last_tick": T.last_tick[rows].tolist(),
        "lru_k_tick": kth.tolist(),
        "access_count": T.count[rows].tolist(),
        "pinned": ((T.pinned[rows] & PIN_EXPLICIT) != 0).tolist(),
        "auto_pinned": ((T.tier[rows] == Tier.HBM) & (T.attn[rows] >= pin_threshold)).tolist(),
        "in_flight": (T.in_flight[rows] != 0).tolist(),
    }
