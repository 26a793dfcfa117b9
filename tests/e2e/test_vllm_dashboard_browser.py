"""A vLLM instance's dashboard (TpkvConnector's dashboard_port) in headless Chromium: the page
shows its ranks' tiers and counters as /api/snapshot has them, the controller's sections hidden,
and a hostile model name as text."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_dashboard_browser import browser, cells, open_page  # noqa: F401
from tests.unit.test_vllm_dashboard import INFO, two_turns  # noqa: F401
from tpkv.integrations.vllm.dashboard import ConnectorDashboard
from tpkv.integrations.vllm.options import ConnectorOptions

pytestmark = pytest.mark.timeout(120)


def test_the_page_shows_a_vllm_instance(browser: Any, two_turns: Any,  # noqa: F811
                                        tmp_path: Path) -> None:
    planner, copier, _ = two_turns
    (step, figures), = planner.counters._ranks.values()  # as a rank on a GPU reports it
    planner.counters._ranks[0] = (step, dataclasses.replace(figures, pinned_bytes=3 << 20))
    info = dict(INFO, model='<img src=x onerror="window.__xss=1">')
    dash = ConnectorDashboard(planner, ConnectorOptions.from_extra({"dashboard_port": 0}), info)
    url = dash.start()
    try:
        page, problems = open_page(browser, url)
        page.wait_for_selector("#vllm-tier-table tbody tr[data-rank]")
        with urllib.request.urlopen(url + "api/snapshot", timeout=10) as r:
            api = json.load(r)
        v = api["vllm"]
        assert page.evaluate("window.tpkvDashboard.data()")["vllm"] == v
        assert page.is_visible("#vllm") and not page.is_visible("#tiers")
        assert not page.is_visible("#sessions") and not page.is_visible("#heatmap")
        assert page.text_content("#h-kind") == "vLLM connector"
        assert page.text_content("#h-tick") == str(api["tick"])
        (row,) = cells(page, "#vllm-tier-table tbody tr")
        rank = v["ranks"][0]
        assert row[0] == "0" and row[1].startswith(f"{rank['host_blocks']} blocks, ")
        assert row[1].endswith(", 3.0 MiB pinned")
        assert row[2].startswith(f"{rank['disk_blocks']} blocks, ") and row[3] == "0"
        assert row[4] == str(rank["reported_step"])
        counters = page.text_content("#vllm-counters")
        c = v["counters"]
        assert f"loaded from tpkv (hits){c['hit_tokens']} tokens (" in counters
        assert f"prefill saved{c['saved_prefill_tokens']} tokens" in counters
        assert f"of them from disk{c['disk_hit_tokens']} tokens" in counters
        assert f"The scheduler's index holds {v['index']['blocks']} blocks" in page.text_content(
            "#vllm-note")
        assert info["model"] in page.text_content("#vllm-sub")  # as text, not markup
        assert page.evaluate("window.__xss") is None
        page.screenshot(path=str(tmp_path / "vllm.png"), full_page=True)
        assert problems == []
    finally:
        dash.stop()
