"""The vLLM connector's dashboard without vLLM: the snapshot's figures (tiers per rank, hits,
saved prefill, failed loads), the ranks' figures in the step reports, the HTTP server behind
its token, `tpkv status --url`, and the options."""

from __future__ import annotations

import argparse
import io
import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from tests.unit.test_vllm_disk_tier import BT, RECORD, SEED, SHAPE, caches
from tpkv.errors import ConfigError
from tpkv.integrations.prefix_index import extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.dashboard import ConnectorDashboard, snapshot
from tpkv.integrations.vllm.options import ConnectorOptions, DiskSpec
from tpkv.integrations.vllm.plan import RankFigures, StepReport
from tpkv.integrations.vllm.planner import Planner
from tpkv.launch.status_cli import add_status_commands
from tpkv.launch.status_url import fetch_snapshot, render_vllm_status

pytestmark = pytest.mark.timeout(60)
BLOCK = SHAPE[0] * SHAPE[1]
INFO = {"model": "tiny", "block_tokens": BT, "block_bytes": BLOCK, "num_ranks": 1,
        "disk_tier": True}


def turn(planner: Planner, copier: BlockCopier, req_id: str, prompt: list[int],
         block_ids: list[int]) -> int:
    """One request through the connector's calls, as vLLM makes them: lookup, alloc, plan,
    load, save, report. Its matched tokens."""
    req = SimpleNamespace(request_id=req_id, all_token_ids=prompt)
    matched = planner.matched_tokens(req, 0)
    planner.after_alloc(req, block_ids, matched)
    plan = planner.plan([(req_id, len(prompt))], lambda r: block_ids)
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    if report is not None:
        planner.report(report)
    planner.finished(req_id)
    return matched


@pytest.fixture
def two_turns(tmp_path: Path) -> tuple[Planner, BlockCopier, list[int]]:
    """Memory for 2 blocks, writes to disk on the step's path: turn 1 writes 4 blocks (2 go to
    disk), turn 2 (turn 1 and 8 more tokens) loads them, 2 of them from disk, and writes 2."""
    spec = DiskSpec(str(tmp_path), 8 * RECORD, SEED, BT, "test-model", queue_bytes=0)
    copier = BlockCopier(2 * BLOCK, spec)
    copier.register(caches(16, 0), 16)
    planner = Planner(BT, SEED, capacity_blocks=2 + 8)
    first = list(range(100, 100 + 4 * BT + 1))  # 4 full blocks and one token
    second = first + list(range(300, 300 + 2 * BT))  # 6 full blocks and one token
    assert turn(planner, copier, "t1", first, [0, 1, 2, 3, 4]) == 0
    assert turn(planner, copier, "t2", second, [5, 6, 7, 8, 9, 10, 11]) == 4 * BT
    return planner, copier, second


def test_the_snapshot_counts_hits_saved_prefill_and_tiers_as_the_store_holds_them(
        two_turns: Any) -> None:
    planner, copier, prompt = two_turns
    store = copier.store
    assert store is not None and store.disk is not None
    snap = snapshot(planner, INFO)
    assert snap["kind"] == "vllm" and snap["tick"] == 2 and snap["num_sessions"] == 0
    v = snap["vllm"]
    c = v["counters"]
    assert c["lookups"] == 2 and c["prompt_tokens"] == (4 * BT + 1) + len(prompt)
    assert c["hit_tokens"] == 4 * BT == c["saved_prefill_tokens"]
    assert c["hit_rate"] == pytest.approx(4 * BT / c["prompt_tokens"])
    assert c["disk_hit_tokens"] == 2 * BT  # blocks 0 and 1 were on disk
    assert c["recomputed_tokens"] == 0 == c["failed_load_blocks"]
    assert c["vllm_cached_tokens"] == 0 and c["disk_queue_dropped_blocks"] == 0
    assert v["index"]["blocks"] == 6 == len(store) + len(store.disk)
    assert v["index"]["written"] == 6 and v["index"]["capacity"] == 10
    (rank,) = v["ranks"]
    assert rank["rank"] == 0 and rank["reported_step"] == 2
    assert rank["host_blocks"] == len(store) == 2 and rank["host_bytes"] == 2 * BLOCK
    assert rank["disk_blocks"] == len(store.disk) == 4
    assert rank["disk_bytes"] == store.disk.used_bytes == 4 * RECORD
    assert rank["disk_capacity_bytes"] == 8 * RECORD and rank["disk_enabled"]
    assert json.loads(json.dumps(snap)) == snap  # plain JSON


def test_a_failed_load_counts_its_tokens_as_recomputed_not_saved(two_turns: Any) -> None:
    planner, copier, prompt = two_turns
    store = copier.store
    assert store is not None and store.disk is not None
    key0 = extend_chain([], prompt, BT, SEED)[0]
    path = Path(store.disk.path(key0))
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x01  # block 0's record fails its check: vLLM recomputes all 6 blocks
    path.write_bytes(bytes(raw))
    assert turn(planner, copier, "t3", prompt, [0, 1, 2, 3, 4, 5, 6]) == 6 * BT
    c = snapshot(planner, INFO)["vllm"]["counters"]
    assert c["hit_tokens"] == 4 * BT + 6 * BT and c["recomputed_tokens"] == 6 * BT
    assert c["saved_prefill_tokens"] == 4 * BT and c["failed_load_blocks"] == 1
    assert c["disk_hit_tokens"] == 2 * BT  # none of t3's: its first block failed


