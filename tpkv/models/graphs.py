"""CUDA graphs of the engine's decode forward: one launch instead of ~1000 small kernels.

A decode step of a 1B model is a thousand kernels of a few microseconds each; launched one by
one from Python the step is bound by the host (33 ms of CPU for 17 ms of GPU work, measured in
bench/step_profile.py). A graph replays all of them from one call. Graphs have fixed shapes, so
there is one per (batch size, block-table width rounded up to `bucket_blocks`); the extra
columns of a wider table point at slot 0 and are masked like any position past a session's
length. Every graph shares one memory pool (only one replays at a time) and the least recently
used is dropped past `max_graphs`.

Inputs live in one int64 device buffer per graph, filled by one host-to-device copy from pinned
memory before each replay: token ids, positions, sequence lengths, write slots and offsets, and
the block table. A graph is captured the first time its shape is seen, after one eager run of the
same step on a side stream (which also writes the step's K/V: the replay writes the same values).
Graphs and eager decoding run the same kernels, so a tiered run and an all-L1 run still give
identical tokens when both use graphs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tpkv.models.llama import Llama
from tpkv.models.paged import AttentionImpl, PagedAttention, PagedMeta

_FIELDS = 5  # token id, position, sequence length, write slot, write offset (per session)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    staging: Tensor  # pinned int64 [B * (_FIELDS + NB)]
    inputs: Tensor  # device int64, the same size: the graph reads only this
    logits: Tensor  # [B, vocab] float32, written by the graph
    mass: Tensor | None  # [B, NB] float32, written by the graph


class DecodeGraphs:
    """Decode forwards of `model` over the L1 tensor `pool` through CUDA graphs."""

    def __init__(self, model: Llama, pool: Tensor, attention: AttentionImpl,
                 bucket_blocks: int = 64, max_graphs: int = 48) -> None:
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the L1 pool on a GPU, it is on {pool.device}")
        self.model, self.pool, self.attention = model, pool, attention
        self.block_tokens = int(pool.shape[3])
        self.bucket_blocks, self.max_graphs = bucket_blocks, max_graphs
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def forward(self, token_ids: Sequence[int], tables: Sequence[np.ndarray],
                seq_lens: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Logits [B, vocab] (a copy) and block mass [B, NB] of one decode step: session b feeds
        token_ids[b] at position seq_lens[b] - 1; tables[b] lists its L1 slots (checked by the
        caller, `check_tables`)."""
        b = len(token_ids)
        seq = np.asarray(seq_lens, dtype=np.int64)
        nb_used = -(-seq // self.block_tokens)
        width = int(-(-int(nb_used.max()) // self.bucket_blocks) * self.bucket_blocks)
        host = np.zeros(b * (_FIELDS + width), dtype=np.int64)
        fields = host[:b * _FIELDS].reshape(_FIELDS, b)
        table = host[b * _FIELDS:].reshape(b, width)
        for i, t in enumerate(tables):
            table[i, :nb_used[i]] = np.asarray(t, dtype=np.int64)[:nb_used[i]]
        pos = seq - 1
        fields[0] = np.asarray(token_ids, dtype=np.int64)
        fields[1], fields[2] = pos, seq
        fields[3] = table[np.arange(b), pos // self.block_tokens]
        fields[4] = pos % self.block_tokens
        key = (b, width)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(b, width, host)
        else:
            self.graphs.move_to_end(key)
            entry.staging.numpy()[:] = host
            entry.inputs.copy_(entry.staging, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        mass = None if entry.mass is None else entry.mass[:, :int(nb_used.max())]
        return entry.logits.clone(), mass

    def _run(self, inputs: Tensor, b: int, width: int) -> tuple[Tensor, Tensor | None]:
        """The decode forward, reading its inputs from the device buffer `inputs`."""
        fields = inputs[:b * _FIELDS].view(_FIELDS, b)
        table = inputs[b * _FIELDS:].view(b, width)
        ones = torch.ones(b, dtype=torch.int64, device=inputs.device)
        rows = torch.arange(b, dtype=torch.int64, device=inputs.device)
        meta = PagedMeta(self.block_tokens, table, (fields[2] + self.block_tokens - 1)
                         // self.block_tokens, fields[2], ones,
                         torch.arange(b + 1, dtype=torch.int64, device=inputs.device),
                         fields[1], rows, torch.zeros_like(rows), fields[3], fields[4], 1)
        attn = PagedAttention(self.pool, meta, self.attention)
        logits = self.model(fields[0], fields[1], attn, rows)
        return logits, attn.block_mass

    def _capture(self, b: int, width: int, host: np.ndarray) -> _Graph:
        staging = torch.from_numpy(host).pin_memory()
        inputs = staging.to(self.pool.device, non_blocking=True)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):  # warm-up: lazy inits (cuBLAS handles) happen outside
            self._run(inputs, b, width)
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's copy threads keep issuing CUDA calls during a capture.
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits, mass = self._run(inputs, b, width)
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        entry = _Graph(graph, staging, inputs, logits, mass)
        self.graphs[(b, width)] = entry
        self.captures += 1
        return entry
