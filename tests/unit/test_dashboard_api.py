"""Dashboard data: /api/snapshot JSON and /metrics text against a controller in a known state."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tpkv.controller import Controller, SlotMapReplica
from tpkv.controller.dashboard import DashboardServer, Recorder, ServerThread, view
from tpkv.protocol.messages import CommitOutcome
from tpkv.protocol.plan import MovePlan, MoveResult

pytestmark = pytest.mark.timeout(30)
NAMES = {0: "L1", 1: "L2", 2: "L3"}


def get(url: str, path: str, headers: dict[str, str] | None = None,
        method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    host, port = url.split("//")[1].strip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class Known:
    """A controller driven through steps by two fake ranks, its recorder fed as the actor
    feeds it, and the moves of every committed plan counted here independently."""

    def __init__(self, config: Any, clock: Any) -> None:
        self.c = Controller(config, clock, check_invariants=True)
        self.clock = clock
        g = config.geometry
        self.rec = Recorder(g.block_bytes * g.tp_size, self.c.now_s, window_s=60, interval_s=1)
        self.reps = [SlotMapReplica(r, 16, 32) for r in range(2)]
        self.moves: Counter[str] = Counter()
        for r in range(2):
            self.c.register_rank(r, g, host=f"host{r}")

    def step(self, batch: list[str], tokens: list[int]) -> None:
        res = self.c.schedule(batch, tokens)
        reports = [rep.apply_step(res) for rep in self.reps]
        for i, plan in enumerate(res.plans):
            head = self.c.pending[0].plan
            results = [rep[i] for rep in reports]
            outcome = self.c.commit(results)
            self.rec.on_commit(head, results, outcome)
            for s, d in zip(plan.src_tier.tolist(), plan.dst_tier.tolist()):
                self.moves[f"{NAMES[s]}->{NAMES[d]}"] += 1
        self.clock.advance(1.0)
        self.rec.sample()


@pytest.fixture
def known(make_config: Any, fake_clock: Any) -> Known:
    k = Known(make_config(), fake_clock)
    k.rec.sample()
    for name, tokens in (("a", 28), ("b", 16), ("c", 24), ("d", 20), ("e", 26), ("f", 22)):
        k.c.open_session(name, tokens)
    for batch in (["a", "b"], ["c"], ["d"], ["e"], ["f"], ["a"], ["b", "c"], ["a"], ["d"]):
        k.step(batch, [1] * len(batch))
    k.c.pin("a", 0, 2)
    return k


@pytest.fixture
def served(known: Known) -> Iterator[tuple[Known, str]]:
    g = known.c.config.geometry
    server = DashboardServer(known.c.snapshot, recorder=known.rec,
                             blocks_fn=known.c.session_blocks, port=0, sample_interval_s=None,
                             cache_s=0.0, info={"block_bytes": g.block_bytes, "tp_size": 2})
    with ServerThread(server) as thread:
        yield known, thread.url


def test_known_state_moved_blocks_in_every_direction(known: Known) -> None:
    assert all(known.moves[d] > 0 for d in ("L1->L2", "L2->L1", "L2->L3", "L3->L2"))


def test_snapshot_json_is_the_controllers_plus_derived(served: tuple[Known, str]) -> None:
    known, url = served
    status, headers, body = get(url, "/api/snapshot")
    assert status == 200 and headers["content-type"].startswith("application/json")
    data = json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    derived = data.pop("dashboard")
    assert data == json.loads(json.dumps(known.c.snapshot()))  # the fake clock stands still
    t = data["tiers"]
    blocks = sum(s["blocks"] for s in data["sessions"])
    assert t["L1"]["used"] + t["L2"]["used"] + t["L3"]["used"] + t["none"]["blocks"] == blocks
    assert data["num_sessions"] == 6 and data["ranks"] == {"0": "host0", "1": "host1"}
    traffic = derived["traffic"]
    block_bytes = known.c.config.geometry.block_bytes * 2
    assert traffic["totals"]["moves"] == {d: known.moves[d] for d in traffic["directions"]}
    assert traffic["totals"]["bytes"] == {d: known.moves[d] * block_bytes
                                          for d in traffic["directions"]}
    assert traffic["totals"]["plans"] == data["epoch"]["committed"]
    per_second = sum(sum(v) for v in traffic["moves_per_s"].values())
    assert per_second == pytest.approx(sum(known.moves.values()))  # 1 s apart: rates add up
    ranks = derived["consistency"]["ranks"]
    assert [(r["rank"], r["host"], r["confirmed_epoch"], r["mismatches"]) for r in ranks] == [
        (0, "host0", data["epoch"]["committed"], 0), (1, "host1", data["epoch"]["committed"], 0)]
    hm = derived["heatmap"]
    assert hm["blocks_per_cell"] == 1 and all(hm["exact"])
    assert hm["sessions"] == [s["session"] for s in data["sessions"]]
    for name, row in zip(hm["sessions"], hm["tiers"]):
        tiers = known.c.session_blocks(name)["tier"]
        code = {"L1": "1", "L2": "2", "L3": "3", "none": "0"}
        assert row.rstrip(".") == "".join(code[x] for x in tiers)
    assert hm["counts"] == {k: t[k]["used"] for k in ("L1", "L2", "L3")} | {
        "none": t["none"]["blocks"]}


def test_metrics_text_has_the_same_numbers(served: tuple[Known, str]) -> None:
    known, url = served
    status, headers, body = get(url, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    snap = known.c.snapshot()
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    for tier in ("L1", "L2", "L3"):
        assert got[("tpkv_tier_used_blocks", (("tier", tier),))] == snap["tiers"][tier]["used"]
        assert got[("tpkv_tier_slots", (("tier", tier),))] == snap["tiers"][tier]["slots"]
        high = snap["tiers"][tier]["high_watermark"]
        assert got[("tpkv_tier_watermark_ratio", (("mark", "high"), ("tier", tier)))] == high
    assert got[("tpkv_epoch_committed", ())] == snap["epoch"]["committed"]
    assert got[("tpkv_l2_kept_copies", ())] == snap["tiers"]["L2"]["kept_copies"]
    assert got[("tpkv_l3_other_records", ())] == snap["tiers"]["L3"]["other_records"]
    assert got[("tpkv_sessions", ())] == 6
    assert got[("tpkv_plans_committed_total", ())] == snap["epoch"]["committed"]
    for d, n in known.moves.items():
        assert got[("tpkv_moves_total", (("direction", d),))] == n
    assert got[("tpkv_rank_confirmed_epoch", (("rank", "1"),))] == snap["epoch"]["committed"]
    p99 = got[("tpkv_plan_latency_seconds", (("stat", "p99"),))]
    assert p99 == pytest.approx(snap["plan_latency_us"]["p99"] / 1e6)


def test_recorder_rates_window_and_mismatches(fake_clock: Any) -> None:
    rec = Recorder(1000, fake_clock, window_s=3, interval_s=1)
    z = np.zeros(4, dtype=np.int64)
    plan = MovePlan(1, np.arange(4), np.array([0, 0, 1, 2]), z, np.array([1, 1, 2, 1]), z, z, z,
                    session_names=("s",))
    ok = [MoveResult(1, r, 4, 0) for r in range(2)]
    rec.sample()
    rec.on_commit(plan, ok, CommitOutcome(1, True))
    fake_clock.advance(2.0)
    assert rec.sample() and not rec.sample()  # one sample per interval
    tr = rec.traffic()
    assert tr["t_s"] == [fake_clock.now]
    assert tr["latest"]["moves_per_s"] == {"L1->L2": 1.0, "L2->L1": 0.0, "L2->L3": 0.5,
                                           "L3->L2": 0.5}
    assert tr["latest"]["bytes_per_s"]["L1->L2"] == 1000.0
    for _ in range(10):
        fake_clock.advance(1.0)
        rec.sample()
    assert len(rec.samples) == 4  # window / interval + 1
    rec.on_commit(None, ok, CommitOutcome(2, False, (1,), resync_needed=True))
    rec.on_resync(2, 17)
    c = rec.consistency({"0": "h0", "1": "h1"})
    assert [(r["confirmed_epoch"], r["mismatches"]) for r in c["ranks"]] == [(2, 0), (1, 1)]
    assert c["mismatches"] == 1 and c["resyncs"] == 1
    assert c["last_mismatch"]["ranks"] == [1] and c["last_resync"]["blocks"] == 17
    assert [i["kind"] for i in c["incidents"]] == ["resync", "mismatch"]
    assert rec.traffic()["totals"]["plans"] == 1  # the mismatched epoch moved nothing counted


def test_heatmap_downsamples_and_falls_back_to_counts() -> None:
    long = {"tier": ["L1"] * 100 + ["L2"] * 200 + ["L3"] * 100, "heat": [1.0] * 400}
    sessions = [{"session": "long", "tiers": {"L1": 100, "L2": 200, "L3": 100}, "heat": 0.5},
                {"session": "gone", "tiers": {"L1": 1, "L3": 2, "none": 3}, "heat": 0.2}]

    def blocks(name: str) -> dict[str, Any]:
        if name == "gone":
            raise KeyError(name)
        return long

    hm = view.heatmap(sessions, blocks, max_columns=160)
    assert hm["blocks_per_cell"] == 3 and hm["columns"] == 134
    assert hm["tiers"][0].count("1") == 33 and hm["tiers"][0].endswith("3")
    assert hm["exact"] == [True, False] and hm["tiers"][1].rstrip(".") == "30"  # 1,3,3 and 0,0,0
    assert hm["counts"] == {"L1": 101, "L2": 200, "L3": 102, "none": 3}
    assert set(hm["heat"][0]) == {"9"}


def test_jsonable_and_errors() -> None:
    assert view.jsonable({"a": np.float32(1.5), 2: [math.nan, np.int64(3)],
                          "b": np.arange(2)}) == {"a": 1.5, "2": [None, 3], "b": [0, 1]}

    def broken() -> dict[str, Any]:
        raise RuntimeError("table is busy")

    with ServerThread(DashboardServer(broken, port=0, sample_interval_s=None)) as thread:
        status, _, body = get(thread.url, "/api/snapshot")
        assert status == 503 and json.loads(body)["message"] == "table is busy"
        status, _, body = get(thread.url, "/metrics")
        assert status == 503


def test_head_and_assets(served: tuple[Known, str]) -> None:
    _, url = served
    status, headers, body = get(url, "/api/snapshot", method="HEAD")
    assert status == 200 and body == b"" and headers["content-type"].startswith("application")
    for path, ctype in (("/", "text/html"), ("/static/app.js", "text/javascript"),
                        ("/static/charts.js", "text/javascript"), ("/static/style.css",
                                                                   "text/css")):
        status, headers, body = get(url, path)
        assert status == 200 and headers["content-type"].startswith(ctype) and body
    assert get(url, "/static/missing.js")[0] == 404
    html = get(url, "/")[2].decode()
    assert "http://" not in html and "https://" not in html  # no CDN: everything is local
