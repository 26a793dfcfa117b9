"""Paged attention over L1 through per-session block tables: step metadata, KV writes, reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from tpkv.errors import BadRequestError, SlotError


@dataclass(frozen=True)
class PagedMeta:
    """Where one forward's new tokens go and what each attends to; built once, used by all layers.

    A batch holds B sessions; session b adds q_lens[b] new tokens at the end of its sequence, so
    they sit at positions seq_lens[b] - q_lens[b] .. seq_lens[b] - 1. Decode is q_lens == 1;
    prefill is one session with many; mixed batches work too. New tokens are flat, session by
    session: T = sum(q_lens).
    """

    block_tokens: int
    block_table: Tensor  # [B, NB] int64 L1 slots in logical order, padded with slot 0
    num_blocks: Tensor  # [B] int64 blocks in use (ceil(seq_len / block_tokens))
    seq_lens: Tensor  # [B] int64 tokens after this forward
    q_lens: Tensor  # [B] int64 new tokens of this forward
    query_start: Tensor  # [B + 1] int64 offsets of each session's new tokens into T
    positions: Tensor  # [T] int64 absolute position of each new token
    token_session: Tensor  # [T] int64 session (row of the batch) of each new token
    token_index: Tensor  # [T] int64 index of each new token among its session's new ones
    write_slots: Tensor  # [T] int64 L1 slot each new token's K/V goes to
    write_offsets: Tensor  # [T] int64 offset inside that block
    max_q_len: int
    # (query_start, num_blocks, seq_lens, q_lens) as host lists, when built on the host: spares
    # a prefill three device-to-host syncs per layer
    host_lens: tuple[list[int], list[int], list[int], list[int]] | None = None
    # Padded form (the prefill graphs): one session whose rows are padded to a bucket by copies
    # of its last new token, and whose table is padded to a bucket; write_src[i] is the row
    # whose K/V row i writes (the last real row for padding), so a padding row writes the very
    # bytes of that row to the same place (a duplicate store of identical values).
    write_src: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def last_rows(self) -> Tensor:
        """[B] row of T holding each session's last new token (the one that is sampled)."""
        return self.query_start[1:] - 1


