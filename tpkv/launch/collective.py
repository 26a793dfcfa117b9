"""What every rank of the TP group learns from rank 0, and the step's results across ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tpkv import errors
from tpkv.errors import TpkvError
from tpkv.launch.bootstrap import RankContext
from tpkv.protocol.messages import StepResult, move_result_from_dict, move_result_to_dict
from tpkv.protocol.plan import MoveResult
from tpkv.protocol.wire import decode, detached, encode
from tpkv.workers.confirm import STATUS_MISSES
from tpkv.workers.worker import StepReport


def from_rank0(ctx: RankContext, fn: Callable[[], Any], what: str) -> Any:
    """Run fn on rank 0; every rank gets its value or raises its typed error. A group of one
    skips the wire (encoding a resume's step took about as long as planning it) and takes a
    copy instead: the controller reuses its arrays in the next call."""
    if ctx.world_size == 1:
        return detached(fn())
    payload, failure = None, None
    if ctx.rank == 0:
        try:
            payload = encode({"ok": fn()})
        except Exception as exc:  # every rank raises it (others as its tpkv type, or base)
            failure = exc
            message = str(exc.args[0]) if isinstance(exc, TpkvError) and exc.args else \
                f"rank 0: {what}: {type(exc).__name__}: {exc}"
            payload = encode({"error": type(exc).__name__, "message": message})
    payload = ctx.ctl.broadcast_bytes(payload, what=what)
    if failure is not None:
        raise failure
    assert payload is not None
    answer = decode(payload)
    if "error" in answer:
        cls = getattr(errors, str(answer["error"]), None)
        if not (isinstance(cls, type) and issubclass(cls, TpkvError)):
            cls = TpkvError
        raise cls(answer["message"])
    return answer["ok"]


def all_results(ctx: RankContext, report: StepReport, exchange: bool
                ) -> list[list[MoveResult]]:
    """[plan][rank] MoveResults: exchanged when some rank has misses or disagrees, else
    rebuilt from the gathered rows (rank 0's byte counts, timings and spill progress stand for
    all)."""
    if exchange:
        blobs = ctx.ctl.gather_bytes(
            encode([move_result_to_dict(r) for r in report.results]), "move results")
        per_rank = [[move_result_from_dict(d) for d in decode(b)] for b in blobs]
        return [list(col) for col in zip(*per_rank)]
    row_of = {int(e): j for j, e in enumerate(report.expected[:, 0].tolist())}
    out = []
    for own in report.results:
        j = row_of.get(own.epoch)
        rows = report.gathered[:, j, :] if j is not None else None
        out.append([MoveResult(
            own.epoch, r, own.moves_applied if rows is None else int(rows[r, 1]),
            # this rank's own digest counts its misses; the gathered row may not
            own.slot_map_digest if rows is None or r == ctx.rank else int(rows[r, 2]),
            own.status if rows is None else int(rows[r, 3]) & ~STATUS_MISSES,
            own.miss_block_ids,
            own.bytes_h2d, own.bytes_d2h, own.bytes_ssd_read, own.bytes_ssd_write,
            own.elapsed_ns, own.spills_written_below, own.spill_write_bytes_per_s)
            for r in range(ctx.world_size)])
    return out


def as_step(answer: StepResult | dict[str, Any]) -> StepResult:
    return answer if isinstance(answer, StepResult) else StepResult.from_dict(answer)


def misses_hit_batch(report: StepReport, results: list[list[MoveResult]]) -> bool:
    """Whether a block missed on any rank belongs to a session of the step's batch."""
    batch = set(report.step.session_ids)
    for plan, per_plan in zip(report.step.plans, results):
        missed = np.concatenate([np.asarray(r.miss_block_ids, dtype=np.int64)
                                 for r in per_plan] + [np.zeros(0, dtype=np.int64)])
        if len(missed):
            hit = np.isin(plan.block_ids, missed)
            if {plan.session_names[i] for i in plan.session_idx[hit].tolist()} & batch:
                return True
    return False
