"""SlotMirror: one rank's own record of where each block is, kept in step with its tier pools."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.protocol.digest import slot_map_digest
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.kernels import check_moves
from tpkv.workers.slots import SlotAllocator

log = logging.getLogger(__name__)

_ROW_MASK = (1 << 32) - 1  # a block id is (generation << 32) | row (tpkv.controller.table)
NONE, HBM, DRAM, SSD = int(Tier.NONE), int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)


@dataclass(frozen=True)
class Relocation:
    """Blocks whose place on this rank differs from the controller's table after a resync:
    block i is at (src_tier[i], src_slot[i]) here and belongs at (dst_tier[i], dst_slot[i])."""

    block_ids: np.ndarray
    src_tier: np.ndarray
    src_slot: np.ndarray
    dst_tier: np.ndarray
    dst_slot: np.ndarray
    sessions: tuple[str, ...]  # per block
    logical_idx: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique without its hashing pass, by a stable (merge) sort: quick on sorted runs."""
    a = np.sort(a, kind="stable")
    keep = np.ones(len(a), dtype=bool)
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


class SlotMirror:
    """block id -> (tier, slot, session, logical) as arrays indexed by table row, plus the L1 and
    L2 SlotAllocators of the rank's pools, which it keeps equal to the map, and an index of
    the rows each session was given, so that a lookup of one session's blocks
    (session_logical) costs its own rows, not a pass over the map.

    It never decides: it checks that a plan's moves start where this rank's map says (a move that
    does not is refused and reported), and records what was applied.
    """

    def __init__(self, l1: SlotAllocator, l2: SlotAllocator, capacity: int = 1024) -> None:
        self.alloc = {HBM: l1, DRAM: l2}
        self.owner = {t: np.full(a.num_slots, -1, dtype=np.int64) for t, a in self.alloc.items()}
        self.ids = np.full(capacity, -1, dtype=np.int64)
        self.tier = np.full(capacity, NONE, dtype=np.int8)
        self.slot = np.full(capacity, -1, dtype=np.int64)
        self.session = np.full(capacity, -1, dtype=np.int32)
        self.logical = np.full(capacity, -1, dtype=np.int64)
        self.names: list[str] = []
        self._name_idx: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        # Per session index: the rows it was placed in (each chunk sorted, unique), a superset
        # of its rows that lookups narrow to those the map still gives it (_session_rows)
        self._rows: dict[int, list[np.ndarray]] = {}
        # Per session index: a count bumped by every change to its rows (placed, moved,
        # dropped, released), and session_logical's answers as of a count (read-only arrays)
        self._changes = np.zeros(16, dtype=np.int64)
        self._logical: dict[int, dict[int, tuple[int, np.ndarray]]] = {}
        # check()'s scratch: per L1 / L2 slot, zero between calls (the pools never resize)
        self._count = (np.zeros(l1.num_slots, np.int64), np.zeros(l2.num_slots, np.int64))

    # ---- lookups ---------------------------------------------------------------------------
    def rows(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, known mask) of block ids."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        rows = ids & _ROW_MASK
        inside = (ids >= 0) & (rows < len(self.ids))
        rows = np.where(inside, rows, 0)
        return rows, inside & (self.ids[rows] == ids)

    def where(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tier, slot) of each block; unknown blocks are (NONE, -1)."""
        rows, known = self.rows(block_ids)
        tier = np.where(known, self.tier[rows], NONE).astype(np.int64)
        return tier, np.where(known, self.slot[rows], -1).astype(np.int64)

    def session_logical(self, name: str, tier: int) -> np.ndarray:
        """Sorted logical indices of the session's blocks this map places on `tier` (its own
        rows only: no pass over the map). Read-only: the same array while none of the
        session's rows changes (a turn outside the batch is asked about every step)."""
        i = self._name_idx.get(name)
        if i is None:
            return np.zeros(0, dtype=np.int64)
        seen = self._logical.setdefault(i, {})
        hit = seen.get(tier)
        if hit is not None and hit[0] == self._changes[i]:
            return hit[1]
        rows = self._session_rows(i)  # (stable sort: see _sorted_unique)
        out = np.sort(self.logical[rows[self.tier[rows] == tier]], kind="stable")
        out.flags.writeable = False
        seen[tier] = (int(self._changes[i]), out)
        return out

    def holder(self, tier: int, slots: np.ndarray) -> np.ndarray:
        """Block ids this map places at (tier, slots[i]), or -1."""
        return self.owner[tier][np.asarray(slots, dtype=np.int64)]

    def digest(self, block_ids: np.ndarray, misses: np.ndarray | None = None) -> int:
        """slot_map_digest of these blocks as placed here; `misses` count as (NONE, -1)."""
        tier, slot = self.where(block_ids)
        if misses is not None and len(misses):
            hit = np.isin(block_ids, misses)
            tier, slot = np.where(hit, NONE, tier), np.where(hit, -1, slot)
        return slot_map_digest(block_ids, tier, slot)

    # ---- checks and updates ----------------------------------------------------------------
    def check(self, plan: MovePlan) -> np.ndarray:
        """Mask of the moves this rank can apply: the block is where the plan says it starts,
        and an L1/L2 destination is free here and not named twice in the plan; an L1
        destination may also be a slot that a move of this plan this rank applies empties
        (PlanBuilder.free_vacated: the executor copies that block out first)."""
        return check_moves(self.ids, self.tier, self.slot, plan.block_ids, plan.src_tier,
                           plan.src_slot, plan.dst_tier, plan.dst_slot, self.owner[HBM],
                           self.owner[DRAM], *self._count)

    def apply(self, plan: MovePlan, done: np.ndarray) -> None:
        """Record the moves in `done` (a mask over the plan's moves) as applied."""
        idx = np.flatnonzero(done)
        if len(idx) == 0:
            return
        rows, _ = self.rows(plan.block_ids[idx])
        self._vacate(rows)
        self._occupy(rows, plan.dst_tier[idx].astype(np.int64), plan.dst_slot[idx])

    def drop(self, block_ids: np.ndarray) -> None:
        """The blocks lost their copy (NONE); their slots are free again."""
        if len(block_ids) == 0:
            return
        rows, known = self.rows(block_ids)
        if not known.all():
            log.warning("drop of %d blocks this rank does not know", int((~known).sum()))
        self._vacate(rows[known])
        self.tier[rows[known]] = NONE
        self.slot[rows[known]] = -1
        self._changed(rows[known])

    def release(self, block_ids: np.ndarray) -> None:
        """Forget the blocks (their session closed)."""
        if len(block_ids) == 0:
            return
        rows, known = self.rows(block_ids)
        rows = rows[known]
        self._vacate(rows)
        self._changed(rows)
        gone = _sorted_unique(self.session[rows])
        self.ids[rows], self.tier[rows], self.slot[rows] = -1, NONE, -1
        self.session[rows], self.logical[rows] = -1, -1
        for i in gone[gone >= 0].tolist():  # their index keeps only the rows still theirs
            if not len(self._session_rows(i)):
                self._logical.pop(i, None)

    def add_fresh(self, block_ids: np.ndarray, slots: np.ndarray, sessions: Sequence[str],
                  logical: np.ndarray) -> np.ndarray:
        """New (or recomputed) blocks in L1 slots the engine writes. Returns the ids of blocks
        this rank still held in those slots: their bytes are overwritten, they are lost here."""
        ids = np.asarray(block_ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        displaced = self.holder(HBM, slots)
        displaced = displaced[(displaced >= 0) & ~np.isin(displaced, ids)]
        if len(displaced):
            log.error("fresh L1 slots still hold %d blocks on this rank (e.g. %d): lost here",
                      len(displaced), int(displaced[0]))
            self.drop(displaced)
        self.put(ids, np.full(len(ids), HBM, dtype=np.int64), slots, sessions, logical)
        return displaced

    def put(self, block_ids: np.ndarray, tiers: np.ndarray, slots: np.ndarray,
            sessions: Sequence[str], logical: np.ndarray) -> None:
        """Place blocks (known or new) at (tiers[i], slots[i]); takes L1/L2 slots."""
        ids = np.asarray(block_ids, dtype=np.int64)
        rows, known = self.rows(ids)
        self._vacate(rows[known])
        raw = ids & _ROW_MASK
        if len(raw) and int(raw.max()) >= len(self.ids):
            self._grow(int(raw.max()) + 1)
        self.ids[raw] = ids
        self._occupy(raw, np.asarray(tiers, dtype=np.int64), np.asarray(slots, dtype=np.int64))
        idx = np.array([self._intern(s) for s in sessions], dtype=np.int32)
        self.session[raw] = idx
        self.logical[raw] = logical
        self._index(raw, idx)

    # ---- whole-map export and restore ------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """The map in the form Controller.slot_map() and Controller.rebuild() use."""
        rows = np.flatnonzero(self.ids >= 0)
        used = np.unique(self.session[rows])
        local = np.searchsorted(used, self.session[rows])
        names = [self.names[i] for i in used.tolist()]
        out: dict[str, Any] = {
            "block_ids": self.ids[rows].copy(), "tiers": self.tier[rows].copy(),
            "slots": self.slot[rows].copy(), "session_idx": local.astype(np.int32),
            "logical_idx": self.logical[rows].copy(), "session_names": names,
            "session_tokens": {n: self.tokens.get(n, 0) for n in names}}
        out["digest"] = slot_map_digest(out["block_ids"], out["tiers"], out["slots"])
        return out

    def restore(self, slot_map: Mapping[str, Any]) -> Relocation:
        """Take the controller's map as the truth; return the blocks that must move here so the
        bytes follow (where this rank holds them somewhere else)."""
        ids = np.asarray(slot_map["block_ids"], dtype=np.int64).reshape(-1)
        tiers = np.asarray(slot_map["tiers"], dtype=np.int64).reshape(-1)
        slots = np.asarray(slot_map["slots"], dtype=np.int64).reshape(-1)
        names = list(slot_map["session_names"])
        sess = [names[i] for i in np.asarray(slot_map["session_idx"]).reshape(-1).tolist()]
        logical = np.asarray(slot_map["logical_idx"], dtype=np.int64).reshape(-1)
        here_tier, here_slot = self.where(ids)
        moved = (here_tier != tiers) | (((tiers == HBM) | (tiers == DRAM)) & (here_slot != slots))
        moved &= tiers != NONE
        idx = np.flatnonzero(moved)
        relocation = Relocation(ids[idx], here_tier[idx], here_slot[idx], tiers[idx], slots[idx],
                                tuple(sess[i] for i in idx.tolist()), logical[idx])
        for t, alloc in self.alloc.items():
            alloc.free(alloc.used_slots())
            self.owner[t][:] = -1
        self.ids[:], self.tier[:], self.slot[:] = -1, NONE, -1
        self.session[:], self.logical[:] = -1, -1
        self._rows, self._logical = {}, {}
        self.put(ids, tiers, slots, sess, logical)
        self.tokens = {str(k): int(v) for k, v in dict(slot_map.get("session_tokens", {})).items()}
        return relocation

    # ---- internals -------------------------------------------------------------------------
    def _vacate(self, rows: np.ndarray) -> None:
        """Free the L1/L2 slots of these rows (their tier and slot entries stay as they are)."""
        for t, alloc in self.alloc.items():
            on = rows[self.tier[rows] == t]
            if len(on):
                alloc.free(self.slot[on])
                self.owner[t][self.slot[on]] = -1

    def _occupy(self, rows: np.ndarray, tiers: np.ndarray, slots: np.ndarray) -> None:
        """Place rows at (tiers, slots), taking L1/L2 slots; SSD and NONE hold no slot."""
        slots = np.where((tiers == HBM) | (tiers == DRAM), slots, -1)
        for t, alloc in self.alloc.items():
            on = tiers == t
            if on.any():
                alloc.take(slots[on])
                self.owner[t][slots[on]] = self.ids[rows[on]]
        self.tier[rows] = tiers
        self.slot[rows] = slots
        self._changed(rows)

    def _changed(self, rows: np.ndarray) -> None:
        """The rows' sessions changed (a session named twice counts once: enough)."""
        sessions = self.session[rows]
        self._changes[sessions[sessions >= 0]] += 1

    def _index(self, rows: np.ndarray, sessions: np.ndarray) -> None:
        """Note that rows[k] now holds a block of session sessions[k] (put: the only place
        that gives a row a session, so the index misses none)."""
        if len(rows) == 0:
            return
        self._changes[sessions] += 1
        order = np.argsort(sessions, kind="stable")
        sessions, rows = sessions[order], rows[order]
        cuts = np.flatnonzero(np.diff(sessions)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
            i = int(sessions[a])
            chunks = self._rows.setdefault(i, [])
            chunks.append(_sorted_unique(rows[a:b]))
            if len(chunks) > 16:  # (amortized: a session's many small puts, one at a time)
                self._session_rows(i)

    def _session_rows(self, i: int) -> np.ndarray:
        """Sorted rows whose block the map gives session i; its index is left as just those."""
        chunks = self._rows.get(i)
        if not chunks:
            return np.zeros(0, dtype=np.int64)
        rows = chunks[0] if len(chunks) == 1 else _sorted_unique(np.concatenate(chunks))
        # (a row has a session only while it has a block: put sets both, release clears both)
        theirs = self.session[rows] == i
        if len(chunks) == 1 and theirs.all():
            return rows
        rows = rows[theirs]
        if len(rows):
            self._rows[i] = [rows]
        else:
            del self._rows[i]
        return rows

    def _intern(self, name: str) -> int:
        i = self._name_idx.get(name)
        if i is None:
            i = self._name_idx[name] = len(self.names)
            self.names.append(name)
            if i >= len(self._changes):
                self._changes = np.concatenate([self._changes, np.zeros_like(self._changes)])
        return i

    def _grow(self, need: int) -> None:
        size = max(need, len(self.ids) + len(self.ids) // 2)
        for name, fill in (("ids", -1), ("tier", NONE), ("slot", -1), ("session", -1),
                           ("logical", -1)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