def check_tables(block_tables: Sequence[np.ndarray | Sequence[int]], seq_lens: Sequence[int],
                 q_lens: Sequence[int], block_tokens: int, num_slots: int
                 ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Check a step's block tables and lengths: (tables, seq_lens, q_lens, blocks per session)
    as int64 numpy arrays, or a typed error naming the session."""
    tables = [np.asarray(t, dtype=np.int64).reshape(-1) for t in block_tables]
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    qn = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    b = len(tables)
    if b == 0 or len(seq) != b or len(qn) != b:
        raise BadRequestError(f"a paged step needs B >= 1 block tables, seq_lens and q_lens of "
                              f"one length; got {b}, {len(seq)}, {len(qn)}")
    if (qn < 1).any() or (qn > seq).any():
        i = int(np.flatnonzero((qn < 1) | (qn > seq))[0])
        raise BadRequestError(f"session {i} of the batch adds {qn[i]} tokens to a sequence of "
                              f"{seq[i]}; need 1 <= new tokens <= sequence length")
    nb = -(-seq // block_tokens)
    for i, t in enumerate(tables):
        if len(t) < nb[i]:
            raise BadRequestError(f"session {i} of the batch has {seq[i]} tokens in {nb[i]} "
                                  f"blocks of {block_tokens}, but its block table lists {len(t)}")
        used = t[:nb[i]]
        if len(used) and (used.min() < 0 or used.max() >= num_slots):
            raise SlotError(f"session {i} of the batch names L1 slots outside 0..{num_slots - 1}"
                            f": {used[(used < 0) | (used >= num_slots)][:8].tolist()}")
    every = np.concatenate([t[:n] for t, n in zip(tables, nb)])
    # tpkv shares no blocks between sessions. A count per slot (all are in range by now):
    # np.unique took 0.3-0.9 ms a decode step of 6000 blocks, before the forward; this 20 us.
    counts = np.bincount(every, minlength=num_slots)
    if len(every) and counts.max() > 1:
        raise SlotError(f"the batch lists L1 slots more than once: "
                        f"{np.flatnonzero(counts > 1)[:8].tolist()}")
    return tables, seq, qn, nb


def build_meta(block_tables: Sequence[np.ndarray | Sequence[int]], seq_lens: Sequence[int],
               q_lens: Sequence[int], block_tokens: int, num_slots: int,
               device: torch.device | str = "cpu") -> PagedMeta:
    """Check the step's block tables and lengths, and lay them out as tensors on `device`."""
    tables, seq, qn, nb = check_tables(block_tables, seq_lens, q_lens, block_tokens, num_slots)
    b = len(tables)
    table = np.zeros((b, int(nb.max())), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :nb[i]] = t[:nb[i]]
    start = np.concatenate(([0], np.cumsum(qn)))
    tok_session = np.repeat(np.arange(b), qn)
    tok_index = np.arange(int(start[-1])) - start[tok_session]
    pos = (seq - qn)[tok_session] + tok_index
    slots = table[tok_session, pos // block_tokens]

    parts = [table.reshape(-1), nb, seq, qn, start, pos, tok_session, tok_index, slots,
             pos % block_tokens]
    flat = torch.from_numpy(np.concatenate(parts)).to(device)  # one copy to the device, not ten
    v = torch.split(flat, [len(x) for x in parts])
    return PagedMeta(block_tokens, v[0].view(table.shape), v[1], v[2], v[3], v[4], v[5], v[6],
                     v[7], v[8], v[9], int(qn.max()),
                     (start.tolist(), nb.tolist(), seq.tolist(), qn.tolist()))


def write_kv(pool: Tensor, layer: int, k: Tensor, v: Tensor, meta: PagedMeta) -> None:
    """Store the new tokens' K and V (each [T, Hkv, D]) at their (slot, offset) of `layer`."""
    kv = pool[:, layer]  # [slots, 2, bt, Hkv, D]
    index = (meta.write_slots, meta.write_offsets)
    if meta.write_src is not None:
        k, v = k[meta.write_src], v[meta.write_src]
    kv[:, 0].index_put_(index, k.to(pool.dtype))
    kv[:, 1].index_put_(index, v.to(pool.dtype))


# An attention implementation reads one layer of the pool (after write_kv) for queries q
# [T, Hq, D] and returns the output [T, Hq, D] and, if it can, the block mass [B, NB] (float32).
AttentionImpl = Callable[[Tensor, int, Tensor, PagedMeta, float], tuple[Tensor, Tensor | None]]


def paged_attention_ref(pool: Tensor, layer: int, q: Tensor, meta: PagedMeta, scale: float,
                        max_score_bytes: int = 256 << 20) -> tuple[Tensor, Tensor]:
    """Exact reference: gather each session's blocks, masked softmax in float32.

    Queries are padded to [B, Qmax] and processed in chunks of Qmax so that the scores stay below
    `max_score_bytes`. Block mass [B, NB]: the softmax weight that falls in each block, summed over
    heads and query tokens (each query row and head contributes exactly 1).
    """
    b, nb = meta.block_table.shape
    bt = meta.block_tokens
    kv = pool[:, layer]  # [slots, 2, bt, Hkv, D]
    keys = kv[:, 0][meta.block_table].flatten(1, 2).float()  # [B, L, Hkv, D]
    vals = kv[:, 1][meta.block_table].flatten(1, 2).float()  # [B, L, Hkv, D]
    t, hq, d = q.shape
    hkv = keys.shape[2]
    g = hq // hkv
    length = nb * bt
    qmax = meta.max_q_len
    q_pad = q.new_zeros((b, qmax, hq, d), dtype=torch.float32)
    q_pad[meta.token_session, meta.token_index] = q.float()
    q_pad = q_pad.view(b, qmax, hkv, g, d)  # [B, Q, Hkv, G, D]; query head = kv head * G + g
    rows = torch.arange(qmax, device=q.device)
    q_valid = rows[None, :] < meta.q_lens[:, None]  # [B, Q]
    q_pos = torch.where(q_valid, (meta.seq_lens - meta.q_lens)[:, None] + rows[None, :], 0)
    k_pos = torch.arange(length, device=q.device)  # [L]
    in_range = k_pos[None, :] < meta.seq_lens[:, None]  # [B, L]
    vals = vals.masked_fill(~in_range[:, :, None, None], 0.0)  # 0 * NaN garbage would be NaN
    out_pad = torch.empty((b, qmax, hkv, g, d), dtype=torch.float32, device=q.device)
    mass = torch.zeros((b, length), dtype=torch.float32, device=q.device)
    chunk = max(1, max_score_bytes // max(1, 3 * b * hq * length * 4))
    for q0 in range(0, qmax, chunk):
        q1 = min(qmax, q0 + chunk)
        scores = torch.einsum("bqhgd,blhd->bhgql", q_pad[:, q0:q1], keys) * scale
        allowed = k_pos[None, None, :] <= q_pos[:, q0:q1, None]  # [B, Qc, L] causal and in range
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G, Qc, L]
        out_pad[:, q0:q1] = torch.einsum("bhgql,blhd->bqhgd", probs, vals)
        weight = q_valid[:, None, None, q0:q1, None].to(probs.dtype)  # padding rows count 0
        mass += (probs * weight).sum(dim=(1, 2, 3))
    out = out_pad.view(b, qmax, hq, d)[meta.token_session, meta.token_index]  # [T, Hq, D]
    return out.to(q.dtype), mass.view(b, nb, bt).sum(-1)


class PagedAttention:
    """The model's `AttentionFn` for one paged forward: write new K/V to L1, then attend.

    `impl` is the seam for a fused kernel (FlashInfer-style paged decode on GPU); the default is
    the exact reference. Block mass, when the implementation gives it, accumulates over layers
    into `block_mass` [B, NB].
    """

    def __init__(self, pool: Tensor, meta: PagedMeta,
                 impl: AttentionImpl = paged_attention_ref) -> None:
        self.pool = pool
        self.meta = meta
        self.impl = impl
        self.block_mass: Tensor | None = None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        write_kv(self.pool, layer, k, v, self.meta)
        out, mass = self.impl(self.pool, layer, q, self.meta, q.shape[-1] ** -0.5)
        if mass is not None:
            self.block_mass = mass if self.block_mass is None else self.block_mass + mass
        return out


def _bmm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with float32 results; on CUDA straight from bf16/fp16 operands (tensor cores with
    float32 accumulation and output), elsewhere by converting the operands first."""
    if a.dtype != torch.float32 and a.is_cuda and _CUDA_BMM_OUT_DTYPE[0]:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without bmm(out_dtype=): convert from now on
            _CUDA_BMM_OUT_DTYPE[0] = False
    return torch.bmm(a.float(), b.float())


_CUDA_BMM_OUT_DTYPE = [True]
_EYES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def paged_decode_attention(pool: Tensor, layer: int, q: Tensor, meta: PagedMeta, scale: float
                           ) -> tuple[Tensor, Tensor]:
    """Decode (one new token per session), with the block mass, in about a dozen kernels.

    Each session's K and V are gathered into [B, L, Hkv*D] (the pool's own dtype) and used as
    they are by batched GEMMs, with no per-head transpose: the queries of KV head h are placed in
    a block-diagonal [Hq, Hkv*D] matrix, so S = Q_bd @ K^T gives every head's scores at once
    (zeros against the other heads' columns), and P @ V gives [Hq, Hkv*D] whose diagonal blocks
    are the outputs. The extra products are free: a decode step reads K and V once either way.
    Scores, softmax and mass are float32; P is cast to the KV dtype for P @ V (as fused kernels
    do). Positions past a session's length (stale data, padding, NaN) are masked in S and zeroed
    in the gathered V.
    """
    b, nb = meta.block_table.shape
    bt = meta.block_tokens
    t, hq, d = q.shape
    hkv = pool.shape[4]
    g, length = hq // hkv, nb * bt
    k = pool[:, layer, 0][meta.block_table].view(b, length, hkv * d)  # [B, L, Hkv*D]
    v = pool[:, layer, 1][meta.block_table].view(b, length, hkv * d)
    in_range = torch.arange(length, device=q.device)[None, :] < meta.seq_lens[:, None]  # [B, L]
    v.masked_fill_(~in_range[:, :, None], 0)
    key = (hkv, k.dtype, k.device)
    if key not in _EYES:
        _EYES[key] = torch.eye(hkv, dtype=k.dtype, device=k.device).view(1, hkv, 1, hkv, 1)
    q_bd = (q.to(k.dtype).view(b, hkv, g, 1, d) * _EYES[key]).view(b, hq, hkv * d)
    scores = _bmm_f32(q_bd, k.transpose(1, 2)) * scale  # [B, Hq, L]
    scores.masked_fill_(~in_range[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    full = _bmm_f32(probs.to(v.dtype), v).view(b, hkv, g, hkv, d)  # [B, Hkv, G, Hkv, D]
    out = torch.diagonal(full, dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, Hkv, G, D]
    mass = probs.sum(dim=1).view(b, nb, bt).sum(-1)  # [B, NB]
    return out.reshape(t, hq, d).to(q.dtype), mass


# A turn after a cached prefix attends to keys padded to this many blocks, and its queries are
# padded to a bucket (`query_bucket`), as are a first prefill's rows: shapes repeat, so SDPA's
# cuDNN backend plans each shape once (it plans anew for every shape, tens of ms) and the
# prefill graphs have few shapes.
PREFIX_BUCKET_BLOCKS = 64


def query_bucket(q_len: int) -> int:
    """Rows a chunk of `q_len` new tokens is padded to: a power of two from 16 up to 256, then a
    multiple of 256."""
    if q_len <= 256:
        return max(16, 1 << (q_len - 1).bit_length())
    return -(-q_len // 256) * 256


def bucket_width(num_blocks: int, bucket_blocks: int = PREFIX_BUCKET_BLOCKS) -> int:
    return -(-num_blocks // bucket_blocks) * bucket_blocks


def prefix_attention(kv: Tensor, table: Tensor, q: Tensor, positions: Tensor,
                     seq_len: Tensor | int, scale: float) -> Tensor:
    """One session's new tokens q [Q, Hq, D] at `positions` [Q] against its blocks `table` [W]
    of the layer's pool `kv` [slots, 2, bt, Hkv, D]. Key j is seen by a query at position p when
    j <= p; keys at or past `seq_len` (the table's padding, stale tail) are zeroed as well, so
    no NaN there can reach the output. Shapes depend only on (Q, W): with Q and W bucketed,
    SDPA plans each shape once and the call can be captured in a CUDA graph."""
    blocks = kv[table]  # [W, 2, bt, Hkv, D], a gathered copy
    k = blocks[:, 0].flatten(0, 1)  # [L, Hkv, D]
    v = blocks[:, 1].flatten(0, 1)
    keys = torch.arange(k.shape[0], device=q.device)
    outside = (keys >= seq_len)[:, None, None]
    k, v = k.masked_fill(outside, 0), v.masked_fill(outside, 0)
    mask = keys[None, :] <= positions[:, None]  # [Q, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(k.dtype), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, Q, D]
    return out[0].transpose(0, 1)  # [Q, Hq, D]


def paged_attention_sdpa(pool: Tensor, layer: int, q: Tensor, meta: PagedMeta, scale: float
                         ) -> tuple[Tensor, Tensor | None]:
    """The fast implementation: prefill through torch's fused scaled_dot_product_attention,
    one session at a time (no block mass: the heat policy learns from decode steps); decode
    through `paged_decode_attention`, which gives the block mass. A session's first prefill
    (nothing cached) is causal, its rows padded at the end to `query_bucket`; new tokens after
    cached ones go through `prefix_attention` with queries and keys padded to buckets.
    Deterministic, so a tiered run and an all-L1 run with this implementation give identical
    tokens; it is not bit-equal to the float32 reference."""
    if meta.max_q_len == 1 and meta.write_src is None:
        return paged_decode_attention(pool, layer, q, meta, scale)
    kv = pool[:, layer]  # [slots, 2, bt, Hkv, D]
    if meta.write_src is not None:  # padded already (the prefill graphs)
        return prefix_attention(kv, meta.block_table[0], q, meta.positions, meta.seq_lens[0],
                                scale).to(q.dtype), None
    out = torch.empty_like(q)
    starts, nbs, seqs, qns = meta.host_lens or (
        meta.query_start.tolist(), meta.num_blocks.tolist(), meta.seq_lens.tolist(),
        meta.q_lens.tolist())
    for b, (nb, seq, qn) in enumerate(zip(nbs, seqs, qns)):
        rows = slice(starts[b], starts[b + 1])
        if qn == seq:  # nothing cached: the new tokens attend causally among themselves,
            # padded at the end to a bucket of rows (zeros: a real row never sees them)
            blocks = kv[meta.block_table[b, :nb]]  # [nb, 2, bt, Hkv, D]
            tail = (0, 0, 0, 0, 0, query_bucket(seq) - seq)
            k, v = (F.pad(blocks[:, i].flatten(0, 1)[:seq], tail).transpose(0, 1)[None]
                    for i in (0, 1))  # [1, Hkv, L padded, D]
            o = F.scaled_dot_product_attention(
                F.pad(q[rows].to(k.dtype), tail).transpose(0, 1)[None], k, v, is_causal=True,
                scale=scale, enable_gqa=True)
            out[rows] = o[0, :, :seq].transpose(0, 1).to(q.dtype)
            continue
        width, qb = bucket_width(nb), query_bucket(qn)
        table = meta.block_table.new_zeros(width)
        table[:nb] = meta.block_table[b, :nb]
        pad = torch.full((qb,), starts[b + 1] - 1, dtype=torch.int64, device=q.device)
        pad[:qn] = torch.arange(starts[b], starts[b + 1], device=q.device)
        o = prefix_attention(kv, table, q[pad], meta.positions[pad], seq, scale)
        out[rows] = o[:qn].to(q.dtype)
    return out, None
