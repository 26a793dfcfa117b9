"""Series the snapshot lacks: moves and bytes per direction over time, per-rank confirmations."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.protocol.messages import CommitOutcome
from tpkv.protocol.plan import MovePlan, MoveResult

TIER_NAMES = {0: "L1", 1: "L2", 2: "L3"}
# The four directions a plan moves blocks in (adjacent tiers only), in display order.
DIRECTIONS = ("L1->L2", "L2->L1", "L2->L3", "L3->L2")


@dataclass
class RankRecord:
    """What one rank last proved in the all-gather, and how often it disagreed."""

    confirmed_epoch: int = 0
    confirmed_t_s: float | None = None
    mismatches: int = 0
    last_mismatch_epoch: int | None = None
    last_mismatch_t_s: float | None = None


class StoppedClock:
    """A clock that always reads `t` (a frozen Recorder's; unlike a lambda, it pickles)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder:
    """Cumulative counters, fed by whoever calls `Controller.commit` / `resync` (the actor), and
    a ring buffer of samples of them, one per `interval_s`, for the page's traffic chart.

    `block_bytes_all_ranks` turns block moves into bytes (every rank moves its shard). `clock`
    gives seconds on the controller's time line (`Controller.now_s`), as events' `t_s` do.
    """

    def __init__(self, block_bytes_all_ranks: int, clock: Callable[[], float],
                 window_s: float = 300.0, interval_s: float = 1.0, max_incidents: int = 64) -> None:
        if not (interval_s > 0 and window_s >= interval_s):
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s}, {window_s}")
        self.block_bytes = int(block_bytes_all_ranks)
        self.clock = clock
        self.window_s = float(window_s)
        self.interval_s = float(interval_s)
        self.moves: dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.plans_committed = 0
        self.misses = 0
        self.mismatches = 0
        self.resyncs = 0
        self.ranks: dict[int, RankRecord] = {}
        self.incidents: deque[dict[str, Any]] = deque(maxlen=max_incidents)
        self.samples: deque[tuple[float, dict[str, int]]] = deque(
            maxlen=int(math.ceil(window_s / interval_s)) + 1)

    # ---- feeding -----------------------------------------------------------------------------
    def on_commit(self, plan: MovePlan | None, results: Sequence[MoveResult],
                  outcome: CommitOutcome) -> None:
        """One epoch's reports were taken; `plan` is the plan they confirm (the oldest pending
        one before the call). Ranks that reported the expected digest confirmed the epoch."""
        now = self.clock()
        bad = set(outcome.mismatch_ranks)
        for r in results:
            rec = self.ranks.setdefault(int(r.rank), RankRecord())
            if int(r.rank) in bad:
                rec.mismatches += 1
                rec.last_mismatch_epoch, rec.last_mismatch_t_s = outcome.epoch, now
            else:
                rec.confirmed_epoch, rec.confirmed_t_s = outcome.epoch, now
        self.misses += outcome.num_misses
        if bad:
            self.mismatches += 1
            self.incidents.append({"t_s": now, "kind": "mismatch", "epoch": outcome.epoch,
                                   "ranks": sorted(bad)})
        if outcome.committed:
            self.plans_committed += 1
            if plan is not None and plan.num_moves:
                self._count(plan)

    def on_resync(self, epoch: int, num_blocks: int) -> None:
        """The workers restore the controller's full map (after a mismatch)."""
        self.resyncs += 1
        self.incidents.append({"t_s": self.clock(), "kind": "resync", "epoch": int(epoch),
                               "blocks": int(num_blocks)})

    def _count(self, plan: MovePlan) -> None:
        pairs = plan.src_tier.astype(np.int64) * 3 + plan.dst_tier.astype(np.int64)
        keys, counts = np.unique(pairs, return_counts=True)
        for key, n in zip(keys.tolist(), counts.tolist()):
            name = f"{TIER_NAMES[key // 3]}->{TIER_NAMES[key % 3]}"
            self.moves[name] = self.moves.get(name, 0) + int(n)

    def sample(self, force: bool = False) -> bool:
        """Append the counters now if `interval_s` has passed since the last sample."""
        now = self.clock()
        if not force and self.samples and now - self.samples[-1][0] < self.interval_s * 0.999:
            return False
        self.samples.append((now, dict(self.moves)))
        return True

    def frozen(self) -> Recorder:
        """A copy of the counters and samples now, with its clock stopped here: its views are
        what this one's give now, on any thread, whatever is fed to this one meanwhile."""
        now = self.clock()
        out = copy.copy(self)
        out.clock = StoppedClock(now)  # picklable: the actor sends copies to its dashboard
        out.moves = dict(self.moves)
        out.ranks = {r: dataclasses.replace(rec) for r, rec in self.ranks.items()}
        out.incidents = deque(self.incidents, maxlen=self.incidents.maxlen)
        out.samples = deque(self.samples, maxlen=self.samples.maxlen)  # tuples, never changed
        return out

    # ---- views -------------------------------------------------------------------------------
    def traffic(self) -> dict[str, Any]:
        """Rates between consecutive samples: moves/s and bytes/s per direction."""
        pts = list(self.samples)
        names = list(self.moves)
        t_s: list[float] = []
        moves_ps: dict[str, list[float]] = {d: [] for d in names}
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            dt = t1 - t0
            if dt <= 0:
                continue
            t_s.append(round(t1, 6))
            for d in names:
                moves_ps[d].append(round((c1.get(d, 0) - c0.get(d, 0)) / dt, 6))
        bytes_ps = {d: [round(v * self.block_bytes, 3) for v in vals]
                    for d, vals in moves_ps.items()}
        return {
            "window_s": self.window_s, "interval_s": self.interval_s, "directions": names,
            "t_s": t_s, "moves_per_s": moves_ps, "bytes_per_s": bytes_ps,
            "latest": {"moves_per_s": {d: v[-1] if v else 0.0 for d, v in moves_ps.items()},
                       "bytes_per_s": {d: v[-1] if v else 0.0 for d, v in bytes_ps.items()}},
            "totals": {"moves": dict(self.moves),
                       "bytes": {d: n * self.block_bytes for d, n in self.moves.items()},
                       "plans": self.plans_committed, "misses": self.misses},
            "block_bytes_all_ranks": self.block_bytes,
        }

    def consistency(self, ranks: Mapping[str, str]) -> dict[str, Any]:
        """Per rank (registered or reporting): last confirmed epoch and mismatches, with times."""
        ids = sorted({int(r) for r in ranks} | set(self.ranks))
        rows = []
        for r in ids:
            rec = self.ranks.get(r, RankRecord())
            rows.append({"rank": r, "host": ranks.get(str(r), ""),
                         "confirmed_epoch": rec.confirmed_epoch,
                         "confirmed_t_s": rec.confirmed_t_s, "mismatches": rec.mismatches,
                         "last_mismatch_epoch": rec.last_mismatch_epoch,
                         "last_mismatch_t_s": rec.last_mismatch_t_s})
        last = {k: next((dict(i) for i in reversed(self.incidents) if i["kind"] == k), None)
                for k in ("mismatch", "resync")}
        return {"ranks": rows, "mismatches": self.mismatches, "resyncs": self.resyncs,
                "last_mismatch": last["mismatch"], "last_resync": last["resync"],
                "incidents": [dict(i) for i in reversed(self.incidents)]}
