"""Cost model: load a returning session from its tiers, or recompute it, whichever costs less."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tpkv.config import PolicyConfig
from tpkv.protocol.plan import MoveResult

_EMA = 0.2  # weight of a new measurement
_MIN_SAMPLE_BYTES = 1 << 20  # smaller transfers are dominated by latency, not bandwidth
_MIN_SAMPLE_TOKENS = 256
_STEP_GAPS = 32  # the step time is the median gap of this many recent steps
_IDLE_GAP_S = 1.0  # a longer gap between two steps is idle time, not a step
_STAGE_SHARE = 0.75  # of a step's time, what L3 -> L2 stages may take (stage_blocks)
_MIN_STAGE_BLOCKS = 16


@dataclass(frozen=True)
class ResumeCost:
    """Both estimates for one returning session, and the choice made from them."""

    choice: str  # "load" or "recompute"
    load_s: float  # wall time to bring its blocks up (L3 -> L2 -> L1), no GPU time used
    recompute_s: float  # GPU time of the prefill that rebuilds the same blocks
    recompute_cost_s: float  # recompute_s counted once for it and once per session it delays


def resume_cost(num_l2_blocks: int, num_l3_blocks: int, num_tokens: int, block_bytes: int,
                h2d_bytes_per_s: float, ssd_read_bytes_per_s: float,
                prefill_tokens_per_s: float, num_other_sessions: int,
                gpu_share_weight: float) -> ResumeCost:
    """Per-rank bytes over per-rank bandwidth (ranks move their shards in parallel).

    A load takes no GPU time but L3 blocks cross two links; a recompute is a prefill of the
    missing tokens, and while it runs every other session of the step waits for it: its cost
    is weighed `1 + gpu_share_weight * num_other_sessions` times. Under load a disk read wins;
    alone, a fast prefill can.
    """
    load, recompute, weighted = resume_costs(
        np.array([num_l2_blocks]), np.array([num_l3_blocks]), np.array([num_tokens]),
        block_bytes, h2d_bytes_per_s, ssd_read_bytes_per_s, prefill_tokens_per_s,
        num_other_sessions, gpu_share_weight)
    choice = "recompute" if weighted[0] < load[0] else "load"
    return ResumeCost(choice, float(load[0]), float(recompute[0]), float(weighted[0]))


def resume_costs(num_l2_blocks: np.ndarray, num_l3_blocks: np.ndarray, num_tokens: np.ndarray,
                 block_bytes: int, h2d_bytes_per_s: float, ssd_read_bytes_per_s: float,
                 prefill_tokens_per_s: float, num_other_sessions: int,
                 gpu_share_weight: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """resume_cost for many sessions at once: (load_s, recompute_s, recompute_cost_s)."""
    n2 = num_l2_blocks.astype(np.float64)
    n3 = num_l3_blocks.astype(np.float64)
    load_s = n3 * block_bytes / ssd_read_bytes_per_s + (n2 + n3) * block_bytes / h2d_bytes_per_s
    recompute_s = num_tokens.astype(np.float64) / prefill_tokens_per_s
    weighted = recompute_s * (1.0 + gpu_share_weight * max(num_other_sessions, 0))
    return load_s, recompute_s, weighted


class RateMeter:
    """Measured bandwidths and prefill speed, as moving averages over the workers' reports."""

    def __init__(self, policy: PolicyConfig) -> None:
        self.h2d_bytes_per_s = float(policy.h2d_bytes_per_s)
        self.ssd_read_bytes_per_s = float(policy.ssd_read_bytes_per_s)
        self.prefill_tokens_per_s = float(policy.prefill_tokens_per_s)
        self.samples = {"h2d": 0, "ssd_read": 0, "prefill": 0}
        self.step_gaps: deque[float] = deque(maxlen=_STEP_GAPS)  # seconds between steps
        self._last_step_s: float | None = None

    def observe_step(self, now_s: float) -> None:
        """A step starts at `now_s` (seconds): the gap since the last one is a step's time,
        unless the node sat idle in between (over _IDLE_GAP_S)."""
        if self._last_step_s is not None and 0 < now_s - self._last_step_s <= _IDLE_GAP_S:
            self.step_gaps.append(now_s - self._last_step_s)
        self._last_step_s = now_s

    def stage_blocks(self, block_bytes: int, default: int) -> int:
        """PolicyConfig.prefetch_stage_max_blocks 0: the blocks the ranks' measured L3 -> L2
        rate (ssd_read_bytes_per_s: read aheads served from memory and disk reads alike)
        moves in _STAGE_SHARE of a step's time, at least _MIN_STAGE_BLOCKS: staged after the
        forward's launch, they take no more host time than the forward covers. A step's time
        is the lower decile of the recent gaps: a decode step's without staging. (The median
        counted the steps that staged and the resume steps: on the H200, with 7 ms decode
        steps, it let a step stage ~200 blocks, and such steps took 16.6 ms at the median.)
        `default` until a step time or an L3 read is measured."""
        step_s = self._step_s()
        if step_s is None or not self.samples["ssd_read"]:
            return default
        n = int(self.ssd_read_bytes_per_s * step_s * _STAGE_SHARE // max(block_bytes, 1))
        return max(_MIN_STAGE_BLOCKS, n)

    def _step_s(self) -> float | None:
        """The lower decile of the recent step gaps (None before any)."""
        if not self.step_gaps:
            return None
        return sorted(self.step_gaps)[len(self.step_gaps) // 10]

    def observe_plan(self, results: list[MoveResult]) -> None:
        """One plan's reports (one per rank): the slowest rank's time bounds the plan.

        A plan that read from L3 is attributed to the disk (it dominates); one with only
        host-to-device copies measures that link.
        """
        elapsed_s = max(r.elapsed_ns for r in results) / 1e9
        if elapsed_s <= 0:
            return
        ssd = max(r.bytes_ssd_read for r in results)
        h2d = max(r.bytes_h2d for r in results)
        if ssd >= _MIN_SAMPLE_BYTES:
            self.ssd_read_bytes_per_s = self._mix(self.ssd_read_bytes_per_s, ssd / elapsed_s,
                                                  "ssd_read")
        elif h2d >= _MIN_SAMPLE_BYTES:
            self.h2d_bytes_per_s = self._mix(self.h2d_bytes_per_s, h2d / elapsed_s, "h2d")

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= _MIN_SAMPLE_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s,
                                                  num_tokens / seconds, "prefill")

    def _mix(self, old: float, new: float, name: str) -> float:
        self.samples[name] += 1
        return new if self.samples[name] == 1 else (1 - _EMA) * old + _EMA * new

    def as_dict(self) -> dict[str, float | None | dict[str, int]]:
        return {"h2d_bytes_per_s": self.h2d_bytes_per_s,
                "ssd_read_bytes_per_s": self.ssd_read_bytes_per_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                # a decode step's time as stage_blocks takes it (None: no gap measured)
                "step_s": self._step_s(),
                "samples": dict(self.samples)}
