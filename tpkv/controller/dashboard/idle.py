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
    """The sessions (and heat map) of the last payload that had open sessions: a payload with
    none gets them as `dashboard.last_active`, with when they were seen, so the page keeps
    something to look at after a workload closed them all. Kept by the server that renders the
    frames (so from its frames only: at least one every export interval, 5 s)."""

    def __init__(self) -> None:
        self.kept: dict[str, Any] | None = None

    def update(self, out: dict[str, Any], t_unix: float) -> None:
        derived = out.setdefault("dashboard", {})
        if out.get("num_sessions"):
            self.kept = {"t_unix_s": round(t_unix, 3), "tick": out.get("tick"),
                         "num_sessions": out.get("num_sessions"),
                         "sessions": out.get("sessions", []), "heatmap": derived.get("heatmap")}
            derived["last_active"] = None
        else:
            derived["last_active"] = self.kept

    def finish(self, out: dict[str, Any], t_unix: float) -> None:
        """Both: the payload's `dashboard.activity` and `dashboard.last_active`."""
        out.setdefault("dashboard", {})["activity"] = activity(out, t_unix)
        self.update(out, t_unix)
