"""CUDA graphs of the engine's decode forward and of a turn's prefill after a cached prefix: one
launch instead of ~1000 small kernels.

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
same step on a side stream (which also writes the step's K/V: the replay writes the same values),
or ahead of serving by `capture_ahead`: every shape up to a session length, so that no step
pays for a capture (64-852 ms each on the H200, measured in bench/e2e.py's rounds).
Graphs and eager decoding run the same kernels, so a tiered run and an all-L1 run still give
identical tokens when both use graphs.

A turn's prefill (one session, new tokens after cached ones: a returning user's message) has one
graph per (query bucket, key width bucket) (`paged.query_bucket`, `paged.bucket_width`): its rows
are padded with copies of the last new token (same id and position; their K/V stores write that
token's own bytes again, `PagedMeta.write_src`), its table with slot 0. Only for attention
implementations that take the padded form (`paged_attention_sdpa`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tpkv.models.llama import Llama
from tpkv.models.paged import (
    AttentionImpl,
    PagedAttention,
    PagedMeta,
    bucket_width,
    paged_attention_sdpa,
    query_bucket,
)

_FIELDS = 5  # token id, position, sequence length, write slot, write offset (per session)
_PREFILL_FIELDS = 5  # token id, position, write slot, write offset, write source (per row)


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
                 bucket_blocks: int = 64, max_graphs: int = 48,
                 max_prefill_tokens: int = 512) -> None:
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the L1 pool on a GPU, it is on {pool.device}")
        self.model, self.pool, self.attention = model, pool, attention
        self.block_tokens = int(pool.shape[3])
        self.bucket_blocks, self.max_graphs = bucket_blocks, max_graphs
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self.kept: set[tuple[int, int, int]] = set()  # captured ahead: never dropped
        self.captures = 0
        self.replays = 0
        # A timing event (engine.time_device) the next replay records as its inputs go, after
        # the host has built them: its device time leaves that host work out.
        self.begun: torch.cuda.Event | None = None
        # Turns of up to this many new tokens after a cached prefix replay a prefill graph.
        self.max_prefill_tokens = max_prefill_tokens if attention is paged_attention_sdpa else 0

    def takes_prefill(self, q_len: int, seq_len: int) -> bool:
        """Whether a one-session prefill of q_len new tokens (seq_len in all) has a graph."""
        return 1 < q_len < seq_len and q_len <= self.max_prefill_tokens

    def forward_prefill(self, token_ids: Sequence[int], table: np.ndarray, seq_len: int
                        ) -> Tensor:
        """Logits [1, vocab] (a copy) of one session's new tokens `token_ids` (the last
        len(token_ids) of its seq_len), its K/V written into its blocks `table` (checked by the
        caller)."""
        host, qb, width = prefill_inputs(token_ids, table, seq_len, self.block_tokens,
                                         self.bucket_blocks)
        entry = self._replay((-1, qb, width), host)
        return entry.logits.clone()

    def forward(self, token_ids: Sequence[int], tables: Sequence[np.ndarray],
                seq_lens: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Logits [B, vocab] (a copy) and block mass [B, NB] of one decode step: session b feeds
        token_ids[b] at position seq_lens[b] - 1; tables[b] lists its L1 slots (checked by the
        caller, `check_tables`)."""
        host, width, used = decode_inputs(token_ids, tables, seq_lens, self.block_tokens,
                                          self.bucket_blocks)
        entry = self._replay((len(token_ids), width, 0), host)
        mass = None if entry.mass is None else entry.mass[:, :used]
        return entry.logits.clone(), mass

    def _replay(self, key: tuple[int, int, int], host: np.ndarray) -> _Graph:
        """Replay the graph of `key` ((B, width, 0) decode, (-1, rows, width) prefill) on the
        inputs `host`, capturing it first if new."""
        if self.begun is not None:
            self.begun.record()
            self.begun = None
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, host)
        else:
            self.graphs.move_to_end(key)
            entry.staging.numpy()[:] = host
            entry.inputs.copy_(entry.staging, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry

    def ahead_keys(self, max_batch: int, max_tokens: int) -> list[tuple[int, int, int]]:
        """`graph_keys` of this engine's blocks, buckets and prefill limit."""
        return graph_keys(max_batch, max_tokens, self.block_tokens, self.bucket_blocks,
                          self.max_prefill_tokens)

    def capture_ahead(self, keys: Sequence[tuple[int, int, int]]) -> int:
        """Capture the graphs of `keys` (`ahead_keys`) not yet captured, and keep them (the
        least recently used of the others still go past `max_graphs`); returns how many it
        captured. Each capture's eager run writes K/V into slot 0, whose bytes are put back
        after: call it while no copy of the tiers writes into L1."""
        todo = [k for k in keys if k not in self.graphs]
        self.kept.update(keys)
        if not todo:
            return 0
        saved = self.pool[0].clone()
        for key in todo:
            if key[0] > 0:  # decode: one token at position 0 of a one-token session
                host, _, _ = decode_inputs([0] * key[0], [np.zeros(1, np.int64)] * key[0],
                                           [1] * key[0], self.block_tokens,
                                           self.bucket_blocks, width=key[1])
            else:  # a turn of `rows` tokens ending the table's last position, in slot 0
                qn, seq = key[1], key[2] * self.block_tokens
                host, _, _ = prefill_inputs([0] * qn, np.zeros(key[2], dtype=np.int64), seq,
                                            self.block_tokens, self.bucket_blocks)
            self._capture(key, host)
        stream = torch.cuda.current_stream(self.pool.device)
        stream.synchronize()
        self.pool[0].copy_(saved)
        stream.synchronize()
        return len(todo)

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

    def _run_prefill(self, inputs: Tensor, qb: int, width: int) -> tuple[Tensor, Tensor | None]:
        """The padded prefill forward of one session, reading its inputs from `inputs`."""
        meta, token_ids, last = prefill_meta(inputs, qb, width, self.block_tokens)
        attn = PagedAttention(self.pool, meta, self.attention)
        return self.model(token_ids, meta.positions, attn, last), None

    def _capture(self, key: tuple[int, int, int], host: np.ndarray) -> _Graph:
        if key[0] > 0:  # decode: (B, width, 0)
            run = functools.partial(self._run, b=key[0], width=key[1])
        else:  # prefill: (-1, rows, width)
            run = functools.partial(self._run_prefill, qb=key[1], width=key[2])
        staging = torch.from_numpy(host).pin_memory()
        inputs = staging.to(self.pool.device, non_blocking=True)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):  # warm-up: lazy inits (cuBLAS handles) happen outside
            run(inputs)
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's copy threads keep issuing CUDA calls during a capture.
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits, mass = run(inputs)
        dropped = [k for k in self.graphs if k not in self.kept]
        for old in dropped[:max(0, len(dropped) + 1 - self.max_graphs)]:
            del self.graphs[old]
        entry = _Graph(graph, staging, inputs, logits, mass)
        self.graphs[key] = entry
        self.captures += 1
        return entry


