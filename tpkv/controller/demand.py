"""The step's demand: which of its sessions' blocks off L1 are loaded back and which
recomputed (the cost model, or the caller's `resume`), and the L3 records a recompute keeps."""

from __future__ import annotations

import numpy as np

from tpkv.controller.builder import PlanBuilder
from tpkv.controller.rowkernels import demand_rows, record_choices
from tpkv.controller.steptypes import StepContext
from tpkv.controller.table import DRAM, NONE, SSD

EMPTY = np.zeros(0, dtype=np.int64)


def demand(ctx: StepContext, b: PlanBuilder, batch: np.ndarray, missing: np.ndarray,
            resume: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows to bring into L1 (load), rows to recompute, and those of them whose L3 record is
    kept as their copy (keep_records), per the cost model for each session of the step with
    blocks outside L1 (at positions `missing`), or as `resume` says (the caller's choice, kept
    as the session's). Rows to recompute lose their L2/L3 copy now; without L3 copies
    (BlockTable.keep_l3) their sessions' L3 segments go."""
    S, T, rates, pol = ctx.sessions, ctx.table, ctx.rates, ctx.config.policy
    if len(missing) == 0:
        return EMPTY, EMPTY, EMPTY
    g = ctx.config.geometry
    sess = batch[missing]
    # cost.resume_costs per session, in the kernel (blocks on L2 and L3 kept per session)
    weight = 1.0 + pol.gpu_share_weight * max(len(batch) - 1, 0)
    any_redo, redo, n2, n3, load_s, recompute_s = record_choices(
        sess, S.counts[2], S.counts[3], g.block_tokens, g.block_bytes, rates.h2d_bytes_per_s,
        rates.ssd_read_bytes_per_s, rates.prefill_tokens_per_s, weight, S.choice, S.load_s,
        S.recompute_s)
    chosen = resume[missing]
    if chosen.any():
        redo = np.where(chosen == 0, redo, (chosen == 2) & (n2 + n3 > 0))
        S.choice[sess] = redo
        any_redo = bool(redo.any())
    if not any_redo:
        A = S.arena
        return (*demand_rows(sess, A.arena, A.start, A.length, T.tier), EMPTY)
    rows, offsets = S.arena.gather(sess)
    tier = T.tier[rows]
    off_l1 = (tier == DRAM) | (tier == SSD)
    redo_rows = np.repeat(redo, np.diff(offsets)) & off_l1
    keep = EMPTY
    if T.keep_l3:  # a block in L3, or with an L3 copy: its record holds its tokens' KV
        keep = rows[redo_rows & ((tier == SSD) | (T.l3copy[rows] != 0))].astype(np.int64)
    b.drop(rows[redo_rows])
    if not T.keep_l3:
        gone = sess[redo & (n3 > 0)]  # their L3 records are of no more use
        b.drop_segments(gone.astype(np.int64))
    for i in np.flatnonzero(redo).tolist():
        b.events.append({"kind": "recompute", "session": S.name(int(sess[i])),
                         "blocks": int(n2[i] + n3[i]), "load_s": float(load_s[i]),
                         "recompute_s": float(recompute_s[i])})
    rows = rows.astype(np.int64)
    return rows[off_l1 & ~redo_rows], rows[(tier == NONE) | redo_rows], keep


def keep_records(ctx: StepContext, b: PlanBuilder, rows: np.ndarray) -> None:
    """Rows recomputed by choice (demand), now in L1, keep the L3 record they had (in L3, or
    as a copy) as their copy (BlockTable.l3copy), as a block loaded back from L3 does: the
    record is of the same session and logical block, and its tokens have not changed since it
    was written (a write voids a copy: stepkernels.written_kept, for which their sessions are
    flagged l3_last). A later spill of them writes nothing. The record holds the KV computed
    when it was written, which a recompute of the same tokens may differ from in low-order
    bits: it is what a load of it would serve. Records counted dead by the drop (set_tier)
    stay counted in l3_other, as copies. Not kept: a block whose record failed (lost, Tier.NONE
    before the step: never among these rows), one whose segment this step deletes, and (as
    before) the copies of blocks already in L1 that the engine feeds again after a recomputed
    one (step._drop_written_copies)."""
    T, S = ctx.table, ctx.sessions
    sess = T.session[rows]
    if len(b.segment_gone):
        on = ~b.segment_gone[sess]
        rows, sess = rows[on], sess[on]
    T.l3copy[rows] = 1
    S.l3_last[sess] = True
