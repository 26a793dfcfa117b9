"""Slot-map and plan digests that the controller and every worker compute alike (no torch)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

from tpkv.protocol.plan import MovePlan, Tier

_SIGN = 1 << 63
_WRAP = 1 << 64


def slot_map_digest(block_ids: np.ndarray, tiers: np.ndarray, slots: np.ndarray) -> int:
    """xxh3-64 over (block_id, tier, slot) rows sorted by block id, all int64 little-endian.

    The result is a signed int64 (it fits an int64 tensor for the all-gather). The order of the
    inputs does not matter; equal maps give equal digests on every machine.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    tier = np.asarray(tiers, dtype=np.int64).reshape(-1)
    slot = np.asarray(slots, dtype=np.int64).reshape(-1)
    if not len(ids) == len(tier) == len(slot):
        raise ValueError(f"digest inputs differ in length: {len(ids)}, {len(tier)}, {len(slot)}")
    order = np.argsort(ids, kind="stable")
    rows = np.empty((len(ids), 3), dtype="<i8")  # [n, (block_id, tier, slot)]
    rows[:, 0] = ids[order]
    rows[:, 1] = tier[order]
    rows[:, 2] = slot[order]
    value = xxhash.xxh3_64_intdigest(rows.tobytes())
    return value - _WRAP if value >= _SIGN else value


def plan_digest(plan: MovePlan, miss_block_ids: Iterable[int] | np.ndarray = ()) -> int:
    """Digest of where a plan leaves its blocks on one rank: (dst_tier, dst_slot) per moved block,
    except the rank's misses, which count as (Tier.NONE, -1). Ranks report this after a plan."""
    tiers = plan.dst_tier.astype(np.int64)
    slots = plan.dst_slot.astype(np.int64)
    misses = np.asarray(list(miss_block_ids) if not isinstance(miss_block_ids, np.ndarray)
                        else miss_block_ids, dtype=np.int64)
    if len(misses):
        hit = np.isin(plan.block_ids, misses)
        tiers = np.where(hit, int(Tier.NONE), tiers)
        slots = np.where(hit, -1, slots)
    return slot_map_digest(plan.block_ids, tiers, slots)


def canonical(obj: object) -> object:
    """A message with its arrays as int64 / float64 values, for hashing whole step results: a
    dtype change of equal values gives the same bytes (golden tests, bench/controller.py)."""
    if isinstance(obj, np.ndarray):
        return obj.astype(np.float64 if obj.dtype.kind == "f" else np.int64).reshape(-1)
    if isinstance(obj, dict):
        return {k: canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    return obj
