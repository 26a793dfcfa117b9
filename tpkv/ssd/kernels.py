"""Compiled record checks without the GIL (x86-64 SSE4.2): CRC32C of many buffers in one
call, a write's record headers filled in (payload CRCs and seals) in one call, and the copies
of a read ahead's blocks served in one call.

Why: the crc32c package computes one buffer a call and drops and takes the GIL around each
one. A read job of 64 records, or a write piece, so took the GIL back dozens of times, and
beside a busy Python thread (a serving process's main thread) each take waited for it: on
the H200 machine a read-ahead job spent 64% of its time outside its system calls. Here one
call checks all of a job's records (bench/l3_path.py measures both).

The kernel runs three CRC streams over thirds of each STRIPE (the crc32 instruction has a
latency of three cycles and a throughput of one) and joins them with the shift tables of
the tables `_build` makes. Values are the crc32c package's (Castagnoli, as docs/ssd-format.md says);
`available()` is False where the CPU or numba cannot run it, and callers fall back to that
package.
"""

from __future__ import annotations

import logging
import platform
import threading
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tpkv.numba_cache import ensure_cache_dir
from tpkv.ssd.backend import BlockViews

log = logging.getLogger(__name__)

STRIPE = 3 * 8192  # bytes per three-stream step: three lanes of 8 KiB
_LANE = STRIPE // 3
_lock = threading.Lock()
_state: dict[str, Any] = {}


ensure_cache_dir(__file__)  # before any kernel is defined: a read-only install still caches
_jit = njit(cache=True, nogil=True, boundscheck=False)


def _load_u64(typingctx: Any, addr: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)
    return types.uint64(types.uint64), codegen


load_u64: Any = intrinsic(_load_u64)


