"""SlotMapReplica: a worker's copy of the slot map, kept from StepResults; checks plan rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpkv.protocol.digest import plan_digest, slot_map_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MovePlan, MoveResult, Tier


class ContractError(AssertionError):
    """A plan broke a rule workers rely on (tests turn this into a failure)."""


class SlotMapReplica:
    """What one rank knows: block id -> (tier, slot, session, logical), and its L3 records.

    It applies a StepResult in the documented order and checks, per plan: epochs in order,
    every source is where the map says, moves only between adjacent tiers, and no destination
    slot is occupied or vacated by the same plan, but for L1 slots the plan's own moves empty
    (PlanBuilder.free_vacated). Torch-free; the tests use it as a fake worker.
    """

    def __init__(self, rank: int, l1_slots: int, l2_slots: int,
                 block_tokens: int | None = None) -> None:
        self.rank = rank
        # With block_tokens: what each L1/L2 slot holds, as (block id, version), a version
        # being one content of a block (bumped when a step writes it), so that a kept move (no
        # copy) is checked to find its block's current bytes in the L2 slot.
        self.block_tokens = block_tokens
        self.version: dict[int, int] = {}
        self.content: dict[tuple[int, int], tuple[int, int]] = {}
        self.named: dict[tuple[str, int], int] = {}  # (session, logical) -> block id
        self.where: dict[int, tuple[int, int, str, int]] = {}
        self.pools = {int(Tier.HBM): np.full(l1_slots, -1, dtype=np.int64),
                      int(Tier.DRAM): np.full(l2_slots, -1, dtype=np.int64)}
        # L3 records per session: logical -> (block id, version) of the newest record, and
        # how many records its segment holds (each spill that writes appends; dead ones too)
        self.records: dict[str, dict[int, tuple[int, int]]] = {}
        self.num_records: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.epoch = 0
        self.tick = 0

    def apply_step(self, result: StepResult,
                   misses: Mapping[int, Sequence[int]] | None = None) -> list[MoveResult]:
        """Apply everything a step asks; `misses` maps epoch -> block ids whose read fails."""
        misses = misses or {}
        for bid in result.released_block_ids.tolist():
            self._forget(bid)
        out = []
        for i, plan in enumerate(result.plans):
            self._drop(result.drops[i])
            out.append(self.apply_plan(plan, misses.get(plan.epoch, ())))
        self._drop(result.drops[-1] if result.drops else np.zeros(0, dtype=np.int64))
        for bid, slot, pos, logical in zip(result.fresh_block_ids.tolist(),
                                           result.fresh_slots.tolist(),
                                           result.fresh_session_idx.tolist(),
                                           result.fresh_logical.tolist()):
            name = result.session_ids[pos]
            old = self.where.get(bid)
            if old is not None and old[0] != Tier.NONE:
                raise ContractError(f"fresh block {bid} still has a copy at {old[:2]}")
            self._put(bid, int(Tier.HBM), slot, name, logical)
        if self.block_tokens is not None:
            self._written(result)
        for name, tokens in zip(result.session_ids, result.num_tokens.tolist()):
            self.tokens[name] = tokens
        for name in (*result.closed_sessions, *result.ssd_dropped_sessions):
            self.records.pop(name, None)
            self.num_records.pop(name, None)
        for name in result.closed_sessions:
            self.tokens.pop(name, None)
        self.tick = result.tick
        return out

    def apply_plan(self, plan: MovePlan, misses: Sequence[int] | np.ndarray = ()) -> MoveResult:
        if plan.epoch != self.epoch + 1:
            raise ContractError(f"rank {self.rank}: plan {plan.epoch} after {self.epoch}")
        vacated = {(int(t), int(s)) for t, s in zip(plan.src_tier, plan.src_slot) if t != Tier.SSD}
        for bid, st, ss, dt, ds, si, lg in zip(
                plan.block_ids.tolist(), plan.src_tier.tolist(), plan.src_slot.tolist(),
                plan.dst_tier.tolist(), plan.dst_slot.tolist(), plan.session_idx.tolist(),
                plan.logical_idx.tolist()):
            name = plan.session_names[si]
            if self.where.get(bid) != (st, ss, name, lg):
                raise ContractError(f"block {bid}: plan says ({st}, {ss}, {name}, {lg}), map "
                                    f"says {self.where.get(bid)}")
            if abs(dt - st) != 1:
                raise ContractError(f"block {bid}: move {st} -> {dt} skips a tier")
            if dt == Tier.HBM and (dt, ds) in vacated:
                pass  # an L1 slot the plan empties, then fills (PlanBuilder.free_vacated)
            elif dt != Tier.SSD and ((dt, ds) in vacated or self.pools[dt][ds] >= 0):
                raise ContractError(f"block {bid}: destination slot {ds} of tier {dt} is busy "
                                    f"or vacated in the same plan {plan.epoch}")
            if st == Tier.SSD and lg not in self.records.get(name, {}):
                raise ContractError(f"block {bid}: no L3 record {name}/{lg} to read")
        kept = plan.kept_mask()
        for bid, st, dt, ds, si, lg, k in zip(
                plan.block_ids.tolist(), plan.src_tier.tolist(), plan.dst_tier.tolist(),
                plan.dst_slot.tolist(), plan.session_idx.tolist(), plan.logical_idx.tolist(),
                kept.tolist()):
            now = (bid, self.version.get(bid, 0))
            name = plan.session_names[si]
            on_disk = self.records.get(name, {}).get(lg)
            checked = self.block_tokens is not None
            if k and dt == Tier.DRAM and checked and self.content.get((1, ds)) != now:
                raise ContractError(f"block {bid}: kept move into L2 slot {ds}, which holds "
                                    f"{self.content.get((1, ds))}, not its bytes {now}")
            if (k and dt == Tier.SSD or st == Tier.SSD) and checked and on_disk != now:
                raise ContractError(f"block {bid}: {'kept spill' if k else 'load'} of L3 record "
                                    f"{name}/{lg}, which holds {on_disk}, not its bytes {now}")
            if dt == Tier.SSD and not k:  # a spill that writes: a record appended
                self.records.setdefault(name, {})[lg] = now
                self.num_records[name] = self.num_records.get(name, 0) + 1
        for bid in plan.block_ids.tolist():
            self._vacate(bid)
        for bid, dt, ds, si, lg in zip(plan.block_ids.tolist(), plan.dst_tier.tolist(),
                                       plan.dst_slot.tolist(), plan.session_idx.tolist(),
                                       plan.logical_idx.tolist()):
            self._put(bid, dt, ds, plan.session_names[si], lg)
            if dt != Tier.SSD:  # a copy brings the block's bytes (a kept move finds them)
                self.content[(dt, ds)] = (bid, self.version.get(bid, 0))
        # A miss (bad CRC, short read) leaves the slot map as planned, with unusable bytes in the
        # destination; the controller drops the block in the next step (drops[0]).
        miss = np.asarray(sorted(int(x) for x in misses), dtype=np.int64)
        self.epoch = plan.epoch
        return MoveResult(epoch=plan.epoch, rank=self.rank, moves_applied=plan.num_moves,
                          slot_map_digest=plan_digest(plan, miss), miss_block_ids=miss)

    def export(self) -> dict[str, Any]:
        """The slot map in the form Controller.rebuild takes."""
        names = sorted({v[2] for v in self.where.values()} | set(self.tokens))
        index = {n: i for i, n in enumerate(names)}
        ids = np.asarray(sorted(self.where), dtype=np.int64)
        vals = [self.where[int(b)] for b in ids]
        return {"rank": self.rank, "epoch": self.epoch, "tick": self.tick, "block_ids": ids,
                "tiers": np.asarray([v[0] for v in vals], dtype=np.int8),
                "slots": np.asarray([v[1] for v in vals], dtype=np.int64),
                "session_idx": np.asarray([index[v[2]] for v in vals], dtype=np.int32),
                "logical_idx": np.asarray([v[3] for v in vals], dtype=np.int64),
                "session_names": names, "session_tokens": dict(self.tokens)}

    def manifests(self) -> dict[str, list[int]]:
        return {n: sorted(r) for n, r in sorted(self.records.items()) if r}

    def digest(self) -> int:
        ids = np.asarray(list(self.where), dtype=np.int64)
        return slot_map_digest(ids, np.asarray([v[0] for v in self.where.values()], np.int64),
                               np.asarray([v[1] for v in self.where.values()], np.int64))

    def restore(self, slot_map: Mapping[str, Any]) -> None:
        """Take the controller's full map (resync or rebuild); L3 records are kept."""
        for pool in self.pools.values():
            pool[:] = -1
        self.where.clear()
        names = list(slot_map["session_names"])
        for bid, t, s, si, lg in zip(*(np.asarray(slot_map[k]).tolist() for k in (
                "block_ids", "tiers", "slots", "session_idx", "logical_idx"))):
            self._put(int(bid), int(t), int(s), names[si], int(lg))
        self.tokens = {str(k): int(v) for k, v in slot_map["session_tokens"].items()}
        self.epoch = int(slot_map["epoch"])
        self.content.clear()  # nothing in the pools is vouched for after a restore
        for bid, (tier, slot, _, _) in self.where.items():
            if tier == Tier.HBM:
                self.content[(tier, slot)] = (bid, self.version.get(bid, 0))

    def _written(self, result: StepResult) -> None:
        """Bump the version of every block the step writes: new blocks, the last block of a
        session that gets tokens when it was partly filled, and every block in L1 from the
        start of a recomputed range on (the engine feeds the session again from there). A
        block recomputed (fresh, of a logical index the session held) keeps its version: it
        gets the KV of the tokens it had, which its L3 record, if kept, holds
        (demand.keep_records)."""
        bt = self.block_tokens
        assert bt is not None
        bump = []
        held = {n: -(-self.tokens.get(n, 0) // bt) for n in result.session_ids}
        redone = set()
        for bid, pos, lg in zip(result.fresh_block_ids.tolist(),
                                result.fresh_session_idx.tolist(), result.fresh_logical.tolist()):
            if lg >= held[result.session_ids[pos]]:
                bump.append(bid)  # a new block
            else:
                redone.add(bid)
                slot = self.where[bid][1]
                self.content[(int(Tier.HBM), slot)] = (bid, self.version.get(bid, 0))
        for name, after in zip(result.session_ids, result.num_tokens.tolist()):
            before = self.tokens.get(name, 0)
            if after > before and before % bt:
                bump.append(self.named[(name, before // bt)])
        for pos, start in zip(result.recompute_session_idx.tolist(),
                              result.recompute_start.tolist()):
            name = result.session_ids[pos]
            bump += [b for (n, lg), b in self.named.items()
                     if n == name and lg >= start and lg < held[name] and b not in redone]
        for bid in bump:
            self.version[bid] = self.version.get(bid, 0) + 1
            tier, slot, _, _ = self.where[bid]
            if tier == Tier.HBM:
                self.content[(tier, slot)] = (bid, self.version[bid])

    def _put(self, bid: int, tier: int, slot: int, name: str, logical: int) -> None:
        self.named[(name, logical)] = bid
        if tier in self.pools:
            if self.pools[tier][slot] >= 0:
                raise ContractError(f"block {bid}: slot {slot} of tier {tier} is taken by "
                                    f"block {self.pools[tier][slot]}")
            self.pools[tier][slot] = bid
        elif tier == Tier.SSD:  # (restored: its record as the map has it, if none is known)
            self.records.setdefault(name, {}).setdefault(logical,
                                                         (bid, self.version.get(bid, 0)))
            slot = -1
        self.where[bid] = (tier, slot, name, logical)

    def _vacate(self, bid: int) -> None:
        tier, slot, _, _ = self.where[bid]
        if tier in self.pools:
            self.pools[tier][slot] = -1

    def _forget(self, bid: int) -> None:
        if bid in self.where:
            self._vacate(bid)
            _, _, name, logical = self.where.pop(bid)
            if self.named.get((name, logical)) == bid:
                del self.named[(name, logical)]

    def _drop(self, block_ids: np.ndarray) -> None:
        for bid in block_ids.tolist():
            if bid not in self.where:
                raise ContractError(f"drop of unknown block {bid}")
            self._vacate(bid)
            _, _, name, logical = self.where[bid]
            self.where[bid] = (int(Tier.NONE), -1, name, logical)
