"""Dashboard in headless Chromium: the numbers of /api/snapshot, escaping, token, screenshot."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tpkv.controller.dashboard import DashboardServer, ServerThread
from tpkv.controller.dashboard.demo import DemoState, build_demo

pytestmark = pytest.mark.timeout(120)
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HOSTILE = ['<img src=x onerror="window.__xss=1">', "<script>window.__xss=2</script>",
           '"><svg onload="window.__xss=3">']


def need_browser() -> None:
    """Skip without Chromium or Playwright, except under CI, where that is a failure."""
    missing = None if os.path.exists(CHROMIUM) else f"{CHROMIUM} is missing"
    if missing is None:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed"
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing}; .ci/run installs Debian's chromium and tpkv[test] playwright")
    if missing:
        pytest.skip(missing)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:  # launch() gives Chromium a fresh temporary profile
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def start(state: DemoState | None, snapshot_fn: Any = None, token: str | None = None) -> Any:
    info: dict[str, Any] = {}
    if state is not None:
        g = state.ctl.config.geometry
        info = {"geometry": dataclasses.asdict(g), "block_bytes": g.block_bytes,
                "tp_size": g.tp_size}
    server = DashboardServer(snapshot_fn or state.ctl.snapshot,  # type: ignore[union-attr]
                             recorder=state.recorder if state else None,
                             blocks_fn=state.ctl.session_blocks if state else None, port=0,
                             capture_fn=state.ctl.capture if state else None,  # as the actor
                             token=token, info=info, sample_interval_s=None,
                             cache_s=60.0)  # one frame: the page and the test see the same
    thread = ServerThread(server)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoState:
    return build_demo(str(tmp_path_factory.mktemp("ssd")))


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(url)
    return page, problems


def cells(page: Any, selector: str) -> list[list[str]]:
    return page.eval_on_selector_all(
        selector, "rows => rows.map(r => [...r.cells].map(c => c.textContent))")


def test_page_shows_the_numbers_of_the_api(browser: Any, demo: DemoState, tmp_path: Path) -> None:
    thread = start(demo)
    try:
        page, problems = open_page(browser, thread.url)
        page.wait_for_selector("#status.live")
        with urllib.request.urlopen(thread.url + "api/snapshot", timeout=10) as r:
            api = json.load(r)
        assert page.evaluate("window.tpkvDashboard.data()") == api  # what it rendered
        d, n = api["dashboard"], len(api["sessions"])
        assert page.text_content("#h-epoch") == str(api["epoch"]["committed"])
        assert page.text_content("#h-sessions") == str(api["num_sessions"])
        for rank in api["ranks"]:
            for tier in ("L1", "L2", "L3"):
                t = api["tiers"][tier]
                got = page.text_content(f'#tier-table tr[data-rank="{rank}"] '
                                        f'td[data-tier="{tier}"] .num')
                assert got == f"{t['used']} / {t['slots']}"
        health = page.text_content("#health-list")
        assert f"{api['epoch']['committed']} / {api['epoch']['next']}" in health
        assert f"{api['plan_latency_us']['p99'] / 1e3:.2f}" in health
        rows = cells(page, "#session-table tbody tr")
        assert len(rows) == n >= 20
        for row, s in zip(rows, api["sessions"]):
            t, cost = s["tiers"], s["cost"]
            assert row[:3] == [s["session"], str(s["tokens"]), str(s["blocks"])]
            assert row[4:8] == [str(t["L1"]), str(t["L2"]), str(t["L3"]), str(t["none"])]
            assert float(row[8]) == pytest.approx(s["heat"], abs=6e-4)
            assert row[9] == str(s["last_run_tick"])
            assert row[12] == {"none": "all in L1"}.get(cost["choice"], cost["choice"])
            assert float(row[13]) == pytest.approx(cost["load_s"] * 1e3, abs=6e-3)
        assert {r[12] for r in rows} == {"load", "recompute"}
        # the count above the table names the rows in view, and that many are in view
        box = page.evaluate("""() => { const b = document.getElementById('session-scroll')
            .getBoundingClientRect(), h = document.querySelector('#session-table thead')
            .getBoundingClientRect(); return [Math.max(b.top, h.bottom), b.bottom]; }""")
        in_view = [r for r in page.eval_on_selector_all(
            "#session-table tbody tr", "rows => rows.map(r => { const b = "
            "r.getBoundingClientRect(); return [b.top, b.bottom]; })")
            if r[0] >= box[0] - 1 and r[1] <= box[1] + 1]
        count = page.text_content("#session-count")
        assert 0 < len(in_view) < n  # the box scrolls: not every row is in view
        assert f"rows 1\u2013{len(in_view)} of {n} in view" in count, count
        assert f"{api['num_sessions']} open" in count
        page.eval_on_selector("#session-scroll", "b => { b.scrollTop = b.scrollHeight; }")
        page.wait_for_timeout(100)
        assert f"\u2013{n} of {n} in view" in page.text_content("#session-count")
        page.eval_on_selector("#session-scroll", "b => { b.scrollTop = 0; }")
        # the y axis labels read differently, in a unit the values need
        for chart in ("#chart-moves", "#chart-bytes"):
            ticks = page.get_attribute(chart, "data-ticks").split("|")
            assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), ticks
        unit = page.get_attribute("#chart-bytes", "data-unit")
        assert page.text_content("#bytes-caption") == f"{unit} (all ranks)"
        peak = max(v for vals in d["traffic"]["bytes_per_s"].values() for v in vals)
        scale = {"GB/s": 1e9, "MB/s": 1e6, "kB/s": 1e3, "B/s": 1}[unit]
        assert 1 <= peak / scale < 1000 or unit == "B/s"
        axes = page.evaluate("""() => [0.01, 9e6, 7.5e8, 2.2e9, 0].map((y) => {
            const a = window.tpkvCharts.axis(y, [[1e9, "GB/s"], [1e6, "MB/s"], [1e3, "kB/s"],
                                                 [1, "B/s"]]); return [a.unit, a.labels]; })""")
        assert axes[0] == ["B/s", ["0.0000", "0.0025", "0.0050", "0.0075", "0.0100"]]
        assert axes[1] == ["MB/s", ["0.0", "2.5", "5.0", "7.5", "10.0"]]
        assert axes[2] == ["MB/s", ["0", "200", "400", "600", "800"]]
        assert axes[3] == ["GB/s", ["0", "1", "2", "3"]]
        for _, labels in axes:
            assert len(set(labels)) == len(labels), labels
        # plain text where JSON was, and rates that say whether they were measured
        footer = page.text_content("#footer")
        assert d["geometry_text"] in footer and "{" not in footer
        assert "layers x" in d["geometry_text"] and "per block per rank" in d["geometry_text"]
        health = page.text_content("#health-list")
        for rate in d["rates"].values():
            assert rate["text"] in health
        assert "(configured, not yet measured)" in health  # the demo measures no L3 read
        assert "(measured, " in health  # its prefill reports
        for tier, acc in d["accounting"].items():
            assert page.text_content(f'#tier-accounting [data-tier="{tier}"]') == (
                f"{tier}: {acc['text']}")
            assert sum(p["blocks"] for p in acc["parts"]) == acc["slots"] and acc["rest"] == 0
        assert {k for s in api["sessions"] for k in ("L1", "L2", "L3") if s["tiers"][k]} == {
            "L1", "L2", "L3"}  # a realistic state: sessions in every tier
        page.fill("#search", "rag-")
        shown = [r[0] for r in cells(page, "#session-table tbody tr")]
        assert shown == [s["session"] for s in api["sessions"] if "rag-" in s["session"]]
        page.fill("#search", "")
        page.click('#session-table th[data-key="blocks"]')
        blocks = [int(r[2]) for r in cells(page, "#session-table tbody tr")]
        assert blocks == sorted(blocks, reverse=True) and len(blocks) == n
        page.click('#session-table th[data-key="blocks"]')
        assert [int(r[2]) for r in cells(page, "#session-table tbody tr")] == sorted(blocks)
        tr = d["traffic"]
        for row in cells(page, "#traffic-table tbody tr"):
            k = row[0]
            assert row[1] == f"{tr['latest']['moves_per_s'][k]:.1f}"
            assert row[3] == str(tr["totals"]["moves"][k]) and tr["totals"]["moves"][k] > 0
        for chart in ("#chart-moves", "#chart-bytes"):
            assert page.get_attribute(chart, "data-points") == str(len(tr["t_s"]))
        # the L1->L2 line is drawn in its colour (#d1453b)
        red = page.evaluate("""() => { const c = document.getElementById('chart-moves');
            const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let i = 0; i < px.length; i += 4) if (Math.abs(px[i] - 209) < 8 &&
              Math.abs(px[i + 1] - 69) < 8 && Math.abs(px[i + 2] - 59) < 8) n++; return n; }""")
        assert red > 100
        hm = d["heatmap"]
        for tier, count in hm["counts"].items():
            assert page.text_content(f'#heat-legend [data-tier="{tier}"] .count') == str(count)
        assert page.get_attribute("#heat-canvas", "data-rows") == str(hm["rows_shown"])
        ranks = cells(page, "#rank-table tbody tr")
        assert [(r[0], r[1], r[2], r[4]) for r in ranks] == [
            (str(r["rank"]), r["host"], str(r["confirmed_epoch"]), str(r["mismatches"]))
            for r in d["consistency"]["ranks"]]
        summary = page.text_content("#consistency-summary")
        assert f"mismatches{d['consistency']['mismatches']} (last: epoch" in summary
        assert len(cells(page, "#event-table tbody tr")) == len(api["events"])
        page.click('#session-table th[data-key="blocks"]')  # third click: the snapshot's order
        assert [r[0] for r in cells(page, "#session-table tbody tr")] == [
            s["session"] for s in api["sessions"]]
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert (tmp_path / "dashboard.png").stat().st_size > 50_000
        if os.environ.get("TPKV_DASHBOARD_SCREENSHOT"):  # how docs/dashboard.png is made
            shutil.copy(tmp_path / "dashboard.png", os.environ["TPKV_DASHBOARD_SCREENSHOT"])
        assert problems == []
    finally:
        thread.stop()


def test_strings_from_the_controller_are_escaped(browser: Any, demo: DemoState) -> None:
    snap = json.loads(json.dumps(demo.ctl.snapshot()))
    for s, bad in zip(snap["sessions"], HOSTILE):
        s["session"] = bad
    snap["ranks"] = {"0": HOSTILE[2], "1": HOSTILE[0]}
    snap["events"].append({"t_s": 1.0, "tick": 1, "kind": HOSTILE[1], "session": HOSTILE[0]})
    thread = start(None, lambda: snap)
    try:
        page, problems = open_page(browser, thread.url)
        page.wait_for_selector("#status.live")
        page.wait_for_timeout(300)
        assert page.evaluate("window.__xss") is None
        assert page.evaluate("document.querySelectorAll('img, svg, iframe, script:not([src])')"
                             ".length") == 0
        names = [r[0] for r in cells(page, "#session-table tbody tr")][:3]
        assert names == HOSTILE
        assert page.text_content('#tier-table tr[data-rank="0"] td:nth-child(2)') == HOSTILE[2]
        assert HOSTILE[1] in page.text_content("#event-table")
        assert problems == []
    finally:
        thread.stop()


def test_page_asks_for_the_token(browser: Any, demo: DemoState) -> None:
    thread = start(demo, token="tok-123")
    try:
        page, _ = open_page(browser, thread.url)
        page.wait_for_selector("#token-box:not([hidden])")
        assert page.text_content("#status") == "token needed"
        page.fill("#token-input", "tok-123")
        page.click("#token-button")
        page.wait_for_selector("#status.live")
        page2, _ = open_page(browser, thread.url + "#token=tok-123")
        page2.wait_for_selector("#status.live")
        assert "tok-123" not in page2.url  # taken out of the address bar
    finally:
        thread.stop()


def test_idle_page_keeps_the_last_sessions(browser: Any, tmp_path: Path) -> None:
    state = build_demo(str(tmp_path), num_sessions=14, num_steps=50)
    thread = start(state)  # one frame until cache_s is lowered below: no capture races this
    try:
        page, problems = open_page(browser, thread.url)
        page.wait_for_selector("#status.live")
        page.wait_for_selector("#session-table tbody tr")
        names = [r[0] for r in cells(page, "#session-table tbody tr")]
        assert page.is_hidden("#sessions-kept") and len(names) >= 10
        for name in names:
            state.ctl.close_session(name)
        state.clock.advance(30.0)  # no step for 30 s
        thread.server.frames.cache_s = 0.0  # the next request builds a frame of this state
        page.evaluate("window.tpkvDashboard.refresh()")
        page.wait_for_selector("#status.idle")
        assert page.text_content("#status").startswith("idle since ")
        assert page.text_content("#h-sessions") == "0"
        # the last sessions stay in view, said to be so
        assert [r[0] for r in cells(page, "#session-table tbody tr")] == names
        note = page.text_content("#sessions-kept")
        assert note.startswith("No session is open now.") and f"the {len(names)} sessions" in note
        assert page.is_visible("#heat-kept")
        assert page.get_attribute("#heat-canvas", "data-rows") == str(len(names))
        # confirmations read as clock times, not as a growing "ago"
        confirmed = [r[3] for r in cells(page, "#rank-table tbody tr")]
        assert confirmed and all(c.startswith("at ") for c in confirmed), confirmed
        page.screenshot(path=str(tmp_path / "idle.png"), full_page=True)
        assert problems == []
    finally:
        thread.stop()
