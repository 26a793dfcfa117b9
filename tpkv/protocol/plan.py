"""Plain data a plan is made of: Tier, MovePlan (the controller's moves), MoveResult."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpkv.errors import WireFormatError


class Tier(enum.IntEnum):
    """Where a block lives. NONE: nowhere (evicted; its prefix is recomputed on demand)."""

    NONE = -1
    HBM = 0  # L1
    DRAM = 1  # L2
    SSD = 2  # L3


_PLAN_ARRAYS = ("block_ids", "src_tier", "src_slot", "dst_tier", "dst_slot", "session_idx",
                "logical_idx")
_PLAN_DTYPES = {
    "block_ids": np.int64, "src_tier": np.int8, "src_slot": np.int64, "dst_tier": np.int8,
    "dst_slot": np.int64, "session_idx": np.int32, "logical_idx": np.int64,
}
_PLAN_FIELDS = tuple((name, np.dtype(_PLAN_DTYPES[name])) for name in _PLAN_ARRAYS)
_MAX_TIER = int(Tier.SSD)  # plan tiers are HBM (0) .. SSD
_NO_KEPT = np.zeros(0, dtype=np.bool_)  # a plan that keeps no move
_NO_KEPT.setflags(write=False)


@dataclass(frozen=True)
class MovePlan:
    """A numbered list of moves; workers apply plans in epoch order and decide nothing.

    Move i takes block `block_ids[i]` from (src_tier, src_slot) to (dst_tier, dst_slot). For SSD
    ends the slot is unused (-1): the record is addressed by (session_names[session_idx[i]],
    logical_idx[i]), which every move carries so workers can name what they write.

    `kept[i]` (L1 -> L2 and L2 -> L3 moves only): the destination holds this block's bytes
    already, and the block has not been written since, so the move copies nothing; only the
    maps change. On L1 -> L2: the L2 slot from the promotion that brought it into L1. On
    L2 -> L3: the session's L3 record the block was loaded from (a kept spill writes nothing).
    Empty (the default) when no move is kept.
    """

    epoch: int
    block_ids: np.ndarray
    src_tier: np.ndarray
    src_slot: np.ndarray
    dst_tier: np.ndarray
    dst_slot: np.ndarray
    session_idx: np.ndarray
    logical_idx: np.ndarray
    session_names: tuple[str, ...] = ()
    kept: np.ndarray = field(default_factory=lambda: _NO_KEPT)

    def __post_init__(self) -> None:
        # Tens of microseconds for hundreds of moves: no copy of arrays that already have the
        # wire dtype, one unsigned max per range check rather than np.isin or min and max, a
        # sort rather than np.unique.
        n = len(self.block_ids)
        put = object.__setattr__
        for name, dtype in _PLAN_FIELDS:
            arr = getattr(self, name)
            if not (isinstance(arr, np.ndarray) and arr.dtype == dtype
                    and arr.flags.c_contiguous):
                arr = np.ascontiguousarray(arr, dtype=dtype)
            if arr.ndim != 1 or len(arr) != n:
                raise WireFormatError(f"plan array {name} has shape {arr.shape}, expected ({n},)")
            arr.setflags(write=False)
            put(self, name, arr)
        put(self, "session_names", tuple(self.session_names))
        kept = np.ascontiguousarray(self.kept, dtype=np.bool_).reshape(-1)
        if not kept.any():
            kept = _NO_KEPT
        elif len(kept) != n:
            raise WireFormatError(f"plan array kept has {len(kept)} entries, expected 0 or {n}")
        else:
            src, dst = self.src_tier[kept], self.dst_tier[kept]
            if not (((src == int(Tier.HBM)) & (dst == int(Tier.DRAM)))
                    | ((src == int(Tier.DRAM)) & (dst == int(Tier.SSD)))).all():
                raise WireFormatError("plan keeps a move that is not L1 -> L2 or L2 -> L3")
        kept.setflags(write=False)
        put(self, "kept", kept)
        if self.epoch < 0:
            raise WireFormatError(f"plan epoch must be >= 0, got {self.epoch}")
        if n == 0:
            return
        for name in ("src_tier", "dst_tier"):
            tiers = getattr(self, name)
            if tiers.view(np.uint8).max() > _MAX_TIER:  # a negative tier wraps to 128..255
                bad = tiers[(tiers < 0) | (tiers > _MAX_TIER)][:8]
                raise WireFormatError(f"plan {name} has invalid tiers {bad}")
        if self.session_idx.view(np.uint32).max() >= len(self.session_names):
            raise WireFormatError(
                f"plan session_idx outside 0..{len(self.session_names) - 1}"
            )
        if n > 1:
            ids = np.sort(self.block_ids)
            if (ids[1:] == ids[:-1]).any():
                raise WireFormatError("plan moves a block more than once")

    @classmethod
    def trusted(cls, epoch: int, block_ids: np.ndarray, src_tier: np.ndarray,
                src_slot: np.ndarray, dst_tier: np.ndarray, dst_slot: np.ndarray,
                session_idx: np.ndarray, logical_idx: np.ndarray,
                session_names: tuple[str, ...], kept: np.ndarray | None = None) -> MovePlan:
        """A plan the controller built itself (PlanBuilder): its arrays are fresh, 1-D, of one
        length and in the wire dtypes, and its moves valid by construction, so nothing is
        checked (tens of microseconds a plan). Plans from anywhere else, a decoded message
        above all, go through the constructor, which checks everything."""
        plan = object.__new__(cls)
        put = object.__setattr__
        put(plan, "epoch", epoch)
        for name, arr in zip(_PLAN_ARRAYS, (block_ids, src_tier, src_slot, dst_tier, dst_slot,
                                            session_idx, logical_idx)):
            arr.setflags(write=False)
            put(plan, name, arr)
        put(plan, "session_names", session_names)
        if kept is None or not kept.any():
            kept = _NO_KEPT
        else:
            kept.setflags(write=False)
        put(plan, "kept", kept)
        return plan

    @classmethod
    def empty(cls, epoch: int) -> MovePlan:
        z = np.zeros(0, dtype=np.int64)
        return cls(epoch, z, z, z, z, z, z, z)

    @property
    def num_moves(self) -> int:
        return len(self.block_ids)

    def mask(self, src: Tier, dst: Tier) -> np.ndarray:
        return (self.src_tier == src) & (self.dst_tier == dst)

    def kept_mask(self) -> np.ndarray:
        """kept as one flag per move (all False when the plan keeps none)."""
        return self.kept if len(self.kept) else np.zeros(self.num_moves, dtype=np.bool_)

    @property
    def num_kept(self) -> int:
        return int(np.count_nonzero(self.kept))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _PLAN_ARRAYS}
        out["epoch"] = self.epoch
        out["session_names"] = list(self.session_names)
        if len(self.kept):
            out["kept"] = self.kept.astype(np.uint8)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MovePlan:
        try:
            return cls(epoch=int(d["epoch"]), session_names=tuple(d["session_names"]),
                       kept=d.get("kept", _NO_KEPT), **{name: d[name] for name in _PLAN_ARRAYS})
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(f"plan message is missing or mistypes a field: {exc}") from exc


@dataclass(frozen=True)
class MoveResult:
    """What one rank reports after applying one plan."""

    epoch: int
    rank: int
    moves_applied: int
    slot_map_digest: int
    status: int = 0  # 0 ok; otherwise a failure code
    miss_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_ssd_read: int = 0
    bytes_ssd_write: int = 0
    elapsed_ns: int = 0
    # The epoch below which this rank's spills (background L2 -> L3 writes) had all written
    # when it ran the plan, so read their L2 slots no more; 0: not reported
    spills_written_below: int = 0
    spill_write_bytes_per_s: int = 0  # the disk's write rate its spills measured (0: none)
