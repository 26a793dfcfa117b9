"""Thin, lazily imported wrappers over the CUDA runtime calls tpkv needs (cuda.bindings)."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tpkv.errors import DeviceError
from tpkv.settings import env_flag

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


def memcpy_batch(dsts: Sequence[int] | np.ndarray, srcs: Sequence[int] | np.ndarray,
                 sizes: Sequence[int] | np.ndarray, stream: int,
                 chunk: int = MAX_BATCH_DESCRIPTORS, attr: Any = None) -> None:
    """Issue copies dst[i] <- src[i] of sizes[i] bytes on `stream`, in chunks of <= 8192 (one
    cudaMemcpyBatchAsync each). `stream` must be a created stream, not the legacy stream 0.
    `attr`: a cudaMemcpyAttributes for every copy (default: source read in stream order).

    Calls the CUDA runtime torch loaded directly, with the three numpy arrays as they are
    (`raw_batch_call()`); only where that runtime cannot be found does it go through
    cuda.bindings, whose list arguments cost about a microsecond per descriptor on the host."""
    rt = runtime()
    attr = attr if attr is not None else _stream_order_attr()
    n = len(dsts)
    chunk = max(1, min(chunk, MAX_BATCH_DESCRIPTORS))
    raw = raw_batch_call()
    if raw is not None:
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes)]
        attr_ptr = int(attr.getPtr())
        for start in range(0, n, chunk):
            count = min(n, start + chunk) - start
            d, s, z = (a[start:] for a in arrays)
            err = raw(d.ctypes.data, s.ctypes.data, z.ctypes.data, count, attr_ptr, stream)
            if err:
                raise DeviceError(f"cudaMemcpyBatchAsync({count} copies) failed with CUDA error "
                                  f"{err}")
        return
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        count = stop - start
        res = rt.cudaMemcpyBatchAsync([int(x) for x in dsts[start:stop]],
                                      [int(x) for x in srcs[start:stop]],
                                      [int(x) for x in sizes[start:stop]], count, [attr], [0], 1,
                                      stream)
        _check(f"cudaMemcpyBatchAsync({count} copies)", res)


# Tests and benchmarks set this False to take the cuda.bindings path.
USE_RAW_BATCH = env_flag("TPKV_RAW_MEMCPY_BATCH", True)


def _loaded_cudart() -> str | None:
    """Path of the libcudart this process loaded (torch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(maxsplit=5)[-1]
                if "/libcudart.so" in path and os.path.exists(path):
                    return path
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def _raw_batch() -> Any:
    if not (has_memcpy_batch() and torch.cuda.is_available()):
        return None
    torch.cuda.init()
    path = _loaded_cudart()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        fn = lib.cudaMemcpyBatchAsync
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    if version.value >= 13000:  # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
        fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]
        zero = (ctypes.c_size_t * 1)(0)

        def call(d: int, s: int, z: int, count: int, attr: int, stream: int) -> int:
            return int(fn(d, s, z, count, attr, zero, 1, stream))
    elif version.value >= 12080:  # 12.8 and 12.9 take a failIdx before the stream
        fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp, vp]
        zero, fail = (ctypes.c_size_t * 1)(0), ctypes.c_size_t(0)

        def call(d: int, s: int, z: int, count: int, attr: int, stream: int) -> int:
            return int(fn(d, s, z, count, attr, zero, 1, ctypes.byref(fail), stream))
    else:
        return None
    return call


def raw_batch_call() -> Any:
    """cudaMemcpyBatchAsync of the runtime torch loaded, called through ctypes with pointers to
    the descriptor arrays: (dsts, srcs, sizes, count, attr, stream) -> CUDA error code; None
    when that runtime is not found, is older than 12.8, or USE_RAW_BATCH is off."""
    return _raw_batch() if USE_RAW_BATCH else None
