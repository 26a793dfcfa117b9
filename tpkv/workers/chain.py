"""Chain: the next plan's L2 -> L1 moves issued as this plan's L3 reads land; find_chain."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tpkv.protocol.plan import MovePlan
from tpkv.workers.mirror import DRAM, HBM, SSD, SlotMirror
from tpkv.workers.outcome import ExecOutcome


@dataclass
class Chain:
    """The next plan's L2 -> L1 moves of blocks this plan loads from L3, which the worker found
    safe to issue early (find_chain: the moves its check will pass once this plan is
    applied). Each goes out as soon as the read job that loads its block is done with a hit,
    beside the plan's later reads, instead of after all of them; the next plan's run() takes
    those issued as done."""

    plan: MovePlan  # the next plan
    rows: np.ndarray  # its moves that may go early (indices into plan)
    loads: np.ndarray  # per row: the move of this plan that loads its block into L2
    issued: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per row
    out: ExecOutcome | None = None  # the copies' spans and first issue time

    def issued_rows(self) -> np.ndarray:
        return self.rows[self.issued]

    def begin(self) -> None:
        """Nothing issued yet: called as the plan whose reads it follows starts them."""
        self.issued = np.zeros(len(self.rows), dtype=bool)
        self.out = ExecOutcome(done=np.zeros(0, dtype=bool))

    def ready(self, loaded: np.ndarray) -> np.ndarray:
        """Mask over rows: those whose blocks are loaded (with a hit; `loaded` is a mask over
        this plan's moves) and not yet issued."""
        return loaded[self.loads] & ~self.issued

    def mark_issued(self, ready: np.ndarray) -> None:
        self.issued |= ready

    def take(self, ok: np.ndarray, out: ExecOutcome, block_bytes: int) -> np.ndarray | None:
        """As its plan runs (ok: the moves its check passed): the rows issued ahead, now done
        in `out` (their bytes, spans and first issue time), or None."""
        rows = self.issued_rows()
        rows = rows[ok[rows]]  # Worker.apply_plan dealt with any its check refused
        if not len(rows):
            return None
        assert self.out is not None
        out.done[rows] = True
        out.bytes_h2d += len(rows) * block_bytes
        out.timing = list(self.out.timing)
        out.ahead_spans = len(out.timing)
        out.h2d_issued_ns = self.out.h2d_issued_ns
        out.num_ahead = len(rows)
        return rows


def find_chain(plan: MovePlan, ok: np.ndarray, nxt: MovePlan, drops: np.ndarray,
               mirror: SlotMirror, num_l1_slots: int) -> Chain | None:
    """The L2 -> L1 moves of `nxt` that may go as soon as `plan` has loaded their blocks
    from L3 (PlanExecutor.run's `chain`): exactly those this rank's check of `nxt` will
    pass, whatever `plan`'s reads return, once their own block's read is a hit. Each
    starts from the L2 slot an applied load of `plan` fills with its block, and goes into
    an L1 slot named once in `nxt`, which none of `nxt`'s moves empties, and which is free
    once `plan` is applied (free now in `mirror` and filled by none of its moves, or emptied
    by one); its block is not dropped between the two plans (`drops`)."""
    loads = np.flatnonzero(ok & (plan.src_tier == SSD) & (plan.dst_tier == DRAM))
    ups = np.flatnonzero((nxt.src_tier == DRAM) & (nxt.dst_tier == HBM))
    if not len(loads) or not len(ups):
        return None
    by_slot = np.argsort(plan.dst_slot[loads], kind="stable")
    slots = plan.dst_slot[loads][by_slot]
    at = np.minimum(np.searchsorted(slots, nxt.src_slot[ups]), len(slots) - 1)
    q = loads[by_slot[at]]
    keep = (slots[at] == nxt.src_slot[ups]) & (plan.block_ids[q] == nxt.block_ids[ups])
    if len(drops):
        keep &= ~np.isin(nxt.block_ids[ups], drops)
    ups, q = ups[keep], q[keep]
    n1 = num_l1_slots
    d = nxt.dst_slot[ups]
    inside = (d >= 0) & (d < n1)
    ups, q, d = ups[inside], q[inside], d[inside]
    if not len(ups):
        return None
    into_l1 = nxt.dst_slot[(nxt.dst_tier == HBM) & (nxt.dst_slot >= 0) & (nxt.dst_slot < n1)]
    named_once = np.bincount(into_l1, minlength=n1)[d] == 1
    emptied_next = np.isin(d, nxt.src_slot[nxt.src_tier == HBM])
    filled = np.isin(d, plan.dst_slot[ok & (plan.dst_tier == HBM)])
    emptied = np.isin(d, plan.src_slot[ok & (plan.src_tier == HBM)])
    free_after = ((mirror.holder(HBM, d) < 0) | emptied) & ~filled
    keep = named_once & ~emptied_next & free_after
    if not keep.any():
        return None
    return Chain(nxt, ups[keep], q[keep])
