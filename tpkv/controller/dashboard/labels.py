"""Plain-language text the page shows: the geometry, the rates (measured or configured), and
each tier's slots split into categories that add up to its total."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# the snapshot's rates: key, name on the page, unit
RATES = (("h2d_bytes_per_s", "h2d", "L2\u2192L1", "B/s"),
         ("ssd_read_bytes_per_s", "ssd_read", "L3\u2192L2", "B/s"),
         ("prefill_tokens_per_s", "prefill", "prefill", "tokens/s"))


def sig3(x: float) -> str:
    """Three significant digits, no exponent, no trailing zeros: 0.0025, 12.3, 1230."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    text = f"{round(x, decimals):.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def size(n: float) -> str:
    """Bytes in binary units, three significant digits: 2 MiB, 1.5 KiB, 512 B."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{sig3(n)} {units[i]}"


def rate(x: float, unit: str) -> str:
    """A rate in decimal units (B/s: kB/s, MB/s, GB/s; tokens/s: k, M), three digits."""
    steps: tuple[tuple[float, str], ...]
    if unit == "B/s":
        steps = ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s"), (1.0, "B/s"))
    else:
        steps = ((1e6, "M tokens/s"), (1e3, "k tokens/s"), (1.0, "tokens/s"))
    for scale, name in steps:
        if abs(x) >= scale:
            return f"{sig3(x / scale)} {name}"
    return f"{sig3(x)} {steps[-1][1]}"


def geometry_text(info: Mapping[str, Any]) -> str | None:
    """'32 layers x 8 KV heads x 128 dims, bfloat16, 16 tokens/block, TP 2: 2 MiB per block
    per rank' from the dashboard's info (None without a geometry)."""
    g = info.get("geometry")
    if not isinstance(g, Mapping):
        return None
    try:
        text = (f"{int(g['num_layers'])} layers x {int(g['num_kv_heads'])} KV heads x "
                f"{int(g['head_dim'])} dims, {g.get('dtype', '?')}, "
                f"{int(g['block_tokens'])} tokens/block, TP {int(g.get('tp_size', 1))}")
    except (KeyError, TypeError, ValueError):
        return None
    block = info.get("block_bytes")
    if isinstance(block, (int, float)) and block > 0:
        text += f": {size(float(block))} per block per rank (K and V)"
    return text


def rates(snapshot: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each rate of the cost model, with whether the workers' reports measured it: until a
    first sample it is the configured start value (PolicyConfig), not a measurement."""
    raw = snapshot.get("rates") or {}
    samples = raw.get("samples") or {}
    out: dict[str, dict[str, Any]] = {}
    for key, name, label, unit in RATES:
        value = raw.get(key)
        n = int(samples.get(name, 0) or 0)
        shown = rate(float(value), unit) if isinstance(value, (int, float)) else "-"
        out[name] = {"label": label, "value": value, "unit": unit, "samples": n,
                     "measured": n > 0,
                     "text": (f"{shown} (measured, {n} sample{'s' if n != 1 else ''})" if n
                              else f"{shown} (configured, not yet measured)")}
    return out


def accounting(tiers: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tier's slots as parts that add up to them: used + free (+ on L3 the records that
    are not blocks, and room held until the ranks apply the last step). `rest` is what no
    category explains (0 unless the snapshot lacks one)."""
    out: dict[str, dict[str, Any]] = {}
    for name in ("L1", "L2", "L3"):
        t = tiers.get(name)
        if not isinstance(t, Mapping) or not t.get("enabled", True):
            continue
        try:
            slots, used, free = int(t["slots"]), int(t["used"]), int(t["free"])
        except (KeyError, TypeError, ValueError):  # a snapshot without the counts
            continue
        parts = [("used", used, "blocks of open sessions"),
                 ("free", free, "room a plan may fill")]
        if name == "L2" and t.get("kept_copies"):
            parts[1] = ("free", free, f"room a plan may fill, {t['kept_copies']} of it copies "
                                      f"of L1 blocks given back on demand")
        if name == "L3":
            parts.append(("other records", int(t.get("other_records") or 0),
                          "copies of blocks loaded back and dead records: room until their "
                          "segment is deleted"))
            parts.append(("held", int(t.get("held") or 0),
                          "freed, held until the ranks have applied the step that freed it"))
        rest = slots - sum(n for _, n, _ in parts)
        if rest:
            parts.append(("unexplained", rest, "slots no category counts"))
        out[name] = {"slots": slots, "parts": [{"name": k, "blocks": n, "what": w}
                                                for k, n, w in parts], "rest": rest,
                     "text": " + ".join(f"{n} {k}" for k, n, _ in parts if n or k in (
                         "used", "free")) + f" = {slots} slots"}
    return out
