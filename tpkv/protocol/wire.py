"""The strict msgpack wire form: one extension (ndarray), hard size limits, typed errors."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from tpkv.errors import WireFormatError
from tpkv.protocol.plan import MovePlan

_EXT_NDARRAY = 1
_WIRE_DTYPES = {"<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f4", "<f8", "|b1",
                "|i1", "|u1"}
MAX_MESSAGE_BYTES = 256 << 20


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype.str not in _WIRE_DTYPES:
            raise WireFormatError(f"dtype {arr.dtype} cannot be sent")
        header = msgpack.packb([arr.dtype.str, list(obj.shape)])  # (ascontiguousarray is 1-d+)
        return msgpack.ExtType(_EXT_NDARRAY, header + arr.tobytes())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise WireFormatError(f"type {type(obj).__name__} cannot be sent")


_UINT_BYTES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}  # msgpack uint 8/16/32/64 markers


def _simple_header(data: bytes) -> tuple[str, list[int], int] | None:
    """The header as `_default` writes it ([fixstr dtype, fixarray of unsigned ints]) read
    byte by byte, or None for any other form (then the general unpacker reads it)."""
    if len(data) < 4 or data[0] != 0x92 or not 0xA0 <= data[1] <= 0xBF:
        return None
    at = 2 + (data[1] & 0x1F)
    if at >= len(data) or not 0x90 <= data[at] <= 0x9F:
        return None
    dtype = data[2:at].decode("ascii", "replace")
    ndim, at = data[at] & 0x0F, at + 1
    shape = []
    for _ in range(ndim):
        if at >= len(data):
            return None
        b = data[at]
        if b <= 0x7F:  # positive fixint
            shape.append(b)
            at += 1
        elif b in _UINT_BYTES:
            n = _UINT_BYTES[b]
            if at + 1 + n > len(data):
                return None
            shape.append(int.from_bytes(data[at + 1:at + 1 + n], "big"))
            at += 1 + n
        else:
            return None
    return dtype, shape, at


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_NDARRAY:
        raise WireFormatError(f"unknown msgpack extension type {code}")
    header = _simple_header(data)
    if header is None:
        unpacker = msgpack.Unpacker(max_buffer_size=len(data), max_array_len=64,
                                    max_str_len=16)
        unpacker.feed(data)
        try:
            dtype, shape = unpacker.unpack()
            offset = unpacker.tell()
        except Exception as exc:
            raise WireFormatError(f"bad ndarray header: {exc}") from exc
    else:
        dtype, shape, offset = header
    if dtype not in _WIRE_DTYPES or not isinstance(shape, list):
        raise WireFormatError(f"bad ndarray header: dtype={dtype!r} shape={shape!r}")
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise WireFormatError(f"bad ndarray shape {shape!r}")
    payload = memoryview(data)[offset:]
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if len(payload) != expected:
        raise WireFormatError(f"ndarray payload is {len(payload)} bytes, shape needs {expected}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape).copy()


def encode(obj: Any) -> bytes:
    """Pack dicts, lists, scalars, str/bytes and numpy arrays."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Unpack a message from `encode`; anything else raises WireFormatError, never executes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"message of {len(data)} bytes is above {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(
            data, ext_hook=_ext_hook, raw=False, strict_map_key=True, use_list=True,
            max_str_len=1 << 20, max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=1 << 24, max_map_len=1 << 20, max_ext_len=MAX_MESSAGE_BYTES,
        )
    except WireFormatError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise WireFormatError(f"cannot decode message: {type(exc).__name__}: {exc}") from exc


def detached(obj: Any) -> Any:
    """A copy of a message's arrays and containers: what encode + decode would give, without
    the wire (the holder sees nothing change when the sender reuses its arrays)."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [detached(v) for v in obj]
    return obj


def encode_plan(plan: MovePlan) -> bytes:
    return encode(plan.to_dict())


def decode_plan(data: bytes) -> MovePlan:
    d = decode(data)
    if not isinstance(d, dict):
        raise WireFormatError(f"plan message must be a map, got {type(d).__name__}")
    return MovePlan.from_dict(d)
