"""The paged engine's default scheduler: L1 slots from a SlotAllocator, one tier, no moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tpkv.errors import BadRequestError, TierFullError, UnknownSessionError
from tpkv.workers.slots import SlotAllocator


class StepTables(Protocol):
    """What a scheduler returns for one step: the L1 slot of every block of batch session i, in
    logical order. tpkv.controller's StepResult has this shape, so it plugs in as is."""

    def session_slots(self, i: int) -> np.ndarray: ...


@dataclass(frozen=True)
class LocalTables:
    """Block tables of one step, laid out like the controller's StepResult (CSR)."""

    session_ids: tuple[str, ...]
    num_tokens: np.ndarray  # [B] tokens of each session after the step
    block_offsets: np.ndarray  # [B + 1] into block_table
    block_table: np.ndarray  # L1 slots of every block of the batch, session by session

    def session_slots(self, i: int) -> np.ndarray:
        return self.block_table[self.block_offsets[i]:self.block_offsets[i + 1]]


class LocalScheduler:
    """Gives each session's new blocks L1 slots and frees them when it closes; nothing leaves L1.

    With `seed`, slots are drawn at random from the free ones (blocks scatter over the pool, as
    they do under the controller); without, lowest free slots first. TierFullError when L1 is out
    of slots: evicting to L2/L3 is the controller's job.
    """

    def __init__(self, num_slots: int, block_tokens: int, seed: int | None = None) -> None:
        self.slots = SlotAllocator(num_slots, "L1")
        self.block_tokens = block_tokens
        self._rng = None if seed is None else np.random.default_rng(seed)
        self._tables: dict[str, np.ndarray] = {}
        self._tokens: dict[str, int] = {}

    def schedule(self, session_ids: Sequence[str], num_new_tokens: Sequence[int]) -> LocalTables:
        """Sessions `session_ids` add num_new_tokens[i] tokens each; unknown ids are opened."""
        if len(session_ids) != len(num_new_tokens) or len(set(session_ids)) != len(session_ids):
            raise BadRequestError(f"a step needs distinct sessions, one count each; got "
                                  f"{len(session_ids)} ids, {len(num_new_tokens)} counts")
        totals = [self._tokens.get(s, 0) + int(n) for s, n in zip(session_ids, num_new_tokens)]
        need = [-(-t // self.block_tokens) - len(self._tables.get(s, ()))
                for s, t in zip(session_ids, totals)]
        if sum(need) > self.slots.num_free:
            raise TierFullError(f"L1 needs {sum(need)} slots for a step of {len(session_ids)} "
                                f"sessions, {self.slots.num_free} free of {self.slots.num_slots}")
        for s, t, n in zip(session_ids, totals, need):
            old = self._tables.get(s, np.zeros(0, dtype=np.int64))
            self._tables[s] = np.concatenate((old, self._alloc(n)))
            self._tokens[s] = t
        tables = [self._tables[s] for s in session_ids]
        offsets = np.concatenate(([0], np.cumsum([len(t) for t in tables]))).astype(np.int64)
        return LocalTables(tuple(session_ids), np.asarray(totals, dtype=np.int64), offsets,
                           np.concatenate(tables).astype(np.int64))

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._tables

    def close(self, session_id: str) -> int:
        """Free a session's slots; returns how many."""
        table = self._table(session_id)
        self.slots.free(table)
        del self._tables[session_id], self._tokens[session_id]
        return len(table)

    def session_slots(self, session_id: str) -> np.ndarray:
        return self._table(session_id).copy()

    def relocate(self, session_id: str, pool: torch.Tensor) -> np.ndarray:
        """Move a session's blocks to other free L1 slots (copy, then swap the table); as the
        controller does when it compacts or after a round trip through L2. Returns new slots."""
        old = self._table(session_id)
        new = self._alloc(len(old))
        src = torch.from_numpy(old).to(pool.device)
        pool[torch.from_numpy(new).to(pool.device)] = pool[src]
        self.slots.free(old)
        self._tables[session_id] = new
        return new.copy()

    def _table(self, session_id: str) -> np.ndarray:
        if session_id not in self._tables:
            raise UnknownSessionError(f"session {session_id!r} holds no L1 slots")
        return self._tables[session_id]

    def _alloc(self, n: int) -> np.ndarray:
        if self._rng is None or n == 0:
            return self.slots.alloc(n)
        free = np.flatnonzero(~self.slots.is_used(np.arange(self.slots.num_slots)))
        if n > len(free):
            raise TierFullError(f"L1 needs {n} slots, {len(free)} free of {self.slots.num_slots}")
        picked = self._rng.choice(free, size=n, replace=False).astype(np.int64)
        self.slots.take(picked)
        return picked
