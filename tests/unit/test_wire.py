"""The msgpack wire format: plans round-trip exactly; anything malformed is a WireFormatError."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkv.errors import WireFormatError
from tpkv.protocol.plan import MovePlan, Tier
from tpkv.protocol.wire import decode, decode_plan, encode, encode_plan


def make_plan(n: int = 5, epoch: int = 7) -> MovePlan:
    rng = np.random.default_rng(n)
    return MovePlan(
        epoch=epoch, block_ids=rng.permutation(1000)[:n], src_tier=np.full(n, Tier.HBM),
        src_slot=rng.integers(0, 100, n), dst_tier=np.full(n, Tier.DRAM),
        dst_slot=rng.integers(0, 100, n), session_idx=np.zeros(n), logical_idx=np.arange(n),
        session_names=("sess-a",),
    )


def test_plan_round_trip():
    plan = make_plan()
    back = decode_plan(encode_plan(plan))
    assert back.epoch == 7 and back.session_names == ("sess-a",)
    for name in ("block_ids", "src_tier", "src_slot", "dst_tier", "dst_slot", "logical_idx"):
        np.testing.assert_array_equal(getattr(back, name), getattr(plan, name))
        assert getattr(back, name).dtype == getattr(plan, name).dtype
    assert back.num_moves == 5 and back.mask(Tier.HBM, Tier.DRAM).all()


def test_plan_rejects_duplicate_block():
    with pytest.raises(WireFormatError, match="more than once"):
        MovePlan(1, [3, 3], [0, 0], [1, 2], [1, 1], [4, 5], [0, 0], [0, 1], ("s",))


def test_plan_rejects_bad_tier_and_lengths():
    with pytest.raises(WireFormatError, match="invalid tiers"):
        MovePlan(1, [3], [0], [1], [7], [4], [0], [0], ("s",))
    with pytest.raises(WireFormatError, match="shape"):
        MovePlan(1, [3, 4], [0], [1], [1], [4], [0], [0], ("s",))
    with pytest.raises(WireFormatError, match="session_idx"):
        MovePlan(1, [3], [0], [1], [1], [4], [2], [0], ("s",))


def test_trusted_plan_is_checked_once_it_crosses_the_wire():
    """MovePlan.trusted (plans the controller built) checks nothing; decoding checks all."""
    i8, i64 = np.int8, np.int64
    plan = MovePlan.trusted(1, np.array([3, 3], i64), np.zeros(2, i8), np.array([1, 2], i64),
                            np.ones(2, i8), np.array([4, 5], i64), np.zeros(2, np.int32),
                            np.array([0, 1], i64), ("s",))
    assert plan.num_moves == 2 and not plan.block_ids.flags.writeable
    with pytest.raises(WireFormatError, match="more than once"):
        decode_plan(encode_plan(plan))
    good = make_plan()
    trusted = MovePlan.trusted(good.epoch, *(getattr(good, n).copy() for n in (
        "block_ids", "src_tier", "src_slot", "dst_tier", "dst_slot", "session_idx",
        "logical_idx")), good.session_names)
    assert encode_plan(trusted) == encode_plan(good)


def test_unknown_extension_rejected():
    data = msgpack.packb({"x": msgpack.ExtType(42, b"evil")})
    with pytest.raises(WireFormatError, match="unknown msgpack extension type 42"):
        decode(data)


def test_ndarray_payload_length_checked():
    header = msgpack.packb(["<i8", [4]])
    data = msgpack.packb(msgpack.ExtType(1, header + b"\0" * 8))
    with pytest.raises(WireFormatError, match="payload is 8 bytes, shape needs 32"):
        decode(data)


def test_object_dtype_cannot_be_sent_or_received():
    with pytest.raises(WireFormatError):
        encode(np.array([object()], dtype=object))
    header = msgpack.packb(["|O", [1]])
    with pytest.raises(WireFormatError, match="dtype"):
        decode(msgpack.packb(msgpack.ExtType(1, header + b"\0" * 8)))


def test_non_bytes_and_non_map_plan():
    with pytest.raises(WireFormatError):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(WireFormatError, match="must be a map"):
        decode_plan(encode([1, 2]))
    with pytest.raises(WireFormatError, match="missing"):
        decode_plan(encode({"epoch": 1}))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_typed_errors(data):
    try:
        decode(data)
    except WireFormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 64), st.integers(0, 2**40))
def test_fuzz_mutated_plans_only_typed_errors(n, seed):
    raw = bytearray(encode_plan(make_plan(n, epoch=seed % 1000)))
    rng = np.random.default_rng(seed)
    for _ in range(int(rng.integers(1, 4))):
        raw[int(rng.integers(0, len(raw)))] = int(rng.integers(0, 256))
    try:
        decode_plan(bytes(raw))
    except WireFormatError:
        pass


@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 200), (70_000,), (2, 1, 3)])
def test_ndarray_headers_read_fast_or_general_give_the_same_arrays(shape):
    """Arrays round-trip whether the header is read byte by byte (the form encode writes) or by
    the general unpacker (any other valid msgpack form, e.g. a str8 dtype and signed ints)."""
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    got = decode(encode({"a": arr}))["a"]
    assert got.dtype == arr.dtype and got.shape == arr.shape and (got == arr).all()
    packer = msgpack.Packer(use_bin_type=True)
    other = (b"\x92\xd9\x03<i4" + packer.pack_array_header(len(shape))
             + b"".join(b"\xd2" + int(s).to_bytes(4, "big", signed=True) for s in shape))
    slow = decode(msgpack.packb({"a": msgpack.ExtType(1, other + arr.tobytes())}))["a"]
    assert slow.shape == arr.shape and (slow == arr).all()


def test_fast_header_still_checks_payload_and_dtype():
    with pytest.raises(WireFormatError, match="payload is 7 bytes, shape needs 8"):
        decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i8", [1]]) + b"\0" * 7)))
    with pytest.raises(WireFormatError, match="dtype"):
        decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<X9", [1]]) + b"\0" * 8)))
    with pytest.raises(WireFormatError):  # a shape cut short
        decode(msgpack.packb(msgpack.ExtType(1, b"\x92\xa3<i8\x92\x01")))


def test_kept_moves_round_trip_and_only_moves_down_from_l1_or_l2_may_be_kept():
    plan = make_plan()
    kept = np.array([True, False, True, False, False])
    plan = MovePlan(**{**plan.__dict__, "kept": kept})
    back = decode_plan(encode_plan(plan))
    assert back.kept_mask().tolist() == kept.tolist() and back.num_kept == 2
    assert make_plan().num_kept == 0 and len(make_plan().kept) == 0  # none kept: not sent
    assert "kept" not in make_plan().to_dict()
    with pytest.raises(WireFormatError, match="kept has 2 entries"):
        MovePlan(**{**make_plan().__dict__, "kept": np.array([True, False])})
    up = MovePlan(1, [3], [1], [4], [0], [7], [0], [0], ("s",), kept=np.array([False]))
    assert up.num_kept == 0
    with pytest.raises(WireFormatError, match="not L1 -> L2"):
        MovePlan(1, [3], [1], [4], [0], [7], [0], [0], ("s",), kept=np.array([True]))
    spill = MovePlan(1, [3], [1], [4], [2], [-1], [0], [0], ("s",), kept=np.array([True]))
    assert decode_plan(encode_plan(spill)).num_kept == 1  # onto the record a load left
    for src, dst in ((2, 1), (0, 2), (-1, 0)):  # a load, a tier skipped, a fresh block
        with pytest.raises(WireFormatError, match="or L2 -> L3"):
            MovePlan(1, [3], [src], [4], [dst], [7], [0], [0], ("s",), kept=np.array([True]))
