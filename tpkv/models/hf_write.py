"""PassWrite: where one forward pass of TpkvCache puts its new tokens' K/V in the L1 pool."""

from __future__ import annotations

import numpy as np
import torch


class PassWrite:
    """The new tokens' K/V of one pass, layer by layer, into the session's blocks. Tokens that
    fit one block (a decode pass): each layer's K and V are held as given and written at the
    pass's end, every layer's at once (one stack, one copy into a view of the block's rows;
    a layer that comes out of order goes in at once). Otherwise each layer's go in as it
    comes, through index tensors of every token's slot and offset (made once a pass)."""

    def __init__(self, pool: torch.Tensor, slots: np.ndarray, base: int, new: int,
                 block_tokens: int) -> None:
        """pool: the L1 pool [slots, layers, 2, block_tokens, heads, head_dim]; slots: the
        session's L1 slot of each block; the pass writes tokens base .. base + new."""
        self.pool, self.num_layers = pool, pool.shape[1]
        self.held: list[torch.Tensor] = []  # K, V of layers 0, 1, ... so far
        self.rows: torch.Tensor | None = None  # [layers, 2, new, heads, head_dim] of a block
        self.at: tuple[torch.Tensor, torch.Tensor] | None = None
        bt = block_tokens
        if new and base // bt == (base + new - 1) // bt:
            first = base % bt
            self.rows = pool[int(slots[base // bt]), :, :, first:first + new]
        elif new:
            pos = np.arange(base, base + new)
            self.at = (torch.as_tensor(slots[pos // bt].astype(np.int64), device=pool.device),
                       torch.as_tensor(pos % bt, device=pool.device))

    def put(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer `layer`'s new K and V [1, heads, new, head_dim]."""
        if self.rows is None:
            assert self.at is not None
            slots, offsets = self.at
            for kv, states in ((0, keys), (1, values)):
                rows = states[0].transpose(0, 1).to(self.pool.device)  # [new, heads, head_dim]
                self.pool[slots, layer, kv, offsets] = rows
        elif len(self.held) == 2 * layer:
            self.held += (keys, values)
        else:
            self._put_rows(layer, keys, values)

    def end(self) -> None:
        """The pass's last layer is in: write what is held."""
        held, self.held = self.held, []
        if self.rows is None or not held:
            return
        if len(held) == 2 * self.num_layers:
            kv = torch.stack(held)  # [layers * 2, 1, heads, new, head_dim]
            self.rows.copy_(kv.view(self.num_layers, 2, *kv.shape[2:]).transpose(2, 3))
            return
        for layer in range(len(held) // 2):
            self._put_rows(layer, held[2 * layer], held[2 * layer + 1])

    def _put_rows(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert self.rows is not None
        rows = self.rows[layer]  # [2, new, heads, head_dim]
        rows[0].copy_(keys[0].transpose(0, 1))
        rows[1].copy_(values[0].transpose(0, 1))
