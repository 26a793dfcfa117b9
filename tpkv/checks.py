"""Field checks of the config dataclasses: a bad value is a ConfigError naming field and value."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

from tpkv.errors import ConfigError


def _fail(name: str, what: str, value: Any) -> ConfigError:
    return ConfigError(f"{name} must be {what}, got {value!r}")


def check_int(name: str, value: Any, lo: int = 1, hi: int | None = None) -> None:
    """An integer (not a bool, not a float) with lo <= value (<= hi)."""
    if lo == 1 and hi is None:
        what = "a positive integer"
    elif hi is None:
        what = f"an integer >= {lo}"
    else:
        what = f"an integer in {lo}..{hi}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, what, value)
    if int(value) < lo or (hi is not None and int(value) > hi):
        raise _fail(name, what, value)


def check_float(name: str, value: Any, lo: float = 0.0, hi: float = math.inf, *,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """A finite real number (int or float, not a bool or str) in the interval lo..hi, each end
    closed unless said open. NaN and +-inf never pass (hi=inf only means no upper bound)."""
    left = "(" if lo_open else "["
    right = ")" if hi_open or math.isinf(hi) else "]"
    what = f"a finite number in {left}{lo:g}, {hi:g}{right}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, what, value)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(name, what, value)
    if v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
        raise _fail(name, what, value)


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(name, "True or False", value)


def check_choice(name: str, value: Any, choices: Iterable[str]) -> None:
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise _fail(name, "one of " + ", ".join(options), value)


def check_str(name: str, value: Any, *, optional: bool = False, empty: bool = True) -> None:
    """A str (None too when optional; an empty one only when empty)."""
    if value is None and optional:
        return
    what = "a string" + (" or None" if optional else "") + ("" if empty else ", not empty")
    if not isinstance(value, str) or (not empty and not value):
        raise _fail(name, what, value)


def check_type(name: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise _fail(name, f"a {kind.__name__}", value)


def check_watermarks(tier: str, high: Any, low: Any) -> None:
    """Both finite numbers in (0, 1] and low < high."""
    check_float(f"{tier} high_watermark", high, 0.0, 1.0, lo_open=True)
    check_float(f"{tier} low_watermark", low, 0.0, 1.0, lo_open=True)
    if not low < high:
        raise ConfigError(f"{tier} watermarks need 0 < low < high <= 1, got low={low} "
                          f"high={high}")
