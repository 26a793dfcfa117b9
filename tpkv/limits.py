"""Bounds on every count and index a caller hands tpkv, and the helpers that check them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tpkv.errors import ArgumentError, ArgumentTypeError

# Tokens of one session (cached, announced and added by a step, together). Its blocks, and
# their logical indices, then fit int32 (BlockTable.logical, SessionTable.counts) even at one
# token a block, and a step's sums over any batch fit int64 with room to spare.
MAX_SESSION_TOKENS = (1 << 31) - 1
# Block indices of a session (pin ranges, attention starts): at most one block a token.
MAX_SESSION_BLOCKS = MAX_SESSION_TOKENS
# Tokens a step reports as prefilled (Controller.report_prefill), over its whole batch.
MAX_STEP_TOKENS = 1 << 48
# Steps ahead a session is expected in (Controller.schedule's `upcoming`).
MAX_STEPS_AHEAD = 1 << 31


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def check_count(name: str, value: Any, limit: int, limit_name: str, low: int = 0) -> int:
    """`value` as a Python int if it is an int or numpy integer (not a bool) in low..limit;
    else ArgumentTypeError or ArgumentError naming `name`, the value and the bound."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer, got {type(value).__name__} "
                                f"{_shown(value)}")
    v = int(value)
    if not low <= v <= limit:
        sign = "negative, " if v < 0 <= low else ""
        raise ArgumentError(f"{name} got {v}, {sign}outside {low}..{limit} ({limit_name})")
    return v


def check_counts(name: str, values: Any, limit: int, limit_name: str,
                 negative_ok: bool = False) -> np.ndarray:
    """`values` (a sequence or array of integers, each in 0..limit) as a 1-D int64 array.
    `negative_ok`: entries < 0 pass (the caller names them better)."""
    if isinstance(values, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be integers, got {type(values).__name__} "
                                f"{_shown(values)}")
    try:
        arr = np.asarray(values).reshape(-1)
    except (TypeError, ValueError) as exc:  # ragged, or not array-like at all
        raise ArgumentTypeError(f"{name} must be integers, got {_shown(values)}: {exc}") from exc
    if arr.dtype.kind not in "iu" and not (len(arr) == 0 and arr.dtype.kind == "f"):
        raise ArgumentTypeError(f"{name} must be integers, got dtype {arr.dtype} "
                                f"({_shown(values)})")
    if len(arr) == 0:
        return np.zeros(0, dtype=np.int64)
    if not negative_ok and arr.dtype.kind == "i" and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ArgumentError(f"{name}[{i}] got {int(arr[i])}, negative, outside 0..{limit} "
                            f"({limit_name})")
    if arr.max() > limit:
        i = int(np.argmax(arr))
        raise ArgumentError(f"{name}[{i}] got {int(arr[i])}, outside 0..{limit} ({limit_name})")
    return arr.astype(np.int64)


def check_seconds(name: str, value: Any) -> float:
    """`value` as a float if it is a finite real number >= 0 (not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                       np.floating)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got "
                                f"{type(value).__name__} {_shown(value)}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ArgumentError(f"{name} got {v}, must be finite and >= 0")
    return v


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} "
                                f"{_shown(value)}")
    return bool(value)


def check_block_range(start: Any, stop: Any) -> tuple[int, int | None]:
    """A range [start, stop) of a session's blocks (stop None: to the end), start <= stop."""
    a = check_count("start", start, MAX_SESSION_BLOCKS, "MAX_SESSION_BLOCKS")
    if stop is None:
        return a, None
    z = check_count("stop", stop, MAX_SESSION_BLOCKS, "MAX_SESSION_BLOCKS")
    if a > z:
        raise ArgumentError(f"block range [{a}, {z}) has start > stop")
    return a, z
