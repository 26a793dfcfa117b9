"""Paged attention reference against dense attention: scattered blocks, ragged lengths, mass."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpkv.errors import BadRequestError, SlotError
from tpkv.models.paged import (
    PagedAttention,
    build_meta,
    paged_attention_ref,
    paged_attention_sdpa,
    paged_decode_attention,
    write_kv,
)

BT, LAYERS, HQ, HKV, D, SLOTS = 4, 2, 6, 2, 8, 64


def _case(seq_lens, q_lens, seed=0, max_score_bytes=256 << 20, impl=None):
    """Random K/V for every token of every session in scattered slots; run one paged step on
    layer 1 and return (out, mass) with the dense reference (out, probabilities per session)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pool = torch.full((SLOTS, LAYERS, 2, BT, HKV, D), float("nan"))  # unwritten: NaN
    nb = [-(-s // BT) for s in seq_lens]
    perm = rng.permutation(SLOTS)
    tables = np.split(perm[:sum(nb)], np.cumsum(nb)[:-1])
    keys = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    vals = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    cached = [s - q for s, q in zip(seq_lens, q_lens)]
    for i, c in enumerate(cached):  # the cached prefix is already in L1
        if c:
            pre = build_meta([tables[i]], [c], [c], BT, SLOTS)
            write_kv(pool, 1, keys[i][:c], vals[i][:c], pre)
    meta = build_meta(tables, seq_lens, q_lens, BT, SLOTS)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    new_k = torch.cat([k[c:] for k, c in zip(keys, cached)])
    new_v = torch.cat([v[c:] for v, c in zip(vals, cached)])
    attn = PagedAttention(pool, meta, impl or functools.partial(
        paged_attention_ref, max_score_bytes=max_score_bytes))
    out = attn(1, q, new_k, new_v)
    ref_out, ref_probs = [], []
    for i, (s, c) in enumerate(zip(seq_lens, cached)):
        qi = q[meta.query_start[i]:meta.query_start[i + 1]]  # [Q, Hq, D]
        allowed = torch.arange(s)[None, :] <= torch.arange(c, s)[:, None]  # [Q, S]
        k_rep = keys[i].repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]
        scores = torch.einsum("qhd,shd->hqs", qi, k_rep) / D ** 0.5
        ref_probs.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1))
        ref_out.append(F.scaled_dot_product_attention(
            qi.transpose(0, 1), keys[i].transpose(0, 1), vals[i].transpose(0, 1),
            attn_mask=allowed, enable_gqa=True).transpose(0, 1))
    return out, attn.block_mass, torch.cat(ref_out), ref_probs, meta


