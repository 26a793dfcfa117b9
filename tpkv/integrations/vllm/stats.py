"""The connector's figures for the dashboard: each rank's store, and the scheduler's counters."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import Any

from tpkv.integrations.vllm.plan import RankFigures, StepReport
from tpkv.integrations.vllm.store import HostBlockStore


def rank_figures(rank: int, store: HostBlockStore) -> RankFigures:
    """What `store` holds now (on the worker; the copier sends it when it changed)."""
    writer, disk = store.writer, store.disk
    queued = store.num_pending
    with store.lock:
        disk_blocks = len(disk) if disk is not None else 0
        disk_bytes = disk.used_bytes if disk is not None else 0
        dropped = (writer.num_dropped, writer.bytes_dropped, writer.peak_needed_bytes
                   ) if writer is not None else (0, 0, 0)
    return RankFigures(
        rank=rank, block_bytes=store.block_bytes, host_blocks=len(store) + queued,
        host_bytes=store.used_bytes, host_capacity_bytes=store.capacity_bytes,
        queued_blocks=queued, disk_enabled=disk is not None, disk_blocks=disk_blocks,
        disk_bytes=disk_bytes,
        disk_capacity_bytes=disk.capacity_bytes if disk is not None else 0,
        dropped_blocks=dropped[0], dropped_bytes=dropped[1], needed_queue_bytes=dropped[2],
        pinned_bytes=store.slots.pool.pinned_bytes)


class ConnectorCounters:
    """The scheduler side's running figures: what vLLM asked and got (per request it
    scheduled: its tokens, those vLLM's own prefix cache held, those tpkv loaded), loads that
    failed (their tokens recomputed), blocks loaded from disk, and each rank's latest
    RankFigures. Updated on vLLM's scheduler thread, read by the dashboard's (one lock)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._lock = threading.Lock()
        self.started_s = time.monotonic()
        self.last_step_s: float | None = None
        self.steps = 0
        self.lookups = 0
        self.prompt_tokens = 0
        self.vllm_cached_tokens = 0
        self.hit_tokens = 0
        self.recomputed_tokens = 0
        self.failed_load_blocks = 0
        self.disk_hit_blocks = 0
        self._ranks: dict[int, tuple[int, RankFigures]] = {}  # rank -> (step, figures)

    def allocated(self, prompt_tokens: int, vllm_cached: int, loaded: int) -> None:
        """vLLM scheduled a request: `prompt_tokens` tokens, `vllm_cached` of them in its own
        prefix cache, `loaded` more from tpkv."""
        with self._lock:
            self.lookups += 1
            self.prompt_tokens += prompt_tokens
            self.vllm_cached_tokens += vllm_cached
            self.hit_tokens += loaded

    def step(self) -> None:
        with self._lock:
            self.steps += 1
            self.last_step_s = time.monotonic()

    def reported(self, report: StepReport, recomputed_blocks: int, failed_blocks: int,
                 disk_blocks: int) -> None:
        """A step's merged report, with what the planner made of it: blocks of loads vLLM
        recomputes (from a request's first failed block to the end of its load), of them the
        blocks that failed, and blocks loaded from disk before a request's first failure."""
        with self._lock:
            self.recomputed_tokens += recomputed_blocks * self.block_tokens
            self.failed_load_blocks += failed_blocks
            self.disk_hit_blocks += disk_blocks
            for rank, figures in report.figures.items():
                self._ranks[rank] = (self.steps, figures)

    def snapshot(self) -> dict[str, Any]:
        """The counters and, by rank, its latest figures (with the step that brought them)."""
        with self._lock:
            hit, prompt = self.hit_tokens, self.prompt_tokens
            ranks = [dict(asdict(f), reported_step=step)
                     for _, (step, f) in sorted(self._ranks.items())]
            counters = {
                "lookups": self.lookups, "prompt_tokens": prompt,
                "vllm_cached_tokens": self.vllm_cached_tokens, "hit_tokens": hit,
                "hit_rate": hit / prompt if prompt else None,
                "disk_hit_tokens": self.disk_hit_blocks * self.block_tokens,
                "saved_prefill_tokens": hit - self.recomputed_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "failed_load_blocks": self.failed_load_blocks,
                "disk_queue_dropped_blocks": sum(r["dropped_blocks"] for r in ranks),
                "disk_queue_dropped_bytes": sum(r["dropped_bytes"] for r in ranks)}
            now = time.monotonic()
            return {"uptime_s": now - self.started_s, "steps": self.steps,
                    "last_step_s": None if self.last_step_s is None
                    else self.last_step_s - self.started_s,
                    "counters": counters, "ranks": ranks}
