"""L3Reader: a plan's L3 -> L2 moves as read jobs on the store's readers, and their outcome."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from tpkv.errors import SsdError, TierFullError, WaitTimeoutError
from tpkv.protocol.plan import MovePlan
from tpkv.ssd.store import SsdStore
from tpkv.workers.outcome import ExecOutcome
from tpkv.workers.pools import HostPool

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 32 << 20  # an L3 read job's share of a session
ReadJobs = list[tuple[np.ndarray, Future[Any]]]  # (the moves of each job, its future)


def by_session(session_idx: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """`idx` split by session (session_idx[idx]), each part in plan order, the sessions in the
    order of their first row."""
    if len(idx) == 0:
        return []
    sessions = session_idx[idx]
    order = np.argsort(sessions, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(sessions[order])) + 1)
    groups.sort(key=lambda g: int(g[0]))  # (stable: each group's first is its first row)
    return [idx[g] for g in groups]


def plan_sessions(plan: MovePlan, mask: np.ndarray) -> set[str]:
    """Names of the sessions of the plan's moves in `mask`."""
    return {plan.session_names[s] for s in set(plan.session_idx[mask].tolist())}


class L3Reader:
    """Submits a plan's L3 -> L2 moves to the store's readers and collects what they read;
    holds no state between plans. `await_manifest(name, deadline)` is called before a
    session's reads are submitted (SpillTracker.await_manifest)."""

    def __init__(self, store: SsdStore, host: HostPool, block_bytes: int, timeout_s: float,
                 await_manifest: Callable[[str, float], None]) -> None:
        self.store, self.host = store, host
        self.block_bytes, self.timeout_s = block_bytes, timeout_s
        self.await_manifest = await_manifest

    def submit(self, plan: MovePlan, idx: np.ndarray, deadline: float) -> ReadJobs:
        """The plan's L3 -> L2 moves `idx` as read jobs on the store's readers: (the moves of
        each job, its future)."""
        jobs: ReadJobs = []
        for part in by_session(plan.session_idx, np.asarray(idx, dtype=np.int64)):
            name = plan.session_names[int(plan.session_idx[part[0]])]
            logical = plan.logical_idx[part]
            # views made on the store's thread, not here (the step's forward waits for this)
            views = self.host.block_views(plan.dst_slot[part])
            self.await_manifest(name, deadline)
            # A session's reads in chunks across the store's threads: one thread reading and
            # checking a whole session reached about half the disk's speed.
            step = max(1, READ_CHUNK_BYTES // self.block_bytes)
            for at in range(0, len(part), step):
                jobs.append((part[at:at + step], self.store.submit_read(
                    name, logical[at:at + step], views[at:at + step])))
        return jobs

    def collect(self, plan: MovePlan, jobs: ReadJobs, out: ExecOutcome, deadline: float,
                on_loaded: Callable[[np.ndarray], None] | None = None) -> None:
        """Wait for the plan's read jobs; their hits are done, their misses reported; with
        `on_loaded`, it is called after each job read, with the mask of the plan's moves loaded
        with a hit so far (PlanExecutor issues the chained moves of those)."""
        block_bytes = self.block_bytes
        misses: list[np.ndarray] = []
        loaded = np.zeros(plan.num_moves, dtype=bool)
        for part, fut in jobs:
            try:
                result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise WaitTimeoutError(
                    f"epoch {plan.epoch}: L3 read of {len(part)} blocks not done after "
                    f"{self.timeout_s:g} s") from None
            except (SsdError, TierFullError, OSError) as exc:
                out.error = out.error or f"epoch {plan.epoch}: L3 read failed: {exc}"
                log.error("%s", out.error)
                continue
            out.done[part] = True
            hits = np.asarray(result, dtype=bool)
            misses.append(plan.block_ids[part[~hits]])
            out.bytes_ssd_read += int(hits.sum()) * block_bytes
            if on_loaded is not None:
                loaded[part[hits]] = True
                on_loaded(loaded)
        if misses:
            out.misses = np.concatenate(misses).astype(np.int64)
