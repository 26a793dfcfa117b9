"""The payload's numbers as metrics: Prometheus text for /metrics, and a list for Ray's metrics."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Sample = tuple[tuple[str, ...], float]


@dataclass
class MetricSpec:
    """One metric family: name (counters without `_total`), kind, help, label names, samples."""

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()
    samples: list[Sample] = field(default_factory=list)


def _f(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class _Builder:
    def __init__(self) -> None:
        self.specs: list[MetricSpec] = []

    def add(self, name: str, kind: Literal["gauge", "counter"], help_text: str,
            labels: tuple[str, ...] = (), samples: list[tuple[tuple[str, ...], Any]] | None = None,
            value: Any = None) -> None:
        clean: list[Sample] = []
        for label_values, raw in samples if samples is not None else [((), value)]:
            number = _f(raw)
            if number is not None:
                clean.append((label_values, number))
        self.specs.append(MetricSpec(name, kind, help_text, labels, clean))


def collect(payload: Mapping[str, Any]) -> list[MetricSpec]:
    """Every metric the dashboard exports, from one /api/snapshot payload."""
    b = _Builder()
    tiers = {k: v for k, v in (payload.get("tiers") or {}).items() if k != "none"}
    t = ("tier",)
    b.add("tpkv_tier_slots", "gauge", "Slots (blocks) of a tier, per rank", t,
          [((k,), v.get("slots")) for k, v in tiers.items()])
    b.add("tpkv_tier_used_blocks", "gauge", "Blocks held in a tier, per rank", t,
          [((k,), v.get("used")) for k, v in tiers.items()])
    b.add("tpkv_tier_occupancy_ratio", "gauge", "Used over slots of a tier", t,
          [((k,), v.get("occupancy")) for k, v in tiers.items()])
    b.add("tpkv_tier_watermark_ratio", "gauge", "High and low watermarks of a tier",
          ("tier", "mark"), [((k, m), v.get(f"{m}_watermark")) for k, v in tiers.items()
                             for m in ("high", "low")])
    b.add("tpkv_tier_draining", "gauge", "1 while a tier drains from high to low watermark", t,
          [((k,), int(bool(v.get("draining")))) for k, v in tiers.items()])
    b.add("tpkv_l2_kept_copies", "gauge",
          "L2 slots holding copies of L1 blocks (a demotion into one copies nothing)",
          value=(payload.get("tiers") or {}).get("L2", {}).get("kept_copies"))
    b.add("tpkv_l3_other_records", "gauge",
          "L3 records that are not blocks in L3: copies of blocks loaded back, and dead ones",
          value=(payload.get("tiers") or {}).get("L3", {}).get("other_records"))
    b.add("tpkv_unplaced_blocks", "gauge", "Blocks in no tier (recomputed when next needed)",
          value=(payload.get("tiers") or {}).get("none", {}).get("blocks"))
    b.add("tpkv_sessions", "gauge", "Open sessions", value=payload.get("num_sessions"))
    epoch = payload.get("epoch") or {}
    b.add("tpkv_epoch_committed", "gauge", "Last committed plan epoch",
          value=epoch.get("committed"))
    b.add("tpkv_epoch_next", "gauge", "Epoch the next plan gets", value=epoch.get("next"))
    b.add("tpkv_plans_pending", "gauge", "Plans sent, not yet confirmed by every rank",
          value=epoch.get("num_pending"))
    b.add("tpkv_controller_restarts", "gauge", "Times the controller actor restarted",
          value=payload.get("restarts"))
    b.add("tpkv_controller_awaiting_rebuild", "gauge", "1 until a restarted controller rebuilt",
          value=int(bool(payload.get("awaiting_rebuild"))))
    b.add("tpkv_controller_uptime_seconds", "gauge", "Seconds since the controller started",
          value=payload.get("uptime_s"))
    b.add("tpkv_controller_tick", "gauge", "Steps scheduled", value=payload.get("tick"))
    lat = payload.get("plan_latency_us") or {}
    b.add("tpkv_plan_latency_seconds", "gauge", "Time to plan one step, recent steps",
          ("stat",), [((k,), None if lat.get(k) is None else lat[k] / 1e6)
                      for k in ("p50", "p99", "max")])
    rates = payload.get("rates") or {}
    b.add("tpkv_link_bytes_per_second", "gauge", "Measured per-rank bandwidth (moving average)",
          ("link",), [(("h2d",), rates.get("h2d_bytes_per_s")),
                      (("ssd_read",), rates.get("ssd_read_bytes_per_s"))])
    b.add("tpkv_prefill_tokens_per_second", "gauge", "Measured prefill speed (moving average)",
          value=rates.get("prefill_tokens_per_s"))
    table = payload.get("table") or {}
    b.add("tpkv_table_live_blocks", "gauge", "Rows in use in the block table",
          value=table.get("live_blocks"))
    b.add("tpkv_table_metadata_bytes", "gauge", "Bytes of the controller's arrays",
          value=table.get("metadata_bytes"))
    b.add("tpkv_ranks_registered", "gauge", "TP ranks registered with the controller",
          value=len(payload.get("ranks") or {}))
    dash = payload.get("dashboard") or {}
    if dash.get("snapshot_unix_s") is not None:  # served from a cache: how old it is
        b.add("tpkv_dashboard_snapshot_timestamp_seconds", "gauge",
              "Unix time the served snapshot was taken", value=dash["snapshot_unix_s"])
    if dash.get("snapshot_hold_s") is not None:
        b.add("tpkv_dashboard_snapshot_hold_seconds", "gauge",
              "How long taking the served snapshot held the controller's loop",
              value=dash["snapshot_hold_s"])
    traffic = dash.get("traffic")
    if traffic:
        totals = traffic["totals"]
        d = ("direction",)
        b.add("tpkv_moves", "counter", "Block moves in committed plans", d,
              [((k,), v) for k, v in totals["moves"].items()])
        b.add("tpkv_moved_bytes", "counter", "Bytes moved in committed plans, all ranks", d,
              [((k,), v) for k, v in totals["bytes"].items()])
        b.add("tpkv_plans_committed", "counter", "Plans committed", value=totals["plans"])
        b.add("tpkv_read_misses", "counter", "Blocks lost to failed reads",
              value=totals["misses"])
    cons = dash.get("consistency")
    if cons:
        r = ("rank",)
        b.add("tpkv_rank_confirmed_epoch", "gauge", "Last epoch a rank confirmed", r,
              [((str(x["rank"]),), x["confirmed_epoch"]) for x in cons["ranks"]])
        b.add("tpkv_rank_mismatches", "counter", "All-gathers where a rank disagreed", r,
              [((str(x["rank"]),), x["mismatches"]) for x in cons["ranks"]])
        b.add("tpkv_mismatches", "counter", "Epochs with a slot-map mismatch",
              value=cons["mismatches"])
        b.add("tpkv_resyncs", "counter", "Resyncs from the controller's table",
              value=cons["resyncs"])
    if isinstance(payload.get("vllm"), Mapping):
        _vllm(b, payload["vllm"])
    return b.specs


def _vllm(b: _Builder, v: Mapping[str, Any]) -> None:
    """A vLLM instance's figures (tpkv.integrations.vllm.dashboard)."""
    c = v.get("counters") or {}
    for key, help_text in (("lookups", "Requests vLLM scheduled and asked tpkv about"),
                           ("prompt_tokens", "Prompt tokens of those requests"),
                           ("hit_tokens", "Prompt tokens loaded from tpkv"),
                           ("disk_hit_tokens", "Prompt tokens loaded from tpkv's disk tier"),
                           ("saved_prefill_tokens", "Prompt tokens loaded and not recomputed"),
                           ("recomputed_tokens", "Tokens of failed loads, recomputed by vLLM"),
                           ("disk_queue_dropped_blocks", "Blocks a full disk write queue gave up")):
        b.add(f"tpkv_vllm_{key}", "counter", help_text, value=c.get(key))
    b.add("tpkv_vllm_hit_ratio", "gauge", "Hit tokens over prompt tokens", value=c.get("hit_rate"))
    ranks = [r for r in v.get("ranks") or [] if isinstance(r, Mapping)]
    rt, names = ("rank", "tier"), ("host", "disk")
    b.add("tpkv_vllm_tier_blocks", "gauge", "Blocks a rank holds in a tier", rt,
          [((str(r.get("rank")), t), r.get(f"{t}_blocks")) for r in ranks for t in names])
    b.add("tpkv_vllm_tier_bytes", "gauge", "Bytes a rank holds in a tier", rt,
          [((str(r.get("rank")), t), r.get(f"{t}_bytes")) for r in ranks for t in names])
    b.add("tpkv_vllm_pinned_bytes", "gauge", "Host bytes a rank holds pinned for copies",
          ("rank",), [((str(r.get("rank")),), r.get("pinned_bytes")) for r in ranks])
    b.add("tpkv_vllm_index_blocks", "gauge", "Blocks the scheduler's prefix index holds",
          value=(v.get("index") or {}).get("blocks"))


class _Collector:
    def __init__(self, specs: list[MetricSpec]) -> None:
        self.specs = specs

    def collect(self) -> Iterator[Metric]:
        for spec in self.specs:
            fam: Metric
            if spec.kind == "counter":
                fam = CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
            else:
                fam = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
            for labels, value in spec.samples:
                fam.add_metric(list(labels), value)
            yield fam


def prometheus_text(specs: list[MetricSpec]) -> bytes:
    """Prometheus text exposition format (0.0.4) of the given metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(specs))  # type: ignore[arg-type]
    return generate_latest(registry)
