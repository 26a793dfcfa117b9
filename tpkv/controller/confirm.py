"""Confirmations: commit an epoch from every rank's report, lose missed blocks, resync."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpkv.controller.builder import group_sorted
from tpkv.controller.sessions import add_counts
from tpkv.errors import ArgumentTypeError, BadRequestError, PlanOrderError
from tpkv.limits import check_count, check_counts
from tpkv.protocol.digest import plan_digest, slot_map_digest
from tpkv.protocol.messages import CommitOutcome
from tpkv.protocol.plan import MoveResult, Tier

if TYPE_CHECKING:
    from tpkv.controller.controller import Controller


def _checked(results: object) -> list[MoveResult]:
    """The reports as a list of MoveResults with integer fields (ArgumentTypeError if not)."""
    if not isinstance(results, (Sequence, np.ndarray)) or isinstance(results, (str, bytes)):
        raise ArgumentTypeError(f"results must be a list of MoveResult, got "
                                f"{type(results).__name__}")
    out = list(results)
    for i, r in enumerate(out):
        if not isinstance(r, MoveResult):
            raise ArgumentTypeError(f"results[{i}] must be a MoveResult, got {type(r).__name__}")
        for name in ("epoch", "rank", "status", "slot_map_digest"):
            check_count(f"results[{i}].{name}", getattr(r, name), (1 << 64) - 1, "uint64",
                        low=-(1 << 63))
        check_counts(f"results[{i}].miss_block_ids", r.miss_block_ids, (1 << 63) - 1, "int64")
    return out


def commit(ctl: Controller, results: Sequence[MoveResult]) -> CommitOutcome:
    """All ranks' reports for the oldest unconfirmed epoch. Misses become Tier.NONE."""
    ctl.require_ready()
    results = _checked(results)
    tp = ctl.config.geometry.tp_size
    epochs = sorted({int(r.epoch) for r in results})
    if len(epochs) != 1:
        raise BadRequestError(f"one epoch per commit, got reports for epochs {epochs}")
    epoch = epochs[0]
    if not ctl.pending:
        raise PlanOrderError(f"epoch {epoch} confirmed, but no plan awaits confirmation "
                             f"(last committed {ctl.committed_epoch})")
    head = ctl.pending[0]
    if epoch != head.plan.epoch:
        raise PlanOrderError(f"epoch {epoch} confirmed out of order: epoch "
                             f"{head.plan.epoch} is next ({len(ctl.pending)} pending, "
                             f"latest {ctl.pending[-1].plan.epoch})")
    ranks = sorted(int(r.rank) for r in results)
    if ranks != list(range(tp)):
        raise BadRequestError(f"epoch {epoch}: reports from ranks {ranks}, need one from "
                              f"each of 0..{tp - 1}")
    misses = np.concatenate([np.asarray(r.miss_block_ids, dtype=np.int64).reshape(-1)
                             for r in results])
    if len(misses):
        misses = np.unique(misses)
    stray = misses[~np.isin(misses, head.plan.block_ids)] if len(misses) else misses
    if len(stray):
        raise BadRequestError(f"epoch {epoch}: {len(stray)} reported misses are not in the "
                              f"plan, e.g. block {int(stray[0])}")
    bad = tuple(int(r.rank) for r in results
                if r.status != 0 or r.slot_map_digest != plan_digest(head.plan,
                                                                    r.miss_block_ids))
    num_misses = lose(ctl, misses)
    ctl.pending.popleft()
    later = [p.rows for p in ctl.pending]
    rows, alive = ctl.table.rows_of(head.plan.block_ids)
    done = rows[alive]
    if later and len(done):
        done = done[~np.isin(done, np.concatenate(later))]
    ctl.table.in_flight[done] = 0
    ctl.committed_epoch = epoch
    if bad:
        ctl.event("mismatch", epoch=epoch, ranks=list(bad))
    else:
        ctl.rates.observe_plan(results)
    if num_misses:
        ctl.event("miss", epoch=epoch, blocks=num_misses)
    ctl.maybe_check()
    return CommitOutcome(epoch, not bad, bad, num_misses, plan_digest(head.plan), bool(bad))


def lose(ctl: Controller, block_ids: np.ndarray) -> int:
    """Blocks whose only copy failed: Tier.NONE, slot freed, recomputed when next needed."""
    rows, ok = ctl.table.rows_of(block_ids)
    rows = rows[ok]
    rows = rows[ctl.table.tier[rows] != Tier.NONE]
    if len(rows) == 0:
        return 0
    old, _ = ctl.table.set_tier(rows, Tier.NONE, np.full(len(rows), -1, dtype=np.int32),
                                 free_src=True, dead=ctl.sessions.l3_other)
    sess = ctl.table.session[rows].astype(np.int64)
    S = ctl.sessions
    S.dirty[sess] = True
    add_counts(S.counts, S.count_keys(old.astype(np.int64) + 1, sess), -1)
    add_counts(S.counts, S.count_keys(0, sess), 1)
    ctl.outbox_lost.append(ctl.table.ids(rows))
    return len(rows)


def slot_map(ctl: Controller) -> dict[str, Any]:
    """The authoritative map of every live block (for resync and for tests)."""
    T, S = ctl.table, ctl.sessions
    rows = np.flatnonzero(T.session >= 0)
    uniq, local = group_sorted(T.session[rows])
    out: dict[str, Any] = {
        "epoch": ctl.next_epoch - 1, "tick": ctl.tick, "block_ids": T.ids(rows),
        "tiers": T.tier[rows].astype(np.int8), "slots": T.slot[rows].astype(np.int64),
        "session_idx": local.astype(np.int32),
        "logical_idx": T.logical[rows].astype(np.int64),
        "session_names": [S.name(int(i)) for i in uniq],
        "session_tokens": {S.name(int(i)): int(S.tokens[i]) for i in uniq}}
    out["digest"] = slot_map_digest(out["block_ids"], out["tiers"], out["slots"])
    return out


def resync(ctl: Controller) -> dict[str, Any]:
    """After a mismatch: the full map for workers to restore; pending plans are superseded."""
    ctl.require_ready()
    out = slot_map(ctl)
    ctl.table.clear_kept()  # what a rank's L2 slots hold is no longer vouched for
    ctl.table.l3copy[:] = 0  # nor its L3 records (they stay, as dead room, until they go)
    ctl.pending.clear()
    ctl.table.in_flight[:] = 0
    ctl.committed_epoch = ctl.next_epoch - 1
    ctl.outbox_released, ctl.outbox_lost = [], []
    ctl.event("resync", epoch=ctl.committed_epoch, blocks=len(out["block_ids"]))
    return out