def _load_u8(typingctx: Any, addr: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return builder.zext(builder.load(ptr, align=1), ir.IntType(32))
    return types.uint32(types.uint64), codegen


load_u8: Any = intrinsic(_load_u8)


def _crc_u64(typingctx: Any, crc: Any, data: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, i64])
        fn = cgutils.get_or_insert_function(builder.module, fnty,
                                            "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, args)
    return types.uint64(types.uint64, types.uint64), codegen


crc_u64: Any = intrinsic(_crc_u64)


def _crc_u8(typingctx: Any, crc: Any, data: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, i8 = ir.IntType(32), ir.IntType(8)
        fnty = ir.FunctionType(i32, [i32, i8])
        fn = cgutils.get_or_insert_function(builder.module, fnty,
                                            "llvm.x86.sse42.crc32.32.8")
        return builder.call(fn, [args[0], builder.trunc(args[1], i8)])
    return types.uint32(types.uint32, types.uint32), codegen


crc_u8: Any = intrinsic(_crc_u8)



def _memcpy(typingctx: Any, dst: Any, src: Any, n: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p),
                           builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()
    return types.void(types.uint64, types.uint64, types.uint64), codegen


memcpy: Any = intrinsic(_memcpy)


@_jit
def _copy_many(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> None:
    """lens[i] bytes from srcs[i] to dsts[i] (addresses), for each i."""
    for i in range(len(dsts)):
        memcpy(dsts[i], srcs[i], lens[i])


@_jit
def _raw_one(crc: np.uint64, addr: np.uint64, n: np.uint64) -> np.uint64:
    """The raw (unconditioned) register after n bytes at addr, one stream."""
    end8 = addr + (n & ~np.uint64(7))
    while addr < end8:
        crc = crc_u64(crc, load_u64(addr))
        addr += np.uint64(8)
    end = addr + (n & np.uint64(7))
    c32 = np.uint32(crc)
    while addr < end:
        c32 = crc_u8(c32, load_u8(addr))
        addr += np.uint64(1)
    return np.uint64(c32)

@_jit
def _shift(tables: np.ndarray, which: int, x: np.uint64) -> np.uint64:
    t = tables[which]
    return (t[0, x & np.uint64(255)] ^ t[1, (x >> np.uint64(8)) & np.uint64(255)]
            ^ t[2, (x >> np.uint64(16)) & np.uint64(255)] ^ t[3, x >> np.uint64(24)])

@_jit
def _crc_one(addr: np.uint64, n: np.uint64, tables: np.ndarray) -> np.uint32:
    """crc32c of n bytes at addr (the crc32c package's value)."""
    lane = np.uint64(_LANE)
    crc = np.uint64(0xFFFFFFFF)
    while n >= np.uint64(3) * lane:
        a = crc
        b = np.uint64(0)
        c = np.uint64(0)
        p = addr
        end = addr + lane
        while p < end:
            a = crc_u64(a, load_u64(p))
            b = crc_u64(b, load_u64(p + lane))
            c = crc_u64(c, load_u64(p + lane + lane))
            p += np.uint64(8)
        crc = _shift(tables, 1, a) ^ _shift(tables, 0, b) ^ c
        addr += np.uint64(3) * lane
        n -= np.uint64(3) * lane
    crc = _raw_one(crc, addr, n)
    return np.uint32(crc ^ np.uint64(0xFFFFFFFF))

@_jit
def _crc_many(addrs: np.ndarray, lens: np.ndarray, tables: np.ndarray,
             out: np.ndarray) -> None:
    """out[i] = crc32c of lens[i] bytes at addrs[i]."""
    for i in range(len(addrs)):
        out[i] = _crc_one(np.uint64(addrs[i]), np.uint64(lens[i]), tables)

@_jit
def _fill_headers(headers: np.ndarray, template: np.ndarray, indices: np.ndarray,
                 first_record_no: int, payloads: np.ndarray, payload_bytes: int,
                 tables: np.ndarray) -> None:
    """Each headers[k]: the template with logical index indices[k] (i64 at 8), the CRC32C
    of payloads[k] (u32 at 24) and record number first_record_no + k (u64 at 32), sealed
    (CRC32C of its first 4092 bytes at 4092)."""
    for k in range(len(indices)):
        h = headers[k]
        h[:] = template
        crc = _crc_one(np.uint64(payloads[k]), np.uint64(payload_bytes), tables)
        index = np.uint64(indices[k])
        number = np.uint64(first_record_no + k)
        for j in range(8):
            h[8 + j] = np.uint8((index >> np.uint64(8 * j)) & np.uint64(255))
            h[32 + j] = np.uint8((number >> np.uint64(8 * j)) & np.uint64(255))
        for j in range(4):
            h[24 + j] = np.uint8((crc >> np.uint32(8 * j)) & np.uint32(255))
        seal = _crc_one(np.uint64(h.ctypes.data), np.uint64(4092), tables)
        for j in range(4):
            h[4092 + j] = np.uint8((seal >> np.uint32(8 * j)) & np.uint32(255))



def _build() -> dict[str, Any]:
    """Compile (or load from numba's cache) the kernels and their shift tables; raises where
    they cannot run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"no SSE4.2 crc32 on {platform.machine()}")
    tables = np.zeros((2, 4, 256), dtype=np.uint64)
    mask = 0xFFFFFFFF
    for which, length in enumerate((_LANE, 2 * _LANE)):
        # the raw register r after `length` zero bytes is linear in r; through the package,
        # whose value is the register inverted before and after: ~crc32c(zeros, ~r)
        zeros = bytes(length)
        bit = [~crc32c.crc32c(zeros, ~(1 << k) & mask) & mask for k in range(32)]
        for byte in range(4):
            for value in range(256):
                acc = 0
                for k in range(8):
                    if value >> k & 1:
                        acc ^= bit[8 * byte + k]
                tables[which, byte, value] = acc
    return {"crc_many": _crc_many, "fill_headers": _fill_headers, "copy_many": _copy_many,
            "tables": tables}


def _kernel() -> dict[str, Any] | None:
    with _lock:
        if "kernel" not in _state:
            try:
                found = _build()
                probe = np.frombuffer(b"123456789" * 5000, dtype=np.uint8)
                got = np.zeros(1, dtype=np.uint32)
                found["crc_many"](np.array([probe.ctypes.data], np.uint64),
                                  np.array([probe.nbytes], np.uint64), found["tables"], got)
                want = crc32c.crc32c(probe.data)
                if int(got[0]) != want:
                    raise RuntimeError(f"self-check {int(got[0]):#x} != {want:#x}")
                header = np.zeros((1, 4096), np.uint8)  # compiles (or loads) it now, too
                found["fill_headers"](header, header[0].copy(), np.zeros(1, np.int64), 0,
                                      np.array([probe.ctypes.data], np.uint64), probe.nbytes,
                                      found["tables"])
                if int.from_bytes(header[0, 24:28].tobytes(), "little") != want:
                    raise RuntimeError("self-check of the header fill failed")
                copy = np.zeros_like(probe)
                found["copy_many"](np.array([copy.ctypes.data], np.uint64),
                                   np.array([probe.ctypes.data], np.uint64),
                                   np.array([probe.nbytes], np.uint64))
                if not np.array_equal(copy, probe):
                    raise RuntimeError("self-check of the copy failed")
                _state["kernel"] = found
            except Exception as exc:  # any doubt: the crc32c package, one call a buffer
                log.info("L3: compiled record kernels unavailable (%s); using crc32c calls",
                         exc)
                _state["kernel"] = None
        found = _state["kernel"]
        return None if found is None else dict(found)


def available() -> bool:
    """Whether the compiled kernels run here (compiles or loads them on the first call)."""
    return _kernel() is not None


def addresses(bufs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(address, length) of each buffer, as uint64 arrays; every buffer must be contiguous."""
    n = len(bufs)
    addrs = np.empty(n, dtype=np.uint64)
    lens = np.empty(n, dtype=np.uint64)
    for i, b in enumerate(bufs):
        if not b.flags.c_contiguous:
            raise ValueError(f"buffer {i} is not contiguous")
        addrs[i], lens[i] = b.ctypes.data, b.nbytes
    return addrs, lens


def crc_at(addrs: np.ndarray, nbytes: int) -> np.ndarray | None:
    """CRC32C of `nbytes` at each address (uint64, memory the caller holds), in one call
    without the GIL; None where the kernels do not run."""
    found = _kernel()
    if found is None:
        return None
    out = np.empty(len(addrs), dtype=np.uint32)
    found["crc_many"](np.ascontiguousarray(addrs, dtype=np.uint64),
                      np.full(len(addrs), nbytes, dtype=np.uint64), found["tables"], out)
    return out


def crc_batch(bufs: Sequence[np.ndarray]) -> list[int]:
    """CRC32C of each buffer (numpy arrays), in one call without the GIL where it can."""
    found = _kernel()
    if found is None or not all(b.flags.c_contiguous for b in bufs):
        return [int(crc32c.crc32c(np.ascontiguousarray(b).data)) for b in bufs]
    addrs, lens = addresses(bufs)
    out = np.empty(len(bufs), dtype=np.uint32)
    found["crc_many"](addrs, lens, found["tables"], out)
    return out.tolist()


def fill_headers(headers: np.ndarray, template: np.ndarray, indices: np.ndarray,
                 first_record_no: int, payloads: Sequence[np.ndarray]) -> bool:
    """Fill the record headers `headers` ([n, 4096] uint8) from `template`: each payload's
    CRC32C, logical index, record number and seal (docs/ssd-format.md), in one call without
    the GIL. False (nothing done) where the kernels do not run or a payload is strided or of
    another size than the first."""
    found = _kernel()
    if found is None or not len(payloads):
        return False
    # an L2 pool's BlockViews: blocks of one size, contiguous, their addresses at once (no
    # view or check a block: each held the GIL ~3 us beside the step, ~28K blocks/s at 14 GB/s)
    if isinstance(payloads, BlockViews) and (
            addrs := payloads.addresses(np.arange(len(payloads)))) is not None:
        nbytes = payloads.block_bytes
    elif all(p.flags.c_contiguous and p.nbytes == payloads[0].nbytes for p in payloads):
        addrs, nbytes = addresses(payloads)[0], payloads[0].nbytes
    else:
        return False
    found["fill_headers"](headers, template, np.ascontiguousarray(indices, dtype=np.int64),
                          first_record_no, addrs, nbytes, found["tables"])
    return True


def copy_addresses(dsts: np.ndarray, srcs: np.ndarray, nbytes: int) -> bool:
    """Copy `nbytes` from each address srcs[i] to dsts[i] (uint64 arrays of addresses the
    caller owns), in one call without the GIL. False (nothing copied) where the kernels do
    not run."""
    found = _kernel()
    if found is None:
        return False
    lens = np.full(len(dsts), nbytes, dtype=np.uint64)
    found["copy_many"](np.ascontiguousarray(dsts, dtype=np.uint64),
                       np.ascontiguousarray(srcs, dtype=np.uint64), lens)
    return True


def copy_many(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> bool:
    """Copy each srcs[i] into dsts[i] (same sizes), in one call without the GIL. False
    (nothing copied) where the kernels do not run or a buffer is strided, read-only or of
    another size than its pair."""
    found = _kernel()
    if found is None or len(dsts) != len(srcs) or not all(
            d.flags.c_contiguous and d.flags.writeable and s.flags.c_contiguous
            and d.nbytes == s.nbytes for d, s in zip(dsts, srcs)):
        return False
    dst, lens = addresses(dsts)
    src, _ = addresses(srcs)
    found["copy_many"](dst, src, lens)
    return True
