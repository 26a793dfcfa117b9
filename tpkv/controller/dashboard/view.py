"""The /api/snapshot payload: the controller's snapshot plus what the page derives from it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tpkv.controller.dashboard import labels
from tpkv.controller.dashboard.recorder import Recorder

BlocksFn = Callable[[str], Mapping[str, Any]]
# Tier codes of the heat map: one character per cell; "." past the end of a session.
_CODE = {"none": 0, "L1": 1, "L2": 2, "L3": 3}
_CODE_NAMES = ("none", "L1", "L2", "L3")
_DIGITS = np.frombuffer(b"0123456789", dtype="S1")


def jsonable(value: Any) -> Any:
    """numpy scalars and arrays to Python, non-finite floats to None, keys to str."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value: Any) -> str:
    return json.dumps(jsonable(value), allow_nan=False, separators=(",", ":"))


def _row_from_blocks(blocks: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Tier codes and heat of a session's blocks: from "tier_code" (0 none, 1-3 L1-L3, as
    Capture.blocks gives them) or else from the tier names of "tier" (session_blocks)."""
    if "tier_code" in blocks:
        codes = np.clip(np.asarray(blocks["tier_code"], dtype=np.int8).reshape(-1), 0, 3)
    else:
        names = np.asarray(blocks.get("tier", []), dtype=object)
        codes = np.zeros(len(names), dtype=np.int8)
        for name, code in _CODE.items():
            codes[names == name] = code
    heat = np.asarray(blocks.get("heat", []), dtype=np.float64).reshape(-1)
    if len(heat) != len(codes):
        heat = np.zeros(len(codes))
    return codes, np.nan_to_num(heat, nan=0.0, posinf=0.0, neginf=0.0)


def _row_from_counts(session: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    tiers = session.get("tiers", {})
    codes = np.concatenate([np.full(int(tiers.get(name, 0)), _CODE[name], dtype=np.int8)
                            for name in ("L1", "L2", "L3", "none")])
    heat = float(session.get("heat") or 0.0)
    return codes, np.full(len(codes), heat if math.isfinite(heat) else 0.0)


def _cells(codes: np.ndarray, heat: np.ndarray, k: int, columns: int,
           max_heat: float) -> tuple[str, str]:
    """Majority tier and hottest block of each run of k positions, as two strings."""
    n = columns * k
    padded = np.full(n, -1, dtype=np.int8)
    padded[:min(len(codes), n)] = codes[:n]
    hot = np.zeros(n)
    hot[:min(len(heat), n)] = heat[:n]
    grid = padded.reshape(columns, k)
    counts = np.stack([(grid == c).sum(axis=1) for c in range(4)], axis=1)  # [columns, 4]
    empty = counts.sum(axis=1) == 0
    level = np.clip(np.floor(hot.reshape(columns, k).max(axis=1) / max_heat * 9.999), 0, 9)
    tiers = _DIGITS[counts.argmax(axis=1)]
    heats = _DIGITS[level.astype(np.int64)]
    tiers[empty] = heats[empty] = b"."
    return tiers.tobytes().decode(), heats.tobytes().decode()


def heatmap(sessions: list[Mapping[str, Any]], blocks_fn: BlocksFn | None,
            max_rows: int = 48, max_columns: int = 160) -> dict[str, Any]:
    """Blocks by session (rows, the snapshot's order: most recently run first) and position
    (columns, `blocks_per_cell` positions each), coloured by tier, with heat 0-9 per cell.

    Rows come from `blocks_fn` (Controller.session_blocks) where it answers; otherwise from the
    session's tier counts, in tier order (`exact` false: positions unknown)."""
    rows, exact = [], []
    for s in sessions[:max_rows]:
        name = str(s.get("session", ""))
        try:
            if blocks_fn is None:
                raise LookupError("no per-block source")
            rows.append(_row_from_blocks(blocks_fn(name)))
            exact.append(True)
        except Exception:  # a session closed meanwhile, or no source: fall back to counts
            rows.append(_row_from_counts(s))
            exact.append(False)
    longest = max((len(c) for c, _ in rows), default=0)
    columns = max(1, min(longest, max_columns))
    k = max(1, math.ceil(longest / columns))
    columns = max(1, math.ceil(longest / k))
    max_heat = max((float(h.max()) for _, h in rows if len(h)), default=0.0) or 1.0
    cells = [_cells(c, h, k, columns, max_heat) for c, h in rows]
    counts = {name: 0 for name in ("L1", "L2", "L3", "none")}
    for codes, _ in rows:
        for code, n in zip(*np.unique(codes, return_counts=True)):
            counts[_CODE_NAMES[int(code)]] += int(n)
    return {"sessions": [str(s.get("session", "")) for s in sessions[:max_rows]],
            "blocks": [len(c) for c, _ in rows], "exact": exact, "columns": columns,
            "blocks_per_cell": k, "tiers": [t for t, _ in cells], "heat": [h for _, h in cells],
            "max_heat": max_heat if rows else None, "counts": counts,
            "rows_shown": len(rows), "rows_total": len(sessions)}


def payload(snapshot: Mapping[str, Any], recorder: Recorder | None,
            blocks_fn: BlocksFn | None, info: Mapping[str, Any],
            with_heatmap: bool = True) -> dict[str, Any]:
    """The snapshot as the controller gave it, and under "dashboard" the derived parts."""
    out = dict(snapshot)
    sessions = list(snapshot.get("sessions", []))
    ranks = snapshot.get("ranks", {}) or {}
    derived: dict[str, Any] = {
        "info": dict(info), "heatmap": heatmap(sessions, blocks_fn) if with_heatmap else None,
        "geometry_text": labels.geometry_text(info), "rates": labels.rates(snapshot),
        "accounting": labels.accounting(snapshot.get("tiers") or {})}
    if recorder is not None:
        derived["now_s"] = recorder.clock()
        derived["traffic"] = recorder.traffic()
        derived["consistency"] = recorder.consistency(ranks)
    else:
        derived["now_s"] = snapshot.get("uptime_s")
        derived["traffic"] = None
        derived["consistency"] = None
    out["dashboard"] = derived
    return out