def test_a_rank_reports_its_figures_only_when_they_changed(two_turns: Any) -> None:
    planner, copier, _ = two_turns
    assert copier.take_report() is None  # nothing happened, nothing changed
    a = RankFigures(0, BLOCK, 1, BLOCK, 4 * BLOCK)
    b = RankFigures(1, BLOCK, 2, 2 * BLOCK, 4 * BLOCK, dropped_blocks=3, dropped_bytes=3 * BLOCK)
    merged = StepReport(figures={0: a}).merge(StepReport(figures={1: b}))
    assert merged.figures == {0: a, 1: b} and bool(StepReport(figures={1: b}))
    planner.report(merged)
    ranks = snapshot(planner, INFO)["vllm"]["ranks"]
    assert [r["host_blocks"] for r in ranks] == [1, 2] and ranks[1]["reported_step"] == 2
    c = snapshot(planner, INFO)["vllm"]["counters"]
    assert c["disk_queue_dropped_blocks"] == 3 and c["disk_queue_dropped_bytes"] == 3 * BLOCK


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_dashboard_serves_the_snapshot_on_loopback_behind_its_token(
        two_turns: Any) -> None:
    planner, _, _ = two_turns
    options = ConnectorOptions.from_extra({"dashboard_port": 0, "dashboard_token": "s3cret"})
    dash = ConnectorDashboard(planner, options, INFO)
    url = dash.start()
    try:
        assert url.startswith("http://127.0.0.1:") and dash.thread.server.host == "127.0.0.1"
        assert get(url + "api/snapshot")[0] == 401
        status, body = get(url + "api/snapshot", "s3cret")
        assert status == 200
        api = json.loads(body)
        assert api["kind"] == "vllm" and api["vllm"]["counters"]["hit_tokens"] == 4 * BT
        assert api["vllm"]["ranks"][0]["disk_blocks"] == 4
        assert api["dashboard"]["activity"]["state"] in ("live", "idle")
        status, metrics = get(url + "metrics", "s3cret")
        assert status == 200 and f"tpkv_vllm_hit_tokens_total {4.0 * BT}" in metrics.decode()
        assert 'tpkv_vllm_tier_blocks{rank="0",tier="disk"} 4.0' in metrics.decode()
        assert 'tpkv_vllm_pinned_bytes{rank="0"} 0.0' in metrics.decode()  # no GPU here
        status, page = get(url)  # the page itself needs no token; its data does
        assert status == 200 and b'id="vllm"' in page
        with pytest.raises(OSError, match="HTTP 401"):
            fetch_snapshot(url, None)
        out = io.StringIO()
        render_vllm_status(fetch_snapshot(url, "s3cret"), Console(file=out, width=160),
                           url=url)
        text = out.getvalue()
        assert re.search(rf"hit tokens \(loaded from tpkv\)\s+\S\s+{4 * BT}\s", text), text
        assert re.search(r"prefill tokens saved\s+\S\s+16\s", text)
        assert "index 6 of 10 blocks" in text and url in text
    finally:
        dash.stop()


def test_tpkv_status_url_prints_a_vllm_instance(two_turns: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    planner, _, _ = two_turns
    options = ConnectorOptions.from_extra({"dashboard_port": 0, "dashboard_token": "s3cret"})
    dash = ConnectorDashboard(planner, options, INFO)
    url = dash.start()
    ap = argparse.ArgumentParser(prog="tpkv")
    add_status_commands(ap.add_subparsers(dest="command", required=True))
    try:
        args = ap.parse_args(["status", "--url", url, "--token", "s3cret"])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        assert "tpkv vLLM connector: tiny, 1 ranks" in out and "prefill tokens saved" in out
        args = ap.parse_args(["status", "--url", url, "--json", "--token", "s3cret"])
        assert args.func(args) == 0
        assert json.loads(capsys.readouterr().out)["vllm"]["counters"]["hit_tokens"] == 4 * BT
        args = ap.parse_args(["status", "--url", url, "--token", "wrong"])
        assert args.func(args) == 1
        assert "answered HTTP 401 (set --token or TPKV_DASHBOARD_TOKEN)" in capsys.readouterr().err
    finally:
        dash.stop()


def test_a_taken_port_is_an_error_that_names_the_option(two_turns: Any) -> None:
    planner, _, _ = two_turns
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dash = ConnectorDashboard(planner, ConnectorOptions.from_extra({"dashboard_port": port}),
                                  INFO)
        with pytest.raises(OSError, match=f"127.0.0.1:{port}: .*set another dashboard_port"
                           ) as err:
            dash.start()
        assert "TPKV_DASHBOARD_PORT" not in str(err.value)  # the controller's setting
        dash.stop()


def test_dashboard_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ConnectorOptions.from_extra({}).dashboard_port is None  # off unless asked for
    opts = ConnectorOptions.from_extra({"dashboard_port": 8471})
    assert (opts.dashboard_port, opts.dashboard_host, opts.dashboard_token) == (
        8471, "127.0.0.1", None)
    monkeypatch.setenv("TPKV_DASHBOARD_TOKEN", "from-env")
    assert ConnectorOptions.from_extra({"dashboard_port": 0}).dashboard_token == "from-env"
    for bad in (True, "8471", -1, 65536):
        with pytest.raises(ConfigError, match="dashboard_port must be an int in 0..65535"):
            ConnectorOptions.from_extra({"dashboard_port": bad})
    with pytest.raises(ConfigError, match="dashboard_host is set but dashboard_port is not"):
        ConnectorOptions.from_extra({"dashboard_host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="dashboard_host"):
        ConnectorOptions.from_extra({"dashboard_port": 0, "dashboard_host": "http://x:1"})
    with pytest.raises(ConfigError, match="dashboard_token"):
        ConnectorOptions.from_extra({"dashboard_port": 0, "dashboard_token": "has space"})
