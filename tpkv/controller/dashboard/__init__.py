"""The controller's read-only dashboard: live page, /api/snapshot JSON, /metrics (Prometheus).

`DashboardServer` serves from a thread of its own (`ServerThread`; the actor's from a child
process, `process.ServerProcess`) and reads the controller only
through callables (`Controller.capture`, or `Controller.snapshot` and `session_blocks`), called
on the controller's loop at most once per `cache_s` (`FrameCache`), never per request; with
`capture` only a copy is taken there and the page is made from it off that loop. `Recorder`
keeps the series the snapshot lacks (moves and bytes per direction, per-rank confirmations),
fed by the actor on each commit and resync. `docs/dashboard.md` describes the page and the rules.
"""

from tpkv.controller.dashboard.frames import Frame, FrameCache
from tpkv.controller.dashboard.guard import Guard
from tpkv.controller.dashboard.metrics import MetricSpec, collect, prometheus_text
from tpkv.controller.dashboard.recorder import DIRECTIONS, Recorder
from tpkv.controller.dashboard.server import DashboardServer
from tpkv.controller.dashboard.thread import ServerThread

__all__ = ["DIRECTIONS", "DashboardServer", "Frame", "FrameCache", "Guard", "MetricSpec",
           "Recorder", "ServerThread", "collect", "prometheus_text"]