def graph_keys(max_batch: int, max_tokens: int, block_tokens: int, bucket_blocks: int,
               max_prefill_tokens: int) -> list[tuple[int, int, int]]:
    """The graph keys that batches of up to `max_batch` sessions of up to `max_tokens` tokens
    can meet: decode (B, width, 0) for every batch size and table width bucket, and with
    `max_prefill_tokens` (turns that replay a graph) prefill (-1, rows, width) for every row
    bucket of 2 to max_prefill_tokens tokens that fits the width."""
    top = bucket_width(-(-max_tokens // block_tokens), bucket_blocks)
    widths = range(bucket_blocks, top + 1, bucket_blocks)
    keys = [(b, w, 0) for b in range(1, max_batch + 1) for w in widths]
    if max_prefill_tokens > 1:
        rows = sorted({query_bucket(q) for q in range(2, max_prefill_tokens + 1)})
        keys += [(-1, qb, w) for qb in rows for w in widths if qb < w * block_tokens]
    return keys


def decode_inputs(token_ids: Sequence[int], tables: Sequence[np.ndarray],
                  seq_lens: Sequence[int], block_tokens: int, bucket_blocks: int,
                  width: int | None = None) -> tuple[np.ndarray, int, int]:
    """(int64 inputs, width bucket, blocks the longest session uses) of one decode step: per
    session (a row each of _FIELDS) its token id, position (seq_len - 1), seq_len, the L1 slot
    and offset its new K/V goes to; then the tables padded with slot 0 to the width (the
    bucket of the longest, or `width` where given)."""
    b = len(token_ids)
    seq = np.asarray(seq_lens, dtype=np.int64)
    nb_used = -(-seq // block_tokens)
    used = int(nb_used.max())
    if width is None:
        width = bucket_width(used, bucket_blocks)
    host = np.zeros(b * (_FIELDS + width), dtype=np.int64)
    fields = host[:b * _FIELDS].reshape(_FIELDS, b)
    table = host[b * _FIELDS:].reshape(b, width)
    for i, t in enumerate(tables):
        table[i, :nb_used[i]] = np.asarray(t, dtype=np.int64)[:nb_used[i]]
    pos = seq - 1
    fields[0] = np.asarray(token_ids, dtype=np.int64)
    fields[1], fields[2] = pos, seq
    fields[3] = table[np.arange(b), pos // block_tokens]
    fields[4] = pos % block_tokens
    return host, width, used


def prefill_inputs(token_ids: Sequence[int], table: np.ndarray, seq_len: int, block_tokens: int,
                   bucket_blocks: int) -> tuple[np.ndarray, int, int]:
    """(int64 inputs, rows bucket, width bucket) of one session's turn of `token_ids` (the last
    len(token_ids) of its seq_len tokens) over its blocks `table`, padded: per row its token id,
    position, write slot, write offset and write source (rows past the turn repeat its last
    token), then seq_len, the last real row, and the table padded with slot 0."""
    qn = len(token_ids)
    nb = -(-seq_len // block_tokens)
    qb, width = query_bucket(qn), bucket_width(nb, bucket_blocks)
    host = np.zeros(_PREFILL_FIELDS * qb + 2 + width, dtype=np.int64)
    rows = host[:_PREFILL_FIELDS * qb].reshape(_PREFILL_FIELDS, qb)
    tail = host[_PREFILL_FIELDS * qb:]
    tail[2:2 + nb] = np.asarray(table, dtype=np.int64)[:nb]
    src = np.minimum(np.arange(qb), qn - 1)
    pos = seq_len - qn + src
    rows[0] = np.asarray(token_ids, dtype=np.int64)[src]
    rows[1] = pos
    rows[2] = tail[2 + pos // block_tokens]
    rows[3] = pos % block_tokens
    rows[4] = src
    tail[0], tail[1] = seq_len, qn - 1
    return host, qb, width


def prefill_meta(inputs: Tensor, qb: int, width: int, block_tokens: int
                 ) -> tuple[PagedMeta, Tensor, Tensor]:
    """(PagedMeta, token ids [qb], last real row [1]) of `prefill_inputs` on the device: views
    of `inputs` and a few constants, so a graph that reads them sees each replay's values."""
    rows = inputs[:_PREFILL_FIELDS * qb].view(_PREFILL_FIELDS, qb)
    tail = inputs[_PREFILL_FIELDS * qb:]
    seq, last = tail[0:1], tail[1:2]
    zero = torch.zeros(1, dtype=torch.int64, device=inputs.device)
    meta = PagedMeta(block_tokens, tail[2:].view(1, width),
                     (seq + block_tokens - 1) // block_tokens, seq, last + 1,
                     torch.cat([zero, last + 1]), rows[1],
                     torch.zeros(qb, dtype=torch.int64, device=inputs.device),
                     torch.arange(qb, dtype=torch.int64, device=inputs.device), rows[2], rows[3],
                     qb, write_src=rows[4])
    return meta, rows[0], last
