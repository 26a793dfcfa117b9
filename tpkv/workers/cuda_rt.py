"""Thin, lazily imported wrappers over the CUDA runtime calls tpkv needs (cuda.bindings)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from tpkv.errors import DeviceError

# cudaHostRegisterPortable | cudaHostRegisterMapped
HOST_REGISTER_FLAGS = 0x01 | 0x02
MAX_BATCH_DESCRIPTORS = 8192


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def runtime() -> Any:
    """cuda.bindings.runtime, or None when it is not installed."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    return rt


def _check(call: str, result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise DeviceError(f"{call} failed with CUDA error {int(err)} ({err})")
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


def host_register(ptr: int, num_bytes: int) -> None:
    """Pin an existing page-aligned host range (cudaHostRegister, portable + mapped)."""
    rt = runtime()
    if rt is not None:
        _check("cudaHostRegister", rt.cudaHostRegister(ptr, num_bytes, HOST_REGISTER_FLAGS))
        return
    err = torch.cuda.cudart().cudaHostRegister(ptr, num_bytes, HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise DeviceError(f"cudaHostRegister({num_bytes} bytes) failed with CUDA error {err}")


def host_unregister(ptr: int) -> None:
    rt = runtime()
    if rt is not None:
        _check("cudaHostUnregister", rt.cudaHostUnregister(ptr))
        return
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        raise DeviceError(f"cudaHostUnregister failed with CUDA error {err}")


@functools.lru_cache(maxsize=1)
def has_memcpy_batch() -> bool:
    rt = runtime()
    return rt is not None and hasattr(rt, "cudaMemcpyBatchAsync")


@functools.lru_cache(maxsize=1)
def _stream_order_attr() -> Any:
    rt = runtime()
    attr = rt.cudaMemcpyAttributes()
    attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    return attr


def memcpy_batch(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                 stream: int, chunk: int = MAX_BATCH_DESCRIPTORS, attr: Any = None) -> None:
    """Issue copies dst[i] <- src[i] of sizes[i] bytes on `stream`, in chunks of <= 8192 (one
    cudaMemcpyBatchAsync each). `stream` must be a created stream, not the legacy stream 0.
    `attr`: a cudaMemcpyAttributes for every copy (default: source read in stream order)."""
    rt = runtime()
    attr = attr if attr is not None else _stream_order_attr()
    n = len(dsts)
    chunk = max(1, min(chunk, MAX_BATCH_DESCRIPTORS))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        count = stop - start
        res = rt.cudaMemcpyBatchAsync(list(dsts[start:stop]), list(srcs[start:stop]),
                                      list(sizes[start:stop]), count, [attr], [0], 1, stream)
        _check(f"cudaMemcpyBatchAsync({count} copies)", res)
