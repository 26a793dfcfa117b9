"""snapshot(): the controller's state as a plain, JSON-friendly dict (for the dashboard)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from tpkv.controller.policy import heat
from tpkv.controller.sessions import CHOICE_NAMES
from tpkv.controller.table import PIN_EXPLICIT
from tpkv.types import Tier

if TYPE_CHECKING:
    from tpkv.controller.controller import Controller

_TIER_NAMES = {Tier.HBM: "L1", Tier.DRAM: "L2", Tier.SSD: "L3"}


def _num(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 9)


def _tiers(ctl: Controller) -> dict[str, Any]:
    T = ctl.table
    out: dict[str, Any] = {}
    for tier, name in _TIER_NAMES.items():
        slots, used = T.slots(tier), T.used(tier)
        high, low = ctl.marks[tier]
        out[name] = {"slots": slots, "used": used, "free": T.num_free(tier),
                     "occupancy": _num(used / slots) if slots else None, "high_watermark": high,
                     "low_watermark": low, "draining": bool(ctl.draining[tier]),
                     "enabled": tier != Tier.SSD or ctl.l3_enabled}
    # L2 slots holding copies of L1 blocks (counted in "free": given back on demand)
    out["L2"]["kept_copies"] = T.num_kept
    # L3 records that are not blocks in L3: copies of blocks loaded back (a spill of their
    # block writes nothing) and dead ones; they hold room (not in "free") until their segment
    # goes
    out["L3"]["other_records"] = T.l3_other
    out["none"] = {"blocks": T.used(Tier.NONE)}
    return out


def _session(ctl: Controller, s: int) -> dict[str, Any]:
    T, S, pol = ctl.table, ctl.sessions, ctl.config.policy
    rows = S.rows(s)
    nblocks = len(rows)
    last = int(S.run_hist[0, s])
    idle = ctl.tick - last if last >= 0 else None
    mean_attn = float(S.attn_sum[s]) / max(nblocks, 1)
    session_heat = float(heat(np.array([mean_attn]), np.array([idle if idle is not None
                                                                 else ctl.tick]),
                              pol.w_attn, pol.w_recency)[0])
    on_l1 = T.tier[rows] == Tier.HBM
    counts = S.counts[:, s]
    return {
        "session": S.name(s), "tokens": int(S.tokens[s]), "pending_tokens": int(S.pending[s]),
        "blocks": nblocks, "tiers": {"L1": int(counts[1]), "L2": int(counts[2]),
                                     "L3": int(counts[3]), "none": int(counts[0])},
        "heat": _num(session_heat), "mean_attention": _num(mean_attn), "last_run_tick": last,
        "ticks_idle": idle, "runs": int(S.runs[s]),
        "pins": [list(r) for r in S.pins.get(s, [])],
        "pinned_blocks": int((T.pinned[rows] & PIN_EXPLICIT != 0).sum()),
        "auto_pinned_blocks": int((on_l1 & (T.attn[rows] >= ctl.pin_threshold)).sum()),
        "in_flight": int(T.in_flight[rows].sum()),
        "cost": {"choice": CHOICE_NAMES[int(S.choice[s])], "load_s": _num(float(S.load_s[s])),
                 "recompute_s": _num(float(S.recompute_s[s]))},
    }


def build(ctl: Controller, max_sessions: int = 256) -> dict[str, Any]:
    S, T = ctl.sessions, ctl.table
    open_idx = S.open_indices()
    recent = open_idx[np.argsort(-S.run_hist[0, open_idx].astype(np.int64), kind="stable")]
    lat = np.asarray(ctl.latency_us, dtype=np.float64)
    live = T.capacity - T.free_rows.top
    return {
        "tick": ctl.tick,
        "uptime_s": _num(ctl.now_s()),
        "epoch": {"next": ctl.next_epoch, "committed": ctl.committed_epoch,
                  "pending": [p.plan.epoch for p in ctl.pending][:32],
                  "num_pending": len(ctl.pending)},
        "restarts": ctl.restarts,
        "awaiting_rebuild": ctl.awaiting_rebuild,
        "recovery": ctl.recovery,
        "ranks": {str(r): h for r, h in sorted(ctl.ranks.items())},
        "tiers": _tiers(ctl),
        "num_sessions": len(open_idx),
        "sessions": [_session(ctl, int(s)) for s in recent[:max_sessions]],
        "plan_latency_us": {
            "count": len(lat),
            "p50": _num(float(np.percentile(lat, 50))) if len(lat) else None,
            "p99": _num(float(np.percentile(lat, 99))) if len(lat) else None,
            "max": _num(float(lat.max())) if len(lat) else None},
        "auto_pin_threshold": _num(ctl.pin_threshold),
        "rates": ctl.rates.as_dict(),
        "policy": dataclasses.asdict(ctl.config.policy),
        "table": {"capacity": T.capacity, "live_blocks": live,
                  "metadata_bytes": ctl.metadata_bytes(),
                  "bytes_per_block": _num(ctl.metadata_bytes() / max(T.capacity, 1))},
        "events": [dict(e) for e in list(ctl.events)[-64:]],
        "event_counts": dict(sorted(ctl.event_counts.items())),
    }


def session_blocks(ctl: Controller, session_id: str) -> dict[str, Any]:
    T, S, pol = ctl.table, ctl.sessions, ctl.config.policy
    s = S.lookup(session_id)
    rows = S.rows(s).copy()
    ctl.sync_access(rows)
    since = ctl.tick - T.last_tick[rows].astype(np.int64)
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
        "auto_pinned": ((T.tier[rows] == Tier.HBM) & (T.attn[rows] >= ctl.pin_threshold)).tolist(),
        "in_flight": (T.in_flight[rows] != 0).tolist(),
    }
