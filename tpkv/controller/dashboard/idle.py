"""Live or idle, and the last state that had sessions, kept for the page once none are open."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IDLE_AFTER_S = 10.0  # no step for this long: the page says idle, not live


def activity(snapshot: Mapping[str, Any], t_unix: float,
             idle_after_s: float = IDLE_AFTER_S) -> dict[str, Any]:
    """Whether the controller runs steps: "live" (a step started within `idle_after_s`),
    "idle" (none since `last_step_unix_s`), or "waiting" (no step yet). `t_unix` is the
    snapshot's time.time(), taken with its `uptime_s`."""
    now, last = snapshot.get("uptime_s"), snapshot.get("last_step_s")
    if not isinstance(now, (int, float)) or not isinstance(last, (int, float)):
        return {"state": "waiting", "idle_s": None, "last_step_unix_s": None,
                "idle_after_s": idle_after_s}
    idle_s = max(0.0, float(now) - float(last))
    return {"state": "idle" if idle_s >= idle_after_s else "live", "idle_s": round(idle_s, 3),
            "last_step_unix_s": round(t_unix - idle_s, 3), "idle_after_s": idle_after_s}


class LastActive:
    """What the page shows once no session is open: the sessions (and heat map) of the fullest
    payload (most open sessions) of the last `window_s` seconds before they all closed, as
    `dashboard.last_active`, with when it was seen. A workload closes its sessions one by one
    as it ends; the last payload with any may hold only one, the fullest of its last minute
    shows what ran. Kept by the server that renders the frames, so from its frames only (at
    least one every export interval, 5 s; one per `dashboard_cache_s` while a page is open)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.kept: dict[str, Any] | None = None

    def update(self, out: dict[str, Any], t_unix: float) -> None:
        derived = out.setdefault("dashboard", {})
        n = int(out.get("num_sessions") or 0)
        if not n:
            derived["last_active"] = self.kept
            return
        derived["last_active"] = None
        kept = self.kept
        if kept is None or n >= kept["num_sessions"] or t_unix - kept["t_unix_s"] > self.window_s:
            self.kept = {"t_unix_s": round(t_unix, 3), "tick": out.get("tick"),
                         "num_sessions": n, "sessions": out.get("sessions", []),
                         "heatmap": derived.get("heatmap")}

    def finish(self, out: dict[str, Any], t_unix: float) -> None:
        """Both: the payload's `dashboard.activity` and `dashboard.last_active`."""
        out.setdefault("dashboard", {})["activity"] = activity(out, t_unix)
        self.update(out, t_unix)
