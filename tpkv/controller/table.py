"""The global block table: struct-of-arrays metadata per block, free lists per tier, integrity."""

from __future__ import annotations

import numpy as np

from tpkv.controller.policy import fold_access, shift_ticks
from tpkv.controller.slotstack import SlotStack
from tpkv.controller.spillpace import SpillPacer
from tpkv.controller.stepkernels import keep_promoted, written_kept
from tpkv.errors import TierFullError
from tpkv.protocol.plan import Tier

NEVER = -1  # a tick that never happened
# Tier values as plain ints: attribute access on an enum class costs ~1 us in a hot loop.
NONE, HBM, DRAM, SSD = int(Tier.NONE), int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
PIN_EXPLICIT = np.uint8(1)
_ID_SHIFT = 32
_ROW_MASK = (1 << _ID_SHIFT) - 1
TIER_INDEX = {NONE: 0, HBM: 1, DRAM: 2, SSD: 3}  # column of per-tier counts


class BlockTable:
    """Where every block is (tier, slot) and what the policy knows about it, one row per block.

    A block id is `(generation << 32) | row`: rows are reused after a session closes, ids never.
    Access statistics (last_tick, hist, count) are folded in lazily from the session's run
    history (`fold_runs`): every block of a session is read whenever it runs.
    """

    # One entry per row; 43 bytes a block with lru_k=2 (plus 4 for the free-row stack).
    gen: np.ndarray  # int32
    tier: np.ndarray  # int8, a Tier value
    slot: np.ndarray  # int32
    session: np.ndarray  # int32
    logical: np.ndarray  # int32
    attn: np.ndarray  # float32
    last_tick: np.ndarray  # int32
    hist: np.ndarray  # int32 [rows, lru_k - 1]
    count: np.ndarray  # int32
    runs_seen: np.ndarray  # int32
    pinned: np.ndarray  # uint8
    in_flight: np.ndarray  # uint8
    demoted_at: np.ndarray  # float32
    l3copy: np.ndarray  # uint8

    def __init__(self, l1_slots: int, l2_slots: int, l3_capacity: int, lru_k: int,
                 capacity: int, keep_l3: bool = False) -> None:
        self.l3_capacity = l3_capacity
        # A block loaded back from L3, or recomputed by choice from tokens its record holds
        # (demand.keep_records), keeps its record (an L3 copy) while it is not written:
        # whenever L3 is on (the controller passes l3_enabled)
        self.keep_l3 = keep_l3
        # L3 records that are not blocks in L3 (SessionTable.l3_other summed): copies of blocks
        # loaded back (flag l3copy on their rows) and dead records. They hold L3 room until
        # their session's segment goes (PlanBuilder.drop_segments).
        self.l3_other = 0
        # L3 room not free yet though no block holds it (the files stay until the ranks apply a
        # later step): blocks that left L3 in the step being built, and those of the last step
        # plus a block for the segment header of each session it emptied (end_l3_step). A
        # reservation for planning: num_free(SSD) may go below 0; used(SSD) never passes the
        # capacity.
        self.l3_held_now = 0
        self.l3_held_last = 0
        self.lru_k = lru_k
        # Slots given back are handed out after every slot free before them (SlotStack's
        # "oldest"): a copy into L1, or new K/V, does not wait for the demotion that just
        # emptied its slot, nor an L3 load for the spill that still reads its L2 slot
        self.free = {HBM: SlotStack(l1_slots, "L1", "oldest"),
                     DRAM: SlotStack(l2_slots, "L2", "oldest")}
        self.owner = {HBM: np.full(l1_slots, -1, dtype=np.int32),
                      DRAM: np.full(l2_slots, -1, dtype=np.int32)}
        self.num_in = np.zeros(4, dtype=np.int64)  # live blocks per TIER_INDEX column
        # L2 slots kept as copies of L1 blocks: kept[z] is the L2 slot holding the bytes of the
        # block in L1 slot z (-1: none), neither free nor a block's place. A demotion of such a
        # block copies nothing; when L2 runs short they are given back first. Indexed by L1 slot,
        # not by row: 4 bytes per L1 slot instead of per tracked block.
        self.kept = np.full(l1_slots, -1, dtype=np.int32)
        self.num_kept = 0
        # A promotion keeps its L2 slots as copies only while this many other L2 slots stay
        # free: a full L2 would give them back at once, each time scanning every L1 slot for
        # the coldest (bench/controller.py: p99 1.1 -> 3-4.5 ms a step without this).
        self.keep_reserve = l2_slots // 8
        self.capacity = 0
        self.free_rows = SlotStack(0, "block table")
        # L2 slots spills still read, and spills ahead of need (the controller configures it)
        self.pace = SpillPacer()
        self._alloc_arrays(capacity)

    # ---- storage -------------------------------------------------------------------------------
    def _alloc_arrays(self, capacity: int) -> None:
        def grow(name: str, dtype: type, fill: float, shape: tuple[int, ...] = ()) -> None:
            new: np.ndarray = np.full((capacity, *shape), fill, dtype=dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[:len(old)] = old
            setattr(self, name, new)

        grow("gen", np.int32, 0)  # generation of the row, part of the block id
        grow("tier", np.int8, NONE)
        grow("slot", np.int32, -1)  # L1/L2 slot; -1 on L3 (addressed by session, logical)
        grow("session", np.int32, -1)  # session index; -1 for a free row
        grow("logical", np.int32, -1)  # block index inside its session
        grow("attn", np.float32, 0.0)  # cumulative attention mass
        grow("last_tick", np.int32, NEVER)  # tick of the latest access folded in
        grow("hist", np.int32, NEVER, (max(self.lru_k - 1, 0),))  # older accesses, newest first
        grow("count", np.int32, 0)  # accesses folded in
        grow("runs_seen", np.int32, 0)  # session run count when last folded in
        grow("pinned", np.uint8, 0)  # PIN_EXPLICIT bit
        grow("in_flight", np.uint8, 0)  # 1 while a plan that moved the block is unconfirmed
        grow("demoted_at", np.float32, -np.inf)  # seconds since start of the last demotion
        # 1: the block (in L1 or L2) was loaded from L3, or recomputed from the tokens its L3
        # record holds, and not written since: its record in the session's segment holds its
        # bytes, so a spill of it writes nothing
        grow("l3copy", np.uint8, 0)
        if self.capacity:
            self.free_rows.grow(capacity)
        else:
            self.free_rows = SlotStack(capacity, "block table")
        self.capacity = capacity

    def ensure_rows(self, n: int, limit: int) -> None:
        """Make room for `n` more rows, growing by 1.5x up to `limit`; TierFullError beyond."""
        if n <= self.free_rows.top:
            return
        need = self.capacity - self.free_rows.top + n
        if need > limit:
            raise TierFullError(f"block table needs {need} rows, at most {limit} tracked "
                                f"(PolicyConfig.max_tracked_blocks)")
        self._alloc_arrays(min(max(need, self.capacity + self.capacity // 2), limit))

    def nbytes(self) -> int:
        names = ("gen", "tier", "slot", "session", "logical", "attn", "last_tick", "hist",
                 "count", "runs_seen", "pinned", "in_flight", "demoted_at", "l3copy")
        return sum(getattr(self, n).nbytes for n in names) + self.free_rows.stack.nbytes

    def fold_runs(self, rows: np.ndarray, runs: np.ndarray, run_hist: np.ndarray) -> None:
        """Fold the runs of the rows' sessions (SessionTable.runs, run_hist) into the blocks'
        own access history (LRU-K)."""
        sess = self.session[rows]
        self.last_tick[rows], self.hist[rows], self.count[rows], self.runs_seen[rows] = \
            fold_access(self.last_tick[rows], self.hist[rows], self.count[rows],
                        self.runs_seen[rows], runs[sess], run_hist[:, sess].T)

    def rebase_ticks(self, shift: int) -> None:
        """Ticks `shift` earlier (never below 0; -1, none, stays)."""
        shift_ticks(self.last_tick, shift)
        shift_ticks(self.hist, shift)

    # ---- ids -----------------------------------------------------------------------------------
    def ids(self, rows: np.ndarray) -> np.ndarray:
        ids = np.left_shift(self.gen[rows], _ID_SHIFT, dtype=np.int64)
        ids |= rows
        return ids

    def rows_of(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of block ids and a mask of the ids that name a live block."""
        ids = np.asarray(block_ids, dtype=np.int64)
        rows = ids & _ROW_MASK
        ok = (ids >= 0) & (rows < self.capacity)
        rows = np.where(ok, rows, 0)
        ok &= (self.gen[rows] == (ids >> _ID_SHIFT)) & (self.session[rows] >= 0)
        return rows, ok

    # ---- counts --------------------------------------------------------------------------------
    def used(self, tier: int) -> int:
        return int(self.num_in[TIER_INDEX[tier]])

    def slots(self, tier: int) -> int:
        """The tier's capacity now: L2 grows to its full size as the ranks pin it."""
        return self.l3_capacity if tier == SSD else self.free[tier].size

    def full_slots(self, tier: int) -> int:
        """The pool's size on every rank (L1, L2), online or not."""
        return len(self.owner[tier])

    def set_l2_online(self, num_slots: int) -> int:
        """L2 slots [0, num_slots) may be handed out (the ranks have pinned them; 0 when the
        first arena was refused); -> the online count after the call. It grows to the pool's
        size; it shrinks only over slots that are all free (a restarted controller told less
        than it assumed)."""
        stack, full = self.free[DRAM], len(self.owner[DRAM])
        n = min(max(int(num_slots), 0), full)
        if n > stack.size:
            stack.grow(n)
        elif n < stack.size and not stack.shrink(n):  # a slot past n is used or kept
            return stack.size
        self.keep_reserve = stack.size // 8
        return stack.size

    @property
    def l3_held(self) -> int:
        return self.l3_held_now + self.l3_held_last

    def free_records(self, other: np.ndarray, sessions: np.ndarray | int) -> None:
        """The segments of `sessions` are deleted (the ranks do it when they apply the step):
        the room of their records that are not blocks in L3 (`other`: SessionTable.l3_other,
        zeroed for them here) is held like freed room (l3_held)."""
        n = int(np.sum(other[sessions]))
        self.l3_other -= n
        self.l3_held_now += n
        other[sessions] = 0

    def end_l3_step(self, emptied: int) -> None:
        """At the end of a step's build: the last step's room is free now (its files went when
        the ranks applied it); this step's, with `emptied` header blocks, is held one more.
        With L3 copies (keep_l3) room is freed only by deleting whole segments, which the
        ranks do when they apply this step, before the next step's spills: free from the
        next step's build on."""
        held = 0 if self.keep_l3 else self.l3_held_now
        self.l3_held_last, self.l3_held_now = held + emptied, 0

    def num_free(self, tier: int) -> int:
        """Slots a plan may still fill: on L2 the kept copies count (they are given back on
        demand, and a demotion of their own block needs no other slot)."""
        if tier == SSD:
            return self.l3_capacity - self.used(SSD) - self.l3_other - self.l3_held
        return self.free[tier].top + (self.num_kept if tier == DRAM else 0)

    # ---- kept L2 copies ------------------------------------------------------------------------
    def keep(self, rows: np.ndarray, slots: np.ndarray, kept_last: np.ndarray) -> None:
        """Rows just promoted keep their old L2 `slots` as copies, in order, while still in L1
        and while L2 keeps `keep_reserve` other slots free; their sessions are flagged in
        `kept_last` (SessionTable.kept_last), not counting slots spills still read (SlotStack.
        cooling). The other slots are freed."""
        room = max(self.free[DRAM].clean - self.keep_reserve, 0)
        num, rest = keep_promoted(rows, slots, room, self.tier, self.slot, self.session,
                                  self.kept, kept_last)
        self.num_kept += num
        if len(rest):
            self.free[DRAM].push(rest)

    def forget_kept_at(self, l1_slots: np.ndarray) -> None:
        """The copies kept for the blocks in these L1 slots (each has one) are spent: a
        demotion goes back into them."""
        self.kept[l1_slots] = -1
        self.num_kept -= len(l1_slots)

    def take_written(self, batch: np.ndarray, before: np.ndarray, rewrite: np.ndarray,
                     after: np.ndarray, block_tokens: int, arena: np.ndarray, start: np.ndarray,
                     kept_last: np.ndarray, l3_last: np.ndarray) -> np.ndarray:
        """Forget the L2 copies of the blocks a step writes into that held tokens (also the
        `rewrite` tokens before `before`) and void their L3 copies (stepkernels.written_kept);
        return the L2 slots, for the caller to free."""
        slots = written_kept(batch, before, rewrite, after, block_tokens, arena, start,
                             self.tier, self.slot, self.kept, kept_last, self.l3copy, l3_last)
        self.num_kept -= len(slots)
        return slots

    def kept_of(self, rows: np.ndarray) -> np.ndarray:
        """The L2 slot kept for each of `rows`, all in L1 (-1 where none)."""
        return self.kept[self.slot[rows]]

    def take_kept(self, rows: np.ndarray) -> np.ndarray:
        """Forget the kept copies of `rows` and return their slots (-1 where none, or where a
        row is not in L1), for the caller to reuse or free."""
        out = np.full(len(rows), -1, dtype=np.int32)
        on = self.tier[rows] == HBM
        z = self.slot[rows[on]]
        out[on] = self.kept[z]
        self.kept[z] = -1
        self.num_kept -= int(np.count_nonzero(out >= 0))
        return out

    def drop_kept(self, rows: np.ndarray) -> None:
        """The blocks `rows` are (or may be) written: their L2 copies are stale; free them."""
        if self.num_kept == 0 or len(rows) == 0:
            return
        slots = self.take_kept(np.unique(rows))  # (a row named twice gives its slot once)
        slots = slots[slots >= 0]
        if len(slots):
            self.free[DRAM].push(slots)

    def reclaim_kept(self, n: int) -> None:
        """Free at least `n` kept L2 copies (all of them if fewer), those of the blocks read
        longest ago first."""
        if n <= 0 or self.num_kept == 0:
            return
        rows = self.owner[HBM][np.flatnonzero(self.kept >= 0)]
        if n < len(rows):
            rows = rows[np.argpartition(self.last_tick[rows], n - 1)[:n]]
        self.drop_kept(rows)

    def clear_kept(self) -> None:
        """Free every kept copy (a resync: the workers' L2 bytes are no longer vouched for)."""
        self.drop_kept(self.owner[HBM][np.flatnonzero(self.kept >= 0)])

    # ---- state changes (callers keep per-session counts via the returned old tiers) -----------
    def alloc_rows(self, sessions: np.ndarray, logicals: np.ndarray, tick: int,
                   runs: np.ndarray, l1_slots: np.ndarray) -> np.ndarray:
        """Rows for blocks created in the current run, in the given L1 slots. Free rows hold
        the defaults already (fresh, or reset by release_rows): only the rest is written."""
        rows = self.free_rows.pop(len(sessions))
        self.session[rows] = sessions
        self.logical[rows] = logicals
        self.last_tick[rows] = tick
        self.count[rows] = 1
        self.runs_seen[rows] = runs
        self.tier[rows] = HBM
        self.slot[rows] = l1_slots
        self.owner[HBM][l1_slots] = rows
        self.num_in[HBM + 1] += len(rows)
        return rows

    def release_rows(self, rows: np.ndarray) -> None:
        """Forget blocks (their session closed): free their slots and rows, bump generations."""
        self.set_tier(rows, NONE, np.full(len(rows), -1, dtype=np.int32), free_src=True)
        self.num_in[0] -= len(rows)
        self.session[rows] = -1
        self.logical[rows] = -1
        self.attn[rows] = 0.0
        self.last_tick[rows] = NEVER
        self.hist[rows] = NEVER
        self.count[rows] = 0
        self.runs_seen[rows] = 0
        self.in_flight[rows] = 0
        self.pinned[rows] = 0
        self.demoted_at[rows] = -np.inf
        self.gen[rows] += 1
        self.free_rows.push(rows)

    def set_tier(self, rows: np.ndarray, dst: int, dst_slots: np.ndarray,
                 free_src: bool, dead: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Put `rows` at (dst, dst_slots); return their old (tiers, slots). With free_src the old
        L1/L2 slots go back to the free lists now; otherwise the caller frees them later. Their
        L3 copies are void. `dead` (SessionTable.l3_other, with keep_l3): the records of rows
        that leave L3 stay in their sessions' segments, dead, instead of freeing room."""
        self.drop_kept(rows)
        self.l3copy[rows] = 0
        old_tier = self.tier[rows].copy()
        old_slot = self.slot[rows].copy()
        for t in (HBM, DRAM):
            sel = old_tier == t
            if sel.any():
                self.owner[t][old_slot[sel]] = -1
                if free_src:
                    self.free[t].push(old_slot[sel])
        left = np.bincount(old_tier.astype(np.int64) + 1, minlength=4)
        self.num_in -= left
        gone = int(left[TIER_INDEX[SSD]])
        if gone and dead is not None and self.keep_l3:
            np.add.at(dead, self.session[rows[old_tier == SSD]], 1)
            self.l3_other += gone
        else:
            self.l3_held_now += gone
        self.tier[rows] = dst
        self.slot[rows] = dst_slots
        if dst in self.owner:
            self.owner[dst][dst_slots] = rows
        self.num_in[TIER_INDEX[dst]] += len(rows)
        if dst == SSD and self.used(SSD) + self.l3_other > self.l3_capacity:
            raise AssertionError(f"L3 over capacity: {self.used(SSD)} blocks and "
                                 f"{self.l3_other} other records > {self.l3_capacity}")
        return old_tier, old_slot

    # ---- integrity -----------------------------------------------------------------------------
    def check_integrity(self, settled: bool = True) -> None:
        """Every live block in exactly one tier; free lists, owners, counts and capacities agree.
        `settled`: no slot is held back by a plan under construction, so used + free = capacity.
        Raises AssertionError naming the first broken invariant (used by tests)."""
        live = self.session >= 0
        free_rows = self.free_rows.stack[:self.free_rows.top]
        assert len(np.unique(free_rows)) == len(free_rows), "free row list has duplicates"
        assert not live[free_rows].any(), "a free row belongs to a session"
        assert int(live.sum()) == self.capacity - self.free_rows.top, "live rows != capacity-free"
        tier = self.tier[live]
        assert np.isin(tier, [t.value for t in Tier]).all(), "unknown tier value"
        assert (self.tier[~live] == NONE).all(), "a free row has a tier"
        for t, col in TIER_INDEX.items():
            assert int((tier == t).sum()) == self.num_in[col], f"count of {Tier(t).name} is off"
        slot = self.slot[live]
        assert (slot[(tier == NONE) | (tier == SSD)] == -1).all(), "slot off-pool"
        assert self.used(SSD) + self.l3_other <= self.l3_capacity, "L3 over capacity"
        assert (self.l3copy[~live] == 0).all(), "a free row is flagged as copied in L3"
        assert ((self.l3copy[live] == 0) | (tier == HBM) | (tier == DRAM)).all(), \
            "a block outside L1/L2 is flagged as copied in L3"
        assert self.keep_l3 or (self.l3copy == 0).all(), "an L3 copy without keep_l3"
        rows = np.flatnonzero(live)
        for t in (HBM, DRAM):
            owner, stack, name = self.owner[t], self.free[t], Tier(t).name
            on = rows[tier == t]
            assert len(np.unique(self.slot[on])) == len(on), f"{name}: two blocks share a slot"
            assert ((self.slot[on] >= 0) & (self.slot[on] < stack.size)).all(), "slot range"
            assert (owner[self.slot[on]] == on).all(), f"{name}: owner map disagrees"
            assert int((owner >= 0).sum()) == len(on), f"{name}: stale owner entries"
            free = stack.stack[:stack.top]
            assert len(np.unique(free)) == len(free), f"{name}: free list has duplicates"
            assert (owner[free] == -1).all(), f"{name}: a free slot is owned"
            extra = 0
            if t == DRAM:  # kept copies: of live L1 blocks, in slots neither owned nor free
                at = np.flatnonzero(self.kept >= 0)
                ks = self.kept[at]
                extra = len(at)
                assert extra == self.num_kept, f"kept copies {extra} != count {self.num_kept}"
                assert (self.owner[HBM][at] >= 0).all(), "an L2 copy kept for a free L1 slot"
                assert len(np.unique(ks)) == extra, "two kept copies share an L2 slot"
                assert ((ks >= 0) & (ks < stack.size)).all(), "kept slot range"
                assert (owner[ks] == -1).all(), "a kept L2 copy sits in an owned slot"
                assert not np.isin(ks, free).any(), "a kept L2 copy sits in a free slot"
            assert len(on) + stack.top + extra <= stack.size, f"{name}: used + free > capacity"
            assert (owner[stack.size:] == -1).all(), f"{name}: a slot past the online ones is owned"
            if settled:
                assert len(on) + stack.top + extra == stack.size, \
                    f"{name}: slot neither used nor free"
