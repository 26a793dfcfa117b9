"""tpkv's dashboard of one vLLM instance: the scheduler side's figures as /api/snapshot.

With `dashboard_port` set (ConnectorOptions), the scheduler-side connector serves tpkv's
DashboardServer from a thread of vLLM's scheduler process, on 127.0.0.1 unless
`dashboard_host` says otherwise, read-only, its data behind the optional bearer token. The
snapshot (`kind: "vllm"`) carries what the scheduler knows: its prefix index, the counters of
what vLLM asked and got (ConnectorCounters), and each rank's store as its last report said.
Nothing here reads the network but HTTP GETs of the page; no worker is asked anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tpkv.integrations.vllm.options import ConnectorOptions
from tpkv.integrations.vllm.planner import Planner

if TYPE_CHECKING:
    from tpkv.controller.dashboard.thread import ServerThread

log = logging.getLogger(__name__)


def snapshot(planner: Planner, info: dict[str, Any]) -> dict[str, Any]:
    """The page's data: the index, the counters, the ranks' figures, and `info` (block size
    and bytes, ranks, whether a disk tier is on). Safe to call from another thread."""
    counts = planner.counters.snapshot()
    index, stats = planner.index, planner.index.stats
    return {
        "kind": "vllm", "uptime_s": counts["uptime_s"], "last_step_s": counts["last_step_s"],
        "tick": counts["steps"], "num_sessions": 0, "sessions": [],
        "vllm": {
            **info,
            "index": {"blocks": index.num_stored, "pending": index.num_pending,
                      "capacity": index.capacity_blocks, "written": stats.confirmed,
                      "deduplicated": stats.deduplicated, "evicted": stats.evicted,
                      "forgotten": stats.forgotten},
            "counters": counts["counters"], "ranks": counts["ranks"]}}


class ConnectorDashboard:
    """The running dashboard of one scheduler-side connector (`start` binds, `stop` ends)."""

    def __init__(self, planner: Planner, options: ConnectorOptions, info: dict[str, Any]
                 ) -> None:
        assert options.dashboard_port is not None
        from tpkv.controller.dashboard.server import DashboardServer
        from tpkv.controller.dashboard.thread import ServerThread

        server = DashboardServer(lambda: snapshot(planner, info), host=options.dashboard_host,
                                 port=options.dashboard_port, token=options.dashboard_token,
                                 info={"source": "vllm"}, sample_interval_s=None)
        self.thread: ServerThread = ServerThread(server)
        self.url = ""

    def start(self) -> str:
        """Bind and serve; the URL. OSError when the port is taken (it names the port)."""
        try:
            self.url = self.thread.start()
        except OSError as exc:  # the server's own hint names the controller's settings
            why = str(exc.strerror or exc).split("; choose another port")[0]
            raise OSError(exc.errno, f"tpkv vLLM dashboard on {self.thread.server.host}:"
                                     f"{self.thread.server.port}: {why}; set another "
                                     f"dashboard_port in kv_connector_extra_config (0: any "
                                     f"free port)") from exc
        log.info("tpkv dashboard of this vLLM instance at %s%s", self.url,
                 " (bearer token needed)" if self.thread.server.token else "")
        return self.url

    def stop(self) -> None:
        self.thread.stop()
