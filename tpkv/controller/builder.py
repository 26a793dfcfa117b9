"""PlanBuilder: applies moves and drops to the table one phase (one MovePlan) at a time."""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import move_rows, plan_arrays
from tpkv.controller.sessions import SessionTable, add_counts
from tpkv.controller.table import DRAM, HBM, NONE, SSD, BlockTable
from tpkv.types import MovePlan

_NO_OWNER = np.zeros(0, dtype=np.int32)  # the owner map of L3, which has none


def group_sorted(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique values, index of each value in them), without np.unique's hashing cost."""
    ordered = np.sort(values)
    keep = np.ones(len(ordered), dtype=bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    uniq = ordered[keep]
    return uniq, np.searchsorted(uniq, values)


class PlanBuilder:
    """Collects the moves of one step, phase by phase; each phase with moves becomes one plan.

    A slot vacated by a move is held back until its phase ends, so no slot is the source of one
    move and the destination of another in the same plan: workers may run a plan's moves in any
    order. A later phase (the next epoch) may reuse it, since plans are applied in order. A drop
    (a block loses its only copy; no data moves) frees its slot at once. Drops are reported per
    position: `drops[i]` apply before plan i, `drops[len(plans)]` after the last plan.
    """

    def __init__(self, table: BlockTable, sessions: SessionTable, first_epoch: int,
                 now_s: float, check: bool = False) -> None:
        self.t = table
        self.check = check  # assert each move's source tier (Controller.check_invariants)
        self.s = sessions
        self.epoch = first_epoch
        self.now_s = now_s
        self.plans: list[MovePlan] = []
        self.plan_rows: list[np.ndarray] = []
        self.drops: list[list[np.ndarray]] = [[]]
        self.ssd_dropped: list[int] = []  # sessions whose L3 records were all discarded
        self.events: list[dict[str, object]] = []
        self.touched = np.zeros(0, dtype=bool)  # sessions changed this phase (made on first use)
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]] = []
        self._held: dict[int, list[np.ndarray]] = {HBM: [], DRAM: []}

    @property
    def num_moves(self) -> int:
        return sum(len(p[0]) for p in self._parts) + sum(p.num_moves for p in self.plans)

    def begin_phase(self) -> None:
        self.touched = np.zeros(self.s.capacity, dtype=bool)

    def touch(self, sessions: np.ndarray) -> None:
        self._touch(sessions)

    def move(self, rows: np.ndarray, src: int, dst: int) -> None:
        """Move `rows`, all on tier `src` and none moved yet in this phase, to tier `dst`,
        assigning destination slots; their source slots are held back until the phase ends."""
        n = len(rows)
        if n == 0:
            return
        t = self.t
        assert not self.check or (t.tier[rows] == src).all(), "move: a row is not on its source"
        slots = t.free[dst].pop(n) if dst != SSD else np.full(n, -1, dtype=np.int32)
        if len(self.touched) == 0:
            self.touched = np.zeros(self.s.capacity, dtype=bool)
        sess = np.empty(n, dtype=np.int32)
        old_slot = np.empty(n, dtype=np.int32)
        counts = self.s.counts  # [4, S]: tier column + 1 (NONE is column 0)
        move_rows(rows, slots, t.session, t.tier, t.slot, t.owner.get(src, _NO_OWNER),
                  t.owner.get(dst, _NO_OWNER), counts[src + 1], counts[dst + 1], self.touched,
                  self.s.dirty, self.s.clean, t.demoted_at, dst, self.now_s, dst > src, sess,
                  old_slot)
        if src != SSD:
            self._held[src].append(old_slot)
        t.num_in[src + 1] -= n
        t.num_in[dst + 1] += n
        assert t.used(SSD) <= t.l3_capacity, "L3 over capacity"
        self._parts.append((rows, sess, old_slot, slots, src, dst))

    def drop(self, rows: np.ndarray) -> None:
        """The blocks lose their copy (they will be recomputed if needed again); slots free now."""
        if len(rows) == 0:
            return
        old_tier, _ = self.t.set_tier(rows, NONE, np.full(len(rows), -1, dtype=np.int32),
                                      free_src=True)
        self._count(rows, old_tier, NONE)
        self.drops[-1].append(self.t.ids(rows))

    def end_phase(self) -> None:
        for tier, held in self._held.items():
            if held:
                self.t.free[tier].push(held[0] if len(held) == 1 else np.concatenate(held))
                held.clear()
        if not self._parts:
            return
        parts, self._parts = self._parts, []
        if len(parts) == 1:
            rows, sess, src_slot, dst_slot = parts[0][:4]
        else:
            rows, sess, src_slot, dst_slot = (np.concatenate([p[k] for p in parts])
                                              for k in range(4))
        src_tier = np.empty(len(rows), dtype=np.int8)
        dst_tier = np.empty(len(rows), dtype=np.int8)
        at = 0
        for p in parts:
            src_tier[at:at + len(p[0])] = p[4]
            dst_tier[at:at + len(p[0])] = p[5]
            at += len(p[0])
        # in_flight until its plan is confirmed (nothing reads it before)
        ids, session_idx, logical, order = plan_arrays(rows, sess, self.t.gen, self.t.logical,
                                                       self.t.in_flight, self.s.plan_local)
        names = self.s.names
        plan = MovePlan(
            epoch=self.epoch, block_ids=ids, src_tier=src_tier, src_slot=src_slot,
            dst_tier=dst_tier, dst_slot=dst_slot, session_idx=session_idx, logical_idx=logical,
            session_names=tuple([names[i] for i in order.tolist()]))  # type: ignore[misc]
        self.plans.append(plan)
        self.plan_rows.append(rows)
        self.drops.append([])
        self.epoch += 1

    def drop_lists(self) -> list[np.ndarray]:
        return [np.concatenate(d) if d else np.zeros(0, dtype=np.int64) for d in self.drops]

    def _count(self, rows: np.ndarray, old_tier: np.ndarray, new_tier: int) -> None:
        sess = self.t.session[rows].astype(np.int64)
        add_counts(self.s.counts, self.s.count_keys(old_tier.astype(np.int64) + 1, sess), -1)
        add_counts(self.s.counts, self.s.count_keys(int(new_tier) + 1, sess), 1)
        self._touch(sess)

    def _touch(self, sessions: np.ndarray) -> None:
        if len(self.touched) == 0:
            self.touched = np.zeros(self.s.capacity, dtype=bool)
        self.touched[sessions] = True
        self.s.dirty[sessions] = True

