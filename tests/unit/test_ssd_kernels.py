"""The L3 store's compiled record kernels: the crc32c package's values, headers bit-exact."""

from __future__ import annotations

from pathlib import Path

import crc32c
import numpy as np
import pytest

from tests.unit.test_ssd_store import SMALL, empty_out, geometry, make_stores, random_blocks
from tpkv.errors import SsdFormatError
from tpkv.ssd import kernels
from tpkv.ssd.format import (
    HEADER_CRC_BYTES,
    SegmentIdentity,
    check_record_header,
    check_record_headers,
    crc_many,
    pack_record_header,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no SSE4.2 kernels here")


def test_crc_batch_is_the_crc32c_packages_value_for_any_length_and_alignment() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    stripe = kernels.STRIPE
    lengths = [*range(0, 40), stripe - 1, stripe, stripe + 1, 2 * stripe + 7, 3 * stripe,
               (512 << 10), (512 << 10) + 4092, 1_000_003]
    bufs = [data[int(rng.integers(0, 64)):][:n] for n in lengths]
    assert kernels.crc_batch(bufs) == [crc32c.crc32c(b.data) for b in bufs]
    strided = data[:8192:2]  # not contiguous: still the right value
    assert kernels.crc_batch([strided]) == [crc32c.crc32c(np.ascontiguousarray(strided).data)]


def test_the_kernels_run_without_the_gil() -> None:
    found = kernels._kernel()
    assert found is not None
    for name in ("crc_many", "fill_headers"):
        assert found[name].targetoptions["nogil"] is True


def test_filled_headers_are_the_ones_pack_record_header_writes() -> None:
    ident = SegmentIdentity(bytes(range(32)), 3, 4, 8192, b"g" * 32, b"m" * 32, 0x1234_5678_9abc)
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in range(5)]
    indices = np.array([0, 7, 2**40, 3, 2**63 - 1], dtype=np.int64)
    template = np.zeros(4096, np.uint8)
    pack_record_header(ident, template, 0, 0, 0)
    got = np.full((5, 4096), 0xEE, np.uint8)
    assert kernels.fill_headers(got, template, indices, 11, payloads)
    for k in range(5):
        want = np.zeros(4096, np.uint8)
        pack_record_header(ident, want, int(indices[k]), crc32c.crc32c(payloads[k].data), 11 + k)
        np.testing.assert_array_equal(got[k], want)
        assert check_record_header(got[k], ident, int(indices[k]), 11 + k) == crc32c.crc32c(
            payloads[k].data)
    assert not kernels.fill_headers(got[:2], template, indices[:2], 0,
                                    [payloads[0], payloads[1][:100]])  # sizes differ: refused


@pytest.mark.parametrize("kernels_on", [True, False])
def test_a_round_trip_is_bit_exact_with_and_without_the_kernels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels_on: bool) -> None:
    if not kernels_on:
        monkeypatch.setitem(kernels._state, "kernel", None)
    geo = geometry(SMALL)
    [store] = make_stores(tmp_path, geo, o_direct=False)
    blocks = random_blocks(np.random.default_rng(2), geo, 9)
    store.write_blocks("s", np.arange(9), blocks)
    assert store.commit_manifest("s")
    out = empty_out(geo, 9)
    assert store.read_blocks("s", np.arange(9), out).all()
    for got, want in zip(out, blocks):
        np.testing.assert_array_equal(got, want)
    assert crc_many(blocks) == [crc32c.crc32c(b.data) for b in blocks]
    store.close()


def test_copy_many_copies_bit_exact_and_refuses_what_it_cannot_copy() -> None:
    rng = np.random.default_rng(3)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4097, 1 << 19)]
    dsts = [np.zeros_like(s) for s in srcs]
    assert kernels.copy_many(dsts, srcs)
    for d, s in zip(dsts, srcs):
        np.testing.assert_array_equal(d, s)
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    assert not kernels.copy_many([frozen], [np.ones(8, np.uint8)])
    assert not kernels.copy_many([np.zeros(8, np.uint8)], [np.ones(9, np.uint8)])
    assert not frozen.any()


# (byte offset, what) of each field of a record header the batch check reads
_FIELDS = [(0, "magic"), (8, "logical index"), (16, "payload bytes"), (24, "payload crc"),
           (28, "rank"), (32, "record number"), (40, "segment id"), (48, "session hash"),
           (79, "session hash, last byte"), (4092, "seal")]


@pytest.mark.parametrize("offset,what", _FIELDS)
def test_the_batch_header_check_finds_any_field_changed(offset: int, what: str) -> None:
    """check_record_headers agrees with check_record_header record by record: all five good
    headers pass; one byte changed in any field of one of them (resealed, so that only the
    field is wrong, except for the seal itself) fails that record alone, as the one-record
    check raises for it. A payload CRC that does not match fails its record too."""
    ident = SegmentIdentity(bytes(range(32)), 3, 4, 8192, b"g" * 32, b"m" * 32, 0x1234_5678_9abc)
    rng = np.random.default_rng(2)
    payloads = [rng.integers(0, 256, 8192, dtype=np.uint8) for _ in range(5)]
    indices = np.array([4, 7, 2**40, 0, 2**63 - 1], dtype=np.int64)
    headers = np.zeros((5, 4096), np.uint8)
    for k in range(5):
        pack_record_header(ident, headers[k], int(indices[k]), crc32c.crc32c(payloads[k].data),
                           11 + k)
    crcs = np.array([crc32c.crc32c(p.data) for p in payloads], np.uint32)

    def seals() -> np.ndarray:
        return np.array([crc32c.crc32c(h[:HEADER_CRC_BYTES].data) for h in headers], np.uint32)

    assert check_record_headers(headers, ident, indices, 11, seals(), crcs).all()
    headers[2, offset] ^= 0x40
    if offset != 4092:  # reseal: only the field is wrong
        headers[2, 4092:] = np.frombuffer(
            np.uint32(crc32c.crc32c(headers[2, :HEADER_CRC_BYTES].data)).tobytes(), np.uint8)
    ok = check_record_headers(headers, ident, indices, 11, seals(), crcs)
    if offset == 24:  # the stored payload CRC no longer matches the payload's
        assert ok.tolist() == [True, True, False, True, True]
        assert check_record_header(headers[2], ident, int(indices[2]), 13) != crcs[2]
        return
    assert ok.tolist() == [True, True, False, True, True], what
    with pytest.raises(SsdFormatError):
        check_record_header(headers[2], ident, int(indices[2]), 13)
    bad_payload = crcs.copy()
    bad_payload[4] ^= 1
    assert check_record_headers(headers, ident, indices, 11, seals(),
                                bad_payload).tolist() == [True, True, False, True, False]
