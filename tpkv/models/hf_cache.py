"""TpkvCache: a transformers Cache whose K/V live in tpkv's tiers (one session per cache)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tpkv.errors import ConfigError, TpkvError
from tpkv.models.hf_room import StepRoom
from tpkv.models.hf_write import PassWrite
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import Tier
from tpkv.ssd.format import validate_session_id

if TYPE_CHECKING:
    from tpkv.launch.runtime import TpkvRuntime

# (src, dst) of each move direction, by the names used in the stats.
DIRECTIONS = {"l1_l2": (Tier.HBM, Tier.DRAM), "l2_l1": (Tier.DRAM, Tier.HBM),
              "l2_l3": (Tier.DRAM, Tier.SSD), "l3_l2": (Tier.SSD, Tier.DRAM)}
_TIER_NAME = {int(Tier.HBM): "l1", int(Tier.DRAM): "l2", int(Tier.SSD): "l3"}
# The cache of each runtime that holds its session's contiguous K/V (one session at a time).
_VIEW_HOLDER: weakref.WeakKeyDictionary[Any, weakref.ref[TpkvCache]] = (
    weakref.WeakKeyDictionary())


class KvLostError(TpkvError):
    """Some of a session's past K/V is gone (an L3 read failed its checks, or the controller
    chose to recompute): `generate` must feed the tokens from `first_lost_token` on again.
    The cache already reports that length; `HfTiers.generate` does the re-prefill."""

    def __init__(self, message: str, session_id: str, first_lost_token: int) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.first_lost_token = first_lost_token


@dataclass
class HfTierStats:
    """What the tiers did for the caches of one attachment (bytes are this rank's)."""

    steps: int = 0
    retries: int = 0  # steps scheduled again (an L3 miss hit the batch, or ranks disagreed)
    moves: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    resumes: list[tuple[str, str]] = field(default_factory=list)  # (session, farthest tier)
    lost_tokens: int = 0  # tokens whose K/V had to be fed again
    losses: list[tuple[str, int]] = field(default_factory=list)  # (session, first lost token)
    passes_without_step: int = 0  # forward passes that fit the room of their session's step


class _TierLayer(CacheLayerMixin):
    """One layer's view of a TpkvCache: lengths for the masks; update goes to the cache."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: TpkvCache, layer_idx: int) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.length = 0  # tokens of this layer once the current forward pass wrote it
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layer_update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        """Tokens before the forward pass in flight: what masks and positions are made from
        (a forward pass that failed half way leaves it as it was)."""
        return self.cache.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the tiers move the blocks; nothing to do per layer
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("TpkvCache cannot crop (assisted decoding is not "
                                      "supported)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TpkvCache holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("TpkvCache holds one sequence: num_return_sequences and "
                                      "beams > 1 are not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if torch.as_tensor(indices).reshape(-1).tolist() != [0]:
            raise NotImplementedError("TpkvCache holds one sequence (batch size 1)")


class TpkvCache(Cache):
    """The K/V of one session (batch size 1) in tpkv's blocks. The first `update` of a forward
    pass (layer 0) schedules one step of the session with the controller: its blocks are
    brought back into L1 from L2/L3 (waited for layer by layer) and new blocks get L1 slots.
    A step counts the session's tokens up to the end of the block its pass ends in (the rest
    lent to the session as a credit, rt.credits), so the passes after it that fit that block
    and find no other step applied since (the worker's tick and epoch as they were) need no
    step at all: their blocks are where that step left them (`room`, hf_room.StepRoom).
    Each `update` writes the new tokens' K/V of its layer into the L1 pool through the session's
    block table (a pass whose tokens fit one block: every layer's at once, at the last layer)
    and returns the layer's whole past: bit for bit the tensors DynamicCache returns (same
    values, shape and layout). Between forward passes (and turns) the controller may
    demote the blocks to L2 and spill them to L3.

    The past is gathered from the blocks once, at the first forward pass after a resume; later
    passes append the new tokens to that contiguous copy (`views`, one torch.cat per layer, as
    DynamicCache does), so a decode step reads no block. The copy is dropped when any of the
    session's blocks is loaded into L1, K/V is lost, a pass fails half way, the cache closes,
    or another session's cache of the runtime starts a pass: device memory holds at most one
    session's copy per runtime besides the L1 pool.

    A pass whose last token ends a block plans the next one ahead (`StepRoom.plan_next`):
    generate calls the model once per token, so the step of the next block of this session is
    sent to the controller while this pass runs, and the next pass's step takes it without a
    round trip; HfTiers.generate plans a turn's first pass so (`plan_turn`) and none past its
    last. A turn that stops early, another session's pass or any other runtime call leaves it
    unused (applied without a forward, its tokens a credit of the session: rt.credits keeps
    the counts right).

    If blocks were lost (an L3 read failed its checks, or the cost model chose recompute), the
    first update of a forward pass raises KvLostError and the cache's length drops to the first
    lost token: calling `generate` again with the whole conversation feeds the rest again
    (`HfTiers.generate` does so). Every TP rank makes the same calls in the same order.
    """

    def __init__(self, rt: TpkvRuntime, session_id: str, stats: HfTierStats | None = None,
                 max_retries: int = 2) -> None:
        validate_session_id(session_id)  # before anything holds it
        g = rt.config.geometry
        self.tier_layers = [_TierLayer(self, i) for i in range(g.num_layers)]
        super().__init__(layers=list(self.tier_layers))
        self.rt, self.session_id, self.geometry = rt, session_id, g
        self.stats = stats if stats is not None else HfTierStats()
        self.max_retries = max_retries
        self.pool = rt.worker.hbm.tensor  # [slots, layers, 2, block_tokens, heads, head_dim]
        self.num_tokens = 0  # tokens whose K/V the blocks hold (the cache's length)
        # tokens the controller counts for passes of this cache (>= num_tokens: more after a
        # loss); it counts more: the credit in rt.credits (room a step made, a step planned
        # ahead that no pass fed)
        self.ctl_tokens = 0
        self.in_forward = False
        self.opened = False
        self.resumed_from: list[str] = []  # farthest tier of each forward that loaded blocks
        self._slots: np.ndarray | None = None  # the session's L1 slots in this forward (host)
        self._slots_dev: torch.Tensor | None = None  # ... on the device, made when gathering
        self._table: np.ndarray | None = None  # the last step's slots (for passes without)
        self.room = StepRoom(rt, session_id, g.block_tokens)
        self._new = 0
        self._shape = torch.Size()  # K/V shape of the pass in flight (layer 0's)
        self._write: PassWrite | None = None  # where the pass in flight writes its K/V
        # per layer: K and V [1, heads, tokens, head_dim] equal to the blocks' (or None)
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * g.num_layers

    # ---- what transformers calls -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer_update(layer_idx, key_states, value_states)

    def reset(self) -> None:
        """Forget the session's K/V (its blocks are freed on every tier)."""
        self.close()

    def layer_update(self, layer: int, key_states: torch.Tensor,
                     value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V `[1, heads, new, head_dim]` of `layer` into its blocks; return
        the layer's K/V of every token so far, `[1, heads, tokens, head_dim]`, contiguous."""
        if layer == 0:
            self._check(key_states)
            self._begin_forward(key_states.shape[2])
            self._shape = key_states.shape
        elif (not self.in_forward or key_states.shape != self._shape
              or key_states.dtype != self.pool.dtype):
            self._check(key_states)
            raise TpkvError(f"layer {layer} updated with K/V of shape "
                            f"{tuple(key_states.shape)} outside a forward pass that layer 0 "
                            f"started ({self._new} tokens)")
        self.rt.worker.wait_layer(layer)  # blocks brought into L1 for this step
        lay = self.tier_layers[layer]
        start = lay.length
        assert self._write is not None
        self._write.put(layer, key_states, value_states)
        view, self.views[layer] = self.views[layer], None
        if view is None or view[0].shape[2] != start:  # from the blocks, once after a resume
            del view
            keys, values = self._gather(layer, start, (key_states, value_states))
        else:  # the old K freed before the new V is made, as DynamicCache does
            old_keys, old_values = view
            del view
            keys = torch.cat([old_keys, key_states], dim=-2)
            del old_keys
            values = torch.cat([old_values, value_states], dim=-2)
            del old_values
        self.views[layer] = keys, values
        lay.length = start + self._new
        if layer == len(self.tier_layers) - 1:
            self._write.end()
            self.num_tokens, self.in_forward, self._slots = lay.length, False, None
        return keys, values

    def _check(self, key_states: torch.Tensor) -> None:
        g = self.geometry
        if key_states.dim() != 4 or key_states.shape[0] != 1:
            raise TpkvError(f"TpkvCache holds one sequence: K/V of shape "
                            f"{tuple(key_states.shape)}, want [1, heads, tokens, head_dim]")
        _, heads, _, dim = key_states.shape
        if (heads, dim) != (g.heads_per_rank, g.head_dim) or key_states.dtype != self.pool.dtype:
            raise ConfigError(f"K/V of {heads} heads x {dim} dims ({key_states.dtype}) on this "
                              f"rank; the tiers hold {g.heads_per_rank} x {g.head_dim} "
                              f"({self.pool.dtype})")

    # ---- session ---------------------------------------------------------------------------
    def read_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V `[1, heads, tokens, head_dim]` of the session (one step with no
        new tokens brings its blocks into L1). For checks; a collective under TP."""
        self._begin_forward(0)
        assert self._slots is not None
        try:
            out = []
            for layer in range(self.geometry.num_layers):
                self.rt.worker.wait_layer(layer)
                out.append(self._gather(layer, self.num_tokens))
            return out
        finally:
            self.in_forward, self._slots = False, None

    def close(self) -> None:
        """Free the session's blocks on every tier; the cache starts empty if used again."""
        if self.opened:
            self.rt.close_session(self.session_id)
        self.opened, self.in_forward, self._slots = False, False, None
        self.num_tokens = self.ctl_tokens = 0
        self._table = None
        self.room.forget()
        self.drop_views()
        for lay in self.tier_layers:
            lay.length = 0

    # ---- internals -------------------------------------------------------------------------
    def _gather(self, layer: int, num_tokens: int,
                new: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[1, heads, num_tokens + n, head_dim]` of `layer`, contiguous (on the device
        of `new`): the first num_tokens from the blocks, then `new`'s K and V `[1, heads, n,
        head_dim]` (none without). The blocks are read into one buffer (index_select) and
        copied once into place: as DynamicCache's torch.cat, plus that one copy."""
        assert self._slots is not None
        g = self.geometry
        nb = -(-num_tokens // g.block_tokens)
        if self._slots_dev is None:  # once per pass, for every layer
            self._slots_dev = torch.as_tensor(self._slots.astype(np.int64),
                                              device=self.pool.device)
        slots = self._slots_dev[:nb]
        out = []
        for kv in (0, 1):
            blocks = torch.index_select(self.pool[:, layer, kv], 0, slots)  # [nb, bt, h, d]
            rows = blocks.view(nb * g.block_tokens, g.heads_per_rank, g.head_dim)[:num_tokens]
            extra = None if new is None else new[kv]
            n = 0 if extra is None else extra.shape[2]
            full = torch.empty(1, g.heads_per_rank, num_tokens + n, g.head_dim,
                               dtype=self.pool.dtype,
                               device=self.pool.device if extra is None else extra.device)
            full[0, :, :num_tokens] = rows.transpose(0, 1)
            if extra is not None:
                full[0, :, num_tokens:] = extra[0]
            out.append(full)
        return out[0], out[1]

    def drop_views(self) -> None:
        """Forget the contiguous copy of the past: the next pass gathers it from the blocks."""
        self.views = [None] * len(self.views)

    def _begin_forward(self, new: int) -> None:
        """Schedule the session's step for `new` tokens after `num_tokens`: every block in
        L1, slots for the new ones (none when the pass fits the last step's room and no step
        was applied since). Raises KvLostError if K/V before `num_tokens` is gone."""
        if self.in_forward:  # the last pass failed half way: its layers' copies run ahead
            self.drop_views()
        holder = _VIEW_HOLDER.get(self.rt)
        other = holder() if holder is not None else None
        if other is not self:
            if other is not None:
                other.drop_views()
            _VIEW_HOLDER[self.rt] = weakref.ref(self)
        g, base = self.geometry, self.num_tokens
        bt = g.block_tokens
        # tokens this pass feeds that no step of this cache asked for yet
        need = max(0, base + new - self.ctl_tokens)
        if self.room.fits(base, new):
            self.stats.passes_without_step += 1
            self.room.credit(-need)  # counted by the last step, lent until now
        else:
            add = self.room.ask(base, new, self.ctl_tokens)
            step, first_lost = self._schedule(add)
            if first_lost is not None and first_lost < base:
                self.ctl_tokens += add
                self.room.forget()
                self._table = None
                self.drop_views()
                self.num_tokens = first_lost
                self.stats.lost_tokens += base - first_lost
                self.stats.losses.append((self.session_id, first_lost))
                self.in_forward, self._slots = False, None
                raise KvLostError(f"session {self.session_id!r}: K/V of tokens {first_lost}.."
                                  f"{base} is lost (L3 miss or recompute); feed them again",
                                  self.session_id, first_lost)
            self.room.took(self.ctl_tokens + add)
            self.room.credit(add - need)
            self._table, self._slots_dev = step.session_slots(0), None  # (the step's array)
        self.ctl_tokens += need
        self._slots = self._table
        assert self._slots is not None
        self._write = PassWrite(self.pool, self._slots, base, new, bt)
        self._new, self.in_forward = new, True
        for lay in self.tier_layers:
            lay.length = base
        if new:
            self.room.plan_next(base + new, self.ctl_tokens)

    def plan_turn(self, num_ids: int, max_new_tokens: int | None) -> None:
        """Before generate runs a turn of `num_ids` tokens in all (the cache holds the first
        num_tokens) that makes at most `max_new_tokens` (HfTiers.generate): the step of its
        first pass is sent now, while generate prepares (not a session's first: it is not
        open at the controller yet), and no pass after it plans one past the turn's last pass
        (`room.turn_end`, until the caller resets it to None)."""
        room, base = self.room, self.num_tokens
        room.turn_end = None if max_new_tokens is None else num_ids + max_new_tokens - 1
        if self.opened and num_ids > base and not room.fits(base, num_ids - base):
            self.rt.schedule_ahead([self.session_id],
                                   [room.ask(base, num_ids - base, self.ctl_tokens)])

    def _schedule(self, add: int) -> tuple[StepResult, int | None]:
        """begin_step and end_step at once (before any K/V is read), again after an L3 miss
        that hit the session or a rank mismatch; the first token of any lost block."""
        if not self.opened:
            self.rt.open_session(self.session_id)
            self.opened = True
        first_lost: int | None = None
        farthest = int(Tier.HBM)

        def attempt(step: StepResult) -> StepResult:  # before the forward: nothing read yet
            nonlocal first_lost, farthest
            farthest = max(farthest, self._count(step))
            if len(step.recompute_start):
                lost = int(step.recompute_start.min()) * self.geometry.block_tokens
                first_lost = lost if first_lost is None else min(first_lost, lost)
            return step

        retries = self.rt.num_retries
        step = self.rt.run_step([self.session_id], [add], attempt, max_retries=self.max_retries)
        self.stats.retries += self.rt.num_retries - retries
        self.stats.steps += 1
        if farthest != Tier.HBM:  # blocks loaded into L1: the past is gathered from them again
            self.drop_views()
            self.resumed_from.append(_TIER_NAME[farthest])
            self.stats.resumes.append((self.session_id, _TIER_NAME[farthest]))
        return step, first_lost

    def _count(self, step: StepResult) -> int:
        """Add the step's moves to the stats; the farthest tier this session loads from."""
        farthest = int(Tier.HBM)
        for plan in step.plans:
            for name, (src, dst) in DIRECTIONS.items():
                self.stats.moves[name] += int(plan.mask(src, dst).sum())
            if plan.num_moves and plan.session_names:
                names = np.asarray(plan.session_names, dtype=object)[plan.session_idx]
                mine = (names == self.session_id) & (plan.src_tier > plan.dst_tier)
                if mine.any():
                    farthest = max(farthest, int(plan.src_tier[mine].max()))
        return farthest