@pytest.mark.parametrize("seq_lens,q_lens", [
    ([1, 3, 4, 5, 16, 17, 33], [1] * 7),  # decode: ragged, some not a multiple of BT
    ([23], [23]),  # prefill from nothing
    ([30], [11]),  # prefill after a cached prefix of 19 (mid-block)
    ([9, 2, 40, 13], [9, 1, 5, 1]),  # mixed prefill and decode in one batch
])
def test_paged_matches_dense(seq_lens, q_lens):
    out, mass, ref, probs, meta = _case(seq_lens, q_lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert mass is not None and mass.shape == (len(seq_lens), max(-(-s // BT) for s in seq_lens))
    for i, s in enumerate(seq_lens):
        nb = -(-s // BT)
        per_block = F.pad(probs[i].sum(dim=(0, 1)), (0, nb * BT - s)).view(nb, BT).sum(-1)
        torch.testing.assert_close(mass[i, :nb], per_block, atol=1e-5, rtol=1e-5)
        assert mass[i, :nb].sum().item() == pytest.approx(HQ * q_lens[i], rel=1e-5)
        assert (mass[i, nb:] == 0).all()  # padding blocks get nothing


@pytest.mark.parametrize("seq_lens,q_lens", [([23], [23]), ([30], [11]), ([9, 2, 40], [9, 1, 5]),
                                             ([5, 17], [1, 1])])
def test_sdpa_prefill_matches_dense(seq_lens, q_lens):
    out, mass, ref, _, _ = _case(seq_lens, q_lens, impl=paged_attention_sdpa)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (mass is None) == (max(q_lens) > 1)  # decode steps still report block mass


@pytest.mark.parametrize("length,rows", [(23, 32), (200, 256), (16, 16)])
def test_sdpa_first_prefill_pads_its_rows_to_a_bucket(monkeypatch, length, rows):
    """A prefill from nothing runs SDPA on rows padded to `query_bucket` (so its shapes repeat
    across lengths and cuDNN plans each once), and its real rows still match dense attention."""
    import tpkv.models.paged as paged

    shapes, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(paged.F, "scaled_dot_product_attention", spy)
    out, _, ref, _, _ = _case([length], [length], impl=paged_attention_sdpa)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert shapes[0] == ((1, HQ, rows, D), (1, HKV, rows, D))  # (then the dense reference)


def test_query_chunks_give_the_same_result():
    lens, qs = [35, 7], [29, 1]
    whole, mass_whole, *_ = _case(lens, qs, seed=3)
    chunked, mass_chunked, *_ = _case(lens, qs, seed=3, max_score_bytes=1)  # one row at a time
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mass_chunked, mass_whole, atol=1e-5, rtol=1e-6)


def test_new_tokens_land_at_their_slot_and_offset():
    _, _, _, _, meta = _case([6, 9], [1, 3])
    table = meta.block_table.numpy()
    assert meta.positions.tolist() == [5, 6, 7, 8]
    assert meta.write_slots.tolist() == [table[0, 1], table[1, 1], table[1, 1], table[1, 2]]
    assert meta.write_offsets.tolist() == [1, 2, 3, 0]
    assert meta.last_rows.tolist() == [0, 3]


def test_bad_tables_are_refused():
    with pytest.raises(BadRequestError, match="lists 1"):
        build_meta([[3]], [5], [1], BT, SLOTS)  # 5 tokens need 2 blocks
    with pytest.raises(SlotError, match="outside"):
        build_meta([[3, SLOTS]], [5], [1], BT, SLOTS)
    with pytest.raises(SlotError, match="more than once"):
        build_meta([[3, 4], [4]], [5, 1], [1, 1], BT, SLOTS)
    with pytest.raises(BadRequestError, match="adds 6 tokens"):
        build_meta([[3, 4]], [5], [6], BT, SLOTS)
    with pytest.raises(BadRequestError, match="B >= 1"):
        build_meta([], [], [], BT, SLOTS)


@pytest.mark.parametrize("seq_lens", [[1, 3, 4, 5, 16, 17, 33], [40], [2, 9]])
def test_fast_decode_matches_dense_and_gives_the_mass(seq_lens):
    """The block-diagonal decode path against dense attention (NaN in every unwritten slot)."""
    ones = [1] * len(seq_lens)
    out, mass, ref, probs, _ = _case(seq_lens, ones, impl=paged_attention_sdpa)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ref_out, ref_mass, *_ = _case(seq_lens, ones)
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(out).any()


def test_fast_decode_in_bfloat16_stays_close_to_the_float32_reference():
    seq_lens = [7, 30, 64]
    g = torch.Generator().manual_seed(5)
    pool = torch.randn((SLOTS, LAYERS, 2, BT, HKV, D), generator=g)
    tables = [np.arange(0, 2), np.arange(2, 10), np.arange(10, 26)]
    meta = build_meta(tables, seq_lens, [1, 1, 1], BT, SLOTS)
    q = torch.randn(3, HQ, D, generator=g)
    want, want_mass = paged_attention_ref(pool, 0, q, meta, D ** -0.5)
    got, got_mass = paged_decode_attention(pool.bfloat16(), 0, q.bfloat16(), meta, D ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_mass, want_mass, atol=2e-2, rtol=2e-2)
