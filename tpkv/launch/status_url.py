"""`tpkv status --url`: a dashboard's /api/snapshot over HTTP (JSON), a vLLM one as tables."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

MAX_BYTES = 32 << 20  # a snapshot larger than this is refused


def fetch_snapshot(url: str, token: str | None = None, timeout_s: float = 10.0
                   ) -> dict[str, Any]:
    """GET `url`/api/snapshot (with the bearer token: `token`, else TPKV_DASHBOARD_TOKEN) and
    parse its JSON; OSError or ValueError, with the URL in the message, when that fails."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"dashboard URL {url!r} must start with http:// or https://")
    token = token or os.environ.get("TPKV_DASHBOARD_TOKEN") or None
    req = urllib.request.Request(base + "/api/snapshot",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        hint = " (set --token or TPKV_DASHBOARD_TOKEN)" if exc.code == 401 else ""
        raise OSError(f"{base}/api/snapshot answered HTTP {exc.code}{hint}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise OSError(f"{base}/api/snapshot: {getattr(exc, 'reason', exc)}") from exc
    if len(body) > MAX_BYTES:
        raise ValueError(f"{base}/api/snapshot sent more than {MAX_BYTES} bytes")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError(f"{base}/api/snapshot sent a {type(data).__name__}, not an object")
    return data


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def render_vllm_status(payload: Mapping[str, Any], console: Console,
                       url: str | None = None) -> None:
    """A vLLM instance's dashboard payload (kind "vllm") as tables."""
    v = payload.get("vllm") or {}
    c, ix = v.get("counters") or {}, v.get("index") or {}
    rate = c.get("hit_rate")
    console.print(Text(
        f"tpkv vLLM connector: {v.get('model')}, {v.get('num_ranks')} ranks, step "
        f"{payload.get('tick')}, index {ix.get('blocks')} of {ix.get('capacity')} blocks"
        + (f"\ndashboard: {url}" if url else "")))
    tiers = Table(title="blocks per rank and tier", title_justify="left", title_style="bold")
    for col in ("rank", "host blocks", "host bytes", "queued", "disk blocks", "disk bytes",
                "queue drops", "as of step"):
        tiers.add_column(col, justify="right")
    for r in v.get("ranks") or []:
        disk = r.get("disk_enabled")
        tiers.add_row(str(r.get("rank")), str(r.get("host_blocks")), _size(r.get("host_bytes")),
                      str(r.get("queued_blocks")), str(r.get("disk_blocks")) if disk else "off",
                      _size(r.get("disk_bytes")) if disk else "-", str(r.get("dropped_blocks")),
                      str(r.get("reported_step")))
    console.print(tiers)
    counts = Table(title="what vLLM asked and got", title_justify="left", title_style="bold")
    counts.add_column("counter", justify="left")
    counts.add_column("value", justify="right")
    for name, value in (
            ("requests looked up", c.get("lookups")), ("prompt tokens", c.get("prompt_tokens")),
            ("in vLLM's own prefix cache", c.get("vllm_cached_tokens")),
            ("hit tokens (loaded from tpkv)", c.get("hit_tokens")),
            ("hit rate", "-" if not isinstance(rate, (int, float)) else f"{rate:.1%}"),
            ("of them from disk", c.get("disk_hit_tokens")),
            ("prefill tokens saved", c.get("saved_prefill_tokens")),
            ("loads failed (blocks)", c.get("failed_load_blocks")),
            ("tokens recomputed", c.get("recomputed_tokens")),
            ("disk queue drops (blocks)", c.get("disk_queue_dropped_blocks"))):
        counts.add_row(name, str(value))
    console.print(counts)
