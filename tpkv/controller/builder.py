"""PlanBuilder: applies moves and drops to the table one phase (one MovePlan) at a time."""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import emptied_sessions, move_rows, plan_arrays
from tpkv.controller.sessions import SessionTable, add_counts
from tpkv.controller.slotstack import SlotStack
from tpkv.controller.stepkernels import l3_moved
from tpkv.controller.table import DRAM, HBM, NONE, SSD, BlockTable
from tpkv.errors import TierFullError
from tpkv.protocol.plan import MovePlan

_NO_OWNER = np.zeros(0, dtype=np.int32)  # the owner map of L3, which has none
_NO_STACK = SlotStack(0, "L3")  # nor free slots


def _phase_buffers(n: int) -> list[np.ndarray]:
    """Moves of one phase as kernels.move_rows writes them: rows, sessions, source slots,
    destination slots, source tiers, destination tiers (the slots and tiers in wire dtypes),
    then whether each move is kept (MovePlan.kept: no copy), which PlanBuilder.move writes."""
    return [np.empty(n, dtype=d) for d in (np.int64, np.int32, np.int64, np.int64, np.int8,
                                           np.int8, np.bool_)]


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
    order. A later phase (the next epoch) may reuse it, since plans are applied in order. The
    one exception, free_vacated(L1): moves into L1 later in the phase may fill the L1 slots its
    demotions empty (workers issue those demotions first and order the copies into their slots
    after them). A drop (a block loses its only copy; no data moves) frees its slot at once.
    The L2 slots a phase spills (L2 -> L3, written in the background) go under every other
    free L2 slot until the ranks report the spill written (SlotStack.push_cooling,
    SpillPacer), unless spill pacing is off.
    Drops are reported per position: `drops[i]` apply before plan i, `drops[len(plans)]` after
    the last plan.
    """

    def __init__(self, table: BlockTable, sessions: SessionTable, first_epoch: int,
                 now_s: float, check: bool = False,
                 buffers: list[np.ndarray] | None = None, *, committed_epoch: int) -> None:
        self.t = table
        self.check = check  # assert each move's source tier (Controller.check_invariants)
        self.s = sessions
        self.epoch = first_epoch
        self.now_s = now_s
        self.plans: list[MovePlan] = []
        self.plan_rows: list[np.ndarray] = []
        self.handed = 0  # plans already pending at the controller (Controller.hand_out)
        self.drops: list[list[np.ndarray]] = [[]]
        self.ssd_dropped: list[int] = []  # sessions whose L3 records were all discarded
        # Flags over sessions (made on first use): segment dropped in this step, so no move
        # into L3 later in it (the ranks delete the files after the step's plans)
        self.segment_gone = np.zeros(0, dtype=bool)
        # The last plan every rank has applied: a segment may be given back only once no
        # plan that reads or writes it is still unconfirmed (SessionTable.l3_epoch)
        self.committed_epoch = committed_epoch
        self.left_l3: list[np.ndarray] = []  # sessions of rows moved out of L3 (with repeats)
        self.events: list[dict[str, object]] = []
        self.touched = np.zeros(0, dtype=bool)  # sessions changed this phase (made on first use)
        self._held: dict[int, list[np.ndarray]] = {HBM: [], DRAM: []}
        self._held_kept: list[np.ndarray] = []  # L1 slots of this phase's kept demotions
        self._held_spill: list[np.ndarray] = []  # L2 slots this phase's spills read
        self.into_l2 = 0  # blocks copied into L2 slots in this step (SpillPacer.stepped)
        # (rows, L2 slots) of this phase's promotions: the slots become the rows' kept copies
        # when the phase ends (BlockTable.kept), instead of free slots
        self._to_keep: list[tuple[np.ndarray, np.ndarray]] = []
        self._n = 0  # moves of the current phase, in the buffers below
        # The last step's buffers when given (`buffers`): they grew to what a step needs, and
        # growing them again each step cost a concatenate per buffer. Scratch only: plan arrays
        # are copies.
        self.buffers = buffers if buffers is not None else _phase_buffers(1024)

    @property
    def num_moves(self) -> int:
        return self._n + sum(p.num_moves for p in self.plans)

    def begin_phase(self) -> None:
        self.touched = np.zeros(self.s.capacity, dtype=bool)

    def touched_flags(self) -> np.ndarray:
        """The sessions touched in this phase, as flags (for kernels that touch sessions)."""
        if len(self.touched) == 0:
            self.touched = np.zeros(self.s.capacity, dtype=bool)
        return self.touched

    def move(self, rows: np.ndarray, src: int, dst: int) -> None:
        """Move `rows`, all on tier `src` and none moved yet in this phase, to tier `dst`,
        assigning destination slots; their source slots are held back until the phase ends.
        A demotion of a block with a kept L2 copy goes back into that slot and copies nothing;
        the others take free L2 slots, and kept copies are given back when there are too few."""
        n = len(rows)
        if n == 0:
            return
        t = self.t
        assert not self.check or (t.tier[rows] == src).all(), "move: a row is not on its source"
        if dst == SSD and t.keep_l3:
            copied = t.l3copy[rows] != 0
            if copied.any():  # their records are on disk: kept spills, nothing written
                self._move(rows[~copied], src, dst)
                self._move(rows[copied], src, dst, kept=True)
                return
        if dst == DRAM:
            kept: np.ndarray | None = None
            num_kept = 0
            if src == HBM and t.num_kept:
                at = t.slot[rows]  # L1 slots; their kept L2 copies
                kept = t.kept[at]
                has = kept >= 0
                num_kept = int(np.count_nonzero(has))
            stack = t.free[DRAM]
            room = stack.top + t.num_kept - num_kept  # free, and kept copies of other blocks
            if n - num_kept > room:
                raise TierFullError(f"L2 needs {n - num_kept} slots, {stack.top} free and "
                                    f"{room - stack.top} kept copies of other blocks of "
                                    f"{stack.size}")
            if kept is not None and num_kept:
                t.forget_kept_at(at[has])
                self._move(rows[~has], src, dst)
                self._move(rows[has], src, dst, kept[has])
                return
        self._move(rows, src, dst)

    def _move(self, rows: np.ndarray, src: int, dst: int,
              kept_slots: np.ndarray | None = None, kept: bool = False) -> None:
        """move() once the destination slots are settled: taken from the free stack, or, with
        `kept_slots`, the rows' own kept L2 copies (the moves are marked kept). `kept` on
        L2 -> L3: the rows' records are in their segments (BlockTable.l3copy)."""
        n = len(rows)
        if n == 0:
            return
        t = self.t
        stack = t.free[dst] if dst != SSD else _NO_STACK
        if kept_slots is not None:  # as a stack whose top (the end) is the first row's slot
            slots, top = kept_slots[::-1].astype(np.int32), n
        else:
            if dst == DRAM and n > stack.clean:  # kept copies go before slots spills read
                t.reclaim_kept(n - stack.clean)
            if n > stack.top and dst != SSD:
                stack.pop(n)  # raises TierFullError
            slots, top = stack.stack, stack.top
        if len(self.touched) == 0:
            self.touched = np.zeros(self.s.capacity, dtype=bool)
        at = self._n
        if at + n > len(self.buffers[0]):
            self.buffers = [np.concatenate([b[:at], np.empty(at + 2 * n, dtype=b.dtype)])
                            for b in self.buffers]
        counts = self.s.counts  # [4, S]: tier column + 1 (NONE is column 0)
        move_rows(rows, src, dst, slots, top, t.session, t.tier, t.slot,
                  t.owner.get(src, _NO_OWNER), t.owner.get(dst, _NO_OWNER), counts[src + 1],
                  counts[dst + 1], self.touched, self.s.dirty, self.s.clean, t.demoted_at,
                  self.now_s, at, *self.buffers[:6])
        self.buffers[6][at:at + n] = kept_slots is not None or kept
        if SSD in (src, dst):
            self._l3_moved(rows, self.buffers[1][at:at + n], src, kept)
        if kept_slots is None and dst != SSD:
            stack.took(n)
            self.into_l2 += n if dst == DRAM else 0
        if src == DRAM and dst == HBM:
            self._to_keep.append((self.buffers[0][at:at + n], self.buffers[2][at:at + n]))
        elif kept_slots is not None:
            self._held_kept.append(self.buffers[2][at:at + n])  # their L1 slots (no copy)
        elif src == DRAM and dst == SSD and not kept:  # a spill reads them in the background
            self._held_spill.append(self.buffers[2][at:at + n])
        elif src != SSD:
            self._held[src].append(self.buffers[2][at:at + n])  # their old slots
        else:
            self.left_l3.append(self.buffers[1][at:at + n].copy())
            if not t.keep_l3:  # the records go with the segment, once the session left L3
                t.l3_held_now += n
        self._n += n
        t.num_in[src + 1] -= n
        t.num_in[dst + 1] += n
        assert t.used(SSD) + t.l3_other <= t.l3_capacity, "L3 over capacity"

    def _l3_moved(self, rows: np.ndarray, sess: np.ndarray, src: int, kept: bool) -> None:
        """Bookkeeping of L3 copies (BlockTable.keep_l3) for moves out of or into L3: a load
        keeps its record as the block's copy; a kept spill turns the copy back into the block's
        place in L3. Every such move stamps its session's l3_epoch."""
        t, s = self.t, self.s
        mode = 0 if not t.keep_l3 else 1 if src == SSD else 2 if kept else 0
        # (rows come as int32 or int64: one dtype, one compiled signature)
        l3_moved(rows.astype(np.int64, copy=False), sess, mode, self.epoch, t.l3copy,
                 s.l3_other, s.l3_last, s.l3_epoch)
        t.l3_other += len(rows) if mode == 1 else -len(rows) if mode == 2 else 0

    def drop(self, rows: np.ndarray) -> None:
        """The blocks lose their copy (they will be recomputed if needed again); slots free now."""
        if len(rows) == 0:
            return
        old_tier, _ = self.t.set_tier(rows, NONE, np.full(len(rows), -1, dtype=np.int32),
                                      free_src=True, dead=self.s.l3_other)
        self._count(rows, old_tier, NONE)
        self.drops[-1].append(self.t.ids(rows))

    def drop_segments(self, units: np.ndarray) -> None:
        """Delete the whole L3 segments of sessions `units` (ssd_dropped_sessions; the ranks
        delete the files after this step's plans): their blocks in L3 must be dropped already.
        Their copies are void and the room of their other records is held like freed room;
        no block of theirs may go into L3 later in the step."""
        if len(units) == 0:
            return
        t, s = self.t, self.s
        if t.keep_l3:
            t.free_records(s.l3_other, units)
            rows, _ = s.arena.gather(units)
            t.l3copy[rows] = 0
        if len(self.segment_gone) < s.capacity:
            self.segment_gone = np.zeros(s.capacity, dtype=bool)
        self.segment_gone[units] = True
        self.ssd_dropped.extend(units.tolist())

    def free_vacated(self, tier: int) -> None:
        """Free now the slots of `tier` that moves of this phase vacated (L1 only: workers copy
        a plan's demotions out of L1 slots before its promotions into them)."""
        assert tier == HBM, "only L1 slots may be filled in the plan that empties them"
        # Those of kept demotions (no copy: nothing to wait for) are handed out first
        stack = self.t.free[tier]
        groups = [self._held_kept, self._held[tier]]
        if not stack.reuse_oldest:  # a push goes on top: handed out before earlier pushes
            groups.reverse()
        for held in groups:
            if held:
                stack.push(held[0] if len(held) == 1 else np.concatenate(held))
                held.clear()

    def end_phase(self) -> None:
        """The phase's moves become a plan (none without moves); the slots they vacated are
        free from the next phase on."""
        self._held[HBM] += self._held_kept
        self._held_kept.clear()
        if not self.t.pace.enabled:  # spilled slots are free slots like the others
            self._held[DRAM] += self._held_spill
            self._held_spill.clear()
        for tier, held in self._held.items():
            if held:
                self.t.free[tier].push(held[0] if len(held) == 1 else np.concatenate(held))
                held.clear()
        if self._held_spill:  # under the other free slots until reported written
            held = self._held_spill
            self.t.free[DRAM].push_cooling(held[0] if len(held) == 1 else np.concatenate(held),
                                           self.epoch, self.t.pace.step)
            held.clear()
        for rows, slots in self._to_keep:  # promoted: their L2 slots hold their bytes still;
            # kept only while L2 has room to spare: under pressure they would be given back
            # at once (BlockTable.keep_reserve)
            self.t.keep(rows, slots, self.s.kept_last)
        self._to_keep.clear()
        if self._n == 0:
            return
        b_rows, b_sess, b_src_slot, b_dst_slot, b_src_tier, b_dst_tier, b_kept = self.buffers
        (rows, ids, src_tier, src_slot, dst_tier, dst_slot, session_idx, logical,
         order) = plan_arrays(self._n, b_rows, b_sess, b_src_slot, b_dst_slot, b_src_tier,
                              b_dst_tier, self.t.gen, self.t.logical, self.t.in_flight,
                              self.s.plan_local)  # in_flight until the plan is confirmed
        kept_now = b_kept[:self._n]  # (count_nonzero: a C call; .any() goes through Python)
        kept = kept_now.copy() if np.count_nonzero(kept_now) else None
        self._n = 0
        names = self.s.names
        # Built here, so trusted (MovePlan.trusted); with checks on, validated as a plan from
        # outside would be.
        make = MovePlan if self.check else MovePlan.trusted
        plan = make(self.epoch, ids, src_tier, src_slot, dst_tier, dst_slot, session_idx, logical,
                    tuple([names[i] for i in order.tolist()]),  # type: ignore[misc]
                    **({} if kept is None else {"kept": kept}))
        self.plans.append(plan)
        self.plan_rows.append(rows)
        self.drops.append([])
        self.epoch += 1

    def moved_sessions(self) -> np.ndarray:
        """Sessions of the rows moved so far in this step (with repeats): the only sessions
        whose block count on a tier grew during the step."""
        parts = [self.t.session[rows] for rows in self.plan_rows]
        parts.append(self.buffers[1][:self._n])
        return np.concatenate(parts).astype(np.int64)

    def left_l3_sessions(self) -> np.ndarray:
        """Sessions that moved blocks out of L3 in this step."""
        if not self.left_l3:
            return np.zeros(0, dtype=np.int32)
        return np.unique(np.concatenate(self.left_l3))

    def emptied_l3(self) -> list[int]:
        """Sessions that moved blocks out of L3 in this step and hold none there now, and whose
        records are not discarded already: their L3 records are of no more use (a block is in
        one tier; if it goes down again it is written again)."""
        if not self.left_l3 or self.t.keep_l3:  # (with copies, segments stay)
            return []
        sess = self.left_l3[0] if len(self.left_l3) == 1 else np.concatenate(self.left_l3)
        gone = emptied_sessions(sess, self.s.counts[SSD + 1], self.s.plan_local)
        if len(gone) == 0:
            return []
        return sorted(set(gone.tolist()).difference(self.ssd_dropped))

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

