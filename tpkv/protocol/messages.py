"""What the controller returns and receives (StepResult, CommitOutcome), as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from tpkv.errors import WireFormatError
from tpkv.protocol.plan import MovePlan, MoveResult

_I64 = np.int64
_EMPTY = np.zeros(0, dtype=np.int64)


def _arr(d: dict[str, Any], key: str, dtype: type = _I64) -> np.ndarray:
    value = d[key]
    if isinstance(value, np.ndarray):
        return value.astype(dtype, copy=False).reshape(-1)
    if isinstance(value, list):
        return np.asarray(value, dtype=dtype).reshape(-1)
    raise WireFormatError(f"field {key} must be an array, got {type(value).__name__}")


@dataclass(frozen=True)
class StepResult:
    """One step: apply, in this order, `released`, then for each plan i `drops[i]` and plan i,
    then `drops[-1]`, then the fresh L1 slots; then run the step with `block_table`.

    Every plan of a step must be applied (copies complete) before the step writes new KV.
    """

    tick: int
    session_ids: tuple[str, ...]  # the batch, in the order it was asked for
    num_tokens: np.ndarray  # [B] tokens of each session after this step
    block_offsets: np.ndarray  # [B + 1] into block_table
    block_table: np.ndarray  # L1 slot of every block of the batch, session by session
    plans: tuple[MovePlan, ...] = ()  # consecutive epochs
    released_block_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # closed sessions
    drops: tuple[np.ndarray, ...] = ()  # [len(plans) + 1] block ids that lost their copy
    fresh_block_ids: np.ndarray = field(default_factory=lambda: _EMPTY)  # new or recomputed
    fresh_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # their L1 slots
    fresh_session_idx: np.ndarray = field(default_factory=lambda: _EMPTY)  # into session_ids
    fresh_logical: np.ndarray = field(default_factory=lambda: _EMPTY)
    recompute_session_idx: np.ndarray = field(default_factory=lambda: _EMPTY)  # into session_ids
    recompute_start: np.ndarray = field(default_factory=lambda: _EMPTY)  # logical block ranges
    recompute_stop: np.ndarray = field(default_factory=lambda: _EMPTY)  # (exclusive)
    closed_sessions: tuple[str, ...] = ()  # workers drop their L3 files
    ssd_dropped_sessions: tuple[str, ...] = ()  # L3 records discarded (blocks recomputed)
    # Blocks the next step may copy into L2 (demotions, L3 reads) before the controller leaves
    # any L2 block unwritten because the disk is behind (-1: it never does): the tiered engine
    # admits a turn that starts a session with more K/V than this only when nothing else runs
    l2_room: int = -1

    def session_slots(self, i: int) -> np.ndarray:
        return self.block_table[self.block_offsets[i]:self.block_offsets[i + 1]]

    @property
    def num_moves(self) -> int:
        return sum(p.num_moves for p in self.plans)

    def detached(self) -> StepResult:
        """The same step with arrays of its own, for a caller in the controller's process
        (what to_dict + from_dict would give, without either: about 0.3 ms for a resume's
        step). Plans are shared: their arrays are made for each plan and read-only."""
        out = object.__new__(StepResult)
        out.__dict__.update(self.__dict__)
        for name in _STEP_ARRAYS:
            out.__dict__[name] = self.__dict__[name].copy()
        out.__dict__["drops"] = tuple(d.copy() for d in self.drops)
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "plans":
                value = [p.to_dict() for p in value]
            elif f.name == "drops":
                value = list(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        try:
            arrays = {f.name: _arr(d, f.name) for f in fields(cls)
                      if f.name not in ("tick", "session_ids", "plans", "drops",
                                        "closed_sessions", "ssd_dropped_sessions",
                                        "l2_room")}
            arrays["block_table"] = arrays["block_table"].astype(np.int32)
            return cls(
                tick=int(d["tick"]), session_ids=tuple(str(x) for x in d["session_ids"]),
                plans=tuple(MovePlan.from_dict(p) for p in d["plans"]),
                drops=tuple(np.asarray(x, dtype=_I64).reshape(-1) for x in d["drops"]),
                closed_sessions=tuple(str(x) for x in d["closed_sessions"]),
                ssd_dropped_sessions=tuple(str(x) for x in d["ssd_dropped_sessions"]),
                l2_room=int(d["l2_room"]), **arrays)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(f"step result is missing or mistypes a field: {exc}") from exc


_STEP_ARRAYS = ("num_tokens", "block_offsets", "block_table", "released_block_ids",
                "fresh_block_ids", "fresh_slots", "fresh_session_idx", "fresh_logical",
                "recompute_session_idx", "recompute_start", "recompute_stop")
assert set(_STEP_ARRAYS) == {f.name for f in fields(StepResult) if f.type == "np.ndarray"}


@dataclass(frozen=True)
class CommitOutcome:
    """The controller's answer to one epoch's reports."""

    epoch: int
    committed: bool  # every rank reported the expected digest and status 0
    mismatch_ranks: tuple[int, ...] = ()  # ranks whose digest or status disagreed
    num_misses: int = 0  # blocks that became Tier.NONE (recomputed when next needed)
    expected_digest: int = 0  # plan digest with no misses
    resync_needed: bool = False  # call Controller.resync() and restore the workers from it

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "committed": self.committed,
                "mismatch_ranks": list(self.mismatch_ranks), "num_misses": self.num_misses,
                "expected_digest": self.expected_digest, "resync_needed": self.resync_needed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommitOutcome:
        try:
            return cls(int(d["epoch"]), bool(d["committed"]),
                       tuple(int(r) for r in d["mismatch_ranks"]), int(d["num_misses"]),
                       int(d["expected_digest"]), bool(d["resync_needed"]))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(f"commit outcome is malformed: {exc}") from exc


def move_result_to_dict(r: MoveResult) -> dict[str, Any]:
    return {f.name: getattr(r, f.name) for f in fields(r)}


def move_result_from_dict(d: dict[str, Any]) -> MoveResult:
    if not isinstance(d, dict):
        raise WireFormatError(f"move result must be a map, got {type(d).__name__}")
    try:
        ints = {f.name: int(d[f.name]) for f in fields(MoveResult)
                if f.name != "miss_block_ids" and f.name in d}
        return MoveResult(miss_block_ids=_arr(d, "miss_block_ids") if "miss_block_ids" in d
                          else _EMPTY, **ints)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise WireFormatError(f"move result is malformed: {exc}") from exc
