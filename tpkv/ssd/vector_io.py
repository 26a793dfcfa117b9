"""Records moved between a file and host memory given by address, in one call without the GIL.

A spill or read of hundreds of L2 blocks through os.pwritev/os.preadv builds a view and a
memoryview a block under the GIL, beside the step's host work; a ctypes call per system call
(and a numpy step per iovec array) gave the GIL back and took it again several times a chunk,
each take waiting for the busy step's thread (docs/decisions.md). Here one compiled function
builds a chunk's iovecs from the addresses, loops over the preadv/pwritev calls (at most
IOV_MAX iovecs each, on after a short one or EINTR) and reads errno, all with the GIL let go.

A record is its header row (ALIGN_BYTES, the rows back to back), its payload (at an address)
and, where the payload is padded, the pad (one buffer for every record: zeros to write, a sink
to read into): the same iovecs, and so the same bytes, as the write_at/read_at buffers.
`available()` is False where it cannot compile or run (not Linux, no numba); callers then keep
write_at/read_at.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import tempfile
import threading
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from tpkv.numba_cache import ensure_cache_dir

log = logging.getLogger(__name__)

IOV_MAX = int(os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_lock = threading.Lock()
_state: dict[str, Any] = {}

ensure_cache_dir(__file__)  # before any kernel is defined: a read-only install still caches
_jit = njit(cache=True, nogil=True, boundscheck=False)


def _vector_call(name: str) -> Any:
    """An intrinsic calling the C library's `name` (preadv or pwritev): (fd, address of the
    first iovec, count, offset) -> bytes moved, or -1 with errno set."""
    def typer(typingctx: Any, fd: Any, iov: Any, count: Any, offset: Any) -> tuple[Any, Any]:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i32, i64 = ir.IntType(32), ir.IntType(64)
            fnty = ir.FunctionType(i64, [i32, ir.IntType(8).as_pointer(), i32, i64])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            fd_, iov_, count_, offset_ = args
            return builder.call(fn, [builder.trunc(fd_, i32),
                                     builder.inttoptr(iov_, ir.IntType(8).as_pointer()),
                                     builder.trunc(count_, i32), offset_])
        return types.int64(types.int64, types.uint64, types.int64, types.int64), codegen
    return intrinsic(typer)


_pwritev: Any = _vector_call("pwritev")
_preadv: Any = _vector_call("preadv")


def _errno_typer(typingctx: Any) -> tuple[Any, Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(i32.as_pointer(), []),
                                            "__errno_location")
        return builder.sext(builder.load(builder.call(fn, [])), ir.IntType(64))
    return types.int64(), codegen


_errno: Any = intrinsic(_errno_typer)


@_jit
def advance(iov: np.ndarray, start: int, moved: int) -> int:
    """After a call moved `moved` bytes of iov[start:] ([n, 2] uint64: base, length): the
    first iovec not moved in full, with its base and length past the part that was."""
    left = np.uint64(moved)
    while left > np.uint64(0) and start < iov.shape[0]:
        length = iov[start, 1]
        if left >= length:
            left -= length
            start += 1
        else:
            iov[start, 0] += left
            iov[start, 1] -= left
            left = np.uint64(0)
    return start


@_jit
def _move(fd: int, header0: np.uint64, header_bytes: np.uint64, payloads: np.ndarray,
          payload_bytes: np.uint64, pad: np.uint64, pad_bytes: np.uint64, offset: int,
          write: bool, iov_max: int) -> int:
    """Move the records (see the module) at byte `offset`; the bytes moved (short at the end
    of a file being read), -EIO for a write that moves nothing, -errno on an error."""
    cols = 3 if pad_bytes > 0 else 2
    n = payloads.shape[0] * cols
    iov = np.empty((n, 2), dtype=np.uint64)
    for k in range(payloads.shape[0]):
        r = k * cols
        iov[r, 0] = header0 + np.uint64(k) * header_bytes
        iov[r, 1] = header_bytes
        iov[r + 1, 0] = payloads[k]
        iov[r + 1, 1] = payload_bytes
        if cols == 3:
            iov[r + 2, 0] = pad
            iov[r + 2, 1] = pad_bytes
    base = np.uint64(iov.ctypes.data)
    start, total = 0, 0
    while start < n:
        count = min(iov_max, n - start)
        at = base + np.uint64(16 * start)
        moved = _pwritev(fd, at, count, offset) if write else _preadv(fd, at, count, offset)
        if moved < 0:
            code = _errno()
            if code == errno.EINTR:
                continue
            return -code
        if moved == 0:
            if write:
                return -errno.EIO
            break
        offset += moved
        total += moved
        start = advance(iov, start, moved)
    return total


def _kernel() -> Any:
    with _lock:
        if "kernel" not in _state:
            try:
                if not sys.platform.startswith("linux"):
                    raise RuntimeError(f"no __errno_location on {sys.platform}")
                _state["kernel"] = _self_check(_move)
            except Exception as exc:  # any doubt: os.pwritev/os.preadv, a view a block
                log.info("L3: compiled vector I/O unavailable (%s); using os.preadv", exc)
                _state["kernel"] = None
        return _state["kernel"]


def _self_check(kernel: Any) -> Any:
    """Compile (or load from numba's cache) the kernel; write and read two records through a
    temporary file, bit-exact, or raise."""
    rng = np.random.default_rng(7)
    headers = rng.integers(0, 256, (2, 8), dtype=np.uint8)
    payloads = rng.integers(0, 256, (2, 24), dtype=np.uint8)
    pad = np.zeros(8, np.uint8)
    addrs = np.array([payloads[0].ctypes.data, payloads[1].ctypes.data], np.uint64)
    with tempfile.TemporaryFile() as f:
        got = kernel(f.fileno(), np.uint64(headers.ctypes.data), np.uint64(8), addrs,
                     np.uint64(24), np.uint64(pad.ctypes.data), np.uint64(8), 0, True, 1)
        want = b"".join(headers[k].tobytes() + payloads[k].tobytes() + bytes(8)
                        for k in range(2))
        if got != len(want) or os.pread(f.fileno(), 128, 0) != want:
            raise RuntimeError(f"self-check of the write failed ({got} bytes)")
        back_h, back_p, sink = np.zeros_like(headers), np.zeros_like(payloads), np.ones(8,
                                                                                        np.uint8)
        back = np.array([back_p[0].ctypes.data, back_p[1].ctypes.data], np.uint64)
        got = kernel(f.fileno(), np.uint64(back_h.ctypes.data), np.uint64(8), back,
                     np.uint64(24), np.uint64(sink.ctypes.data), np.uint64(8), 0, False, 2)
        if got != len(want) or not (np.array_equal(back_h, headers)
                                    and np.array_equal(back_p, payloads)):
            raise RuntimeError(f"self-check of the read failed ({got} bytes)")
    return kernel


def available() -> bool:
    """Whether the compiled function runs here (compiles or loads it on the first call)."""
    return _kernel() is not None


def move_records(fd: int, headers: np.ndarray, payloads: np.ndarray, payload_bytes: int,
                 pad: np.ndarray, offset_bytes: int, *, write: bool,
                 iov_max: int = IOV_MAX) -> int:
    """Write (or read) len(payloads) records back to back at `offset_bytes`: headers[k] (a
    C-contiguous [n, h] uint8 array), `payload_bytes` at the address payloads[k] (uint64),
    then `pad` (zeros to write, a sink to read into) where it is not empty. Returns the bytes
    moved: all of them for a write, fewer at the end of a file for a read. Errors raise
    OSError with the call's errno; nothing is done where available() is False (RuntimeError).
    Every address must stay valid until it returns."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("compiled vector I/O is unavailable here (vector_io.available())")
    if not headers.flags.c_contiguous or headers.ndim != 2 or len(headers) != len(payloads):
        raise ValueError(f"headers {headers.shape} must be C-contiguous rows, one for each of "
                         f"{len(payloads)} payloads")
    if iov_max < 1:
        raise ValueError(f"iov_max {iov_max} must be at least 1")
    got = int(kernel(fd, np.uint64(headers.ctypes.data), np.uint64(headers.shape[1]),
                     np.ascontiguousarray(payloads, dtype=np.uint64), np.uint64(payload_bytes),
                     np.uint64(pad.ctypes.data), np.uint64(pad.nbytes), int(offset_bytes),
                     bool(write), int(iov_max)))
    if got < 0:
        call = "pwritev" if write else "preadv"
        raise OSError(-got, f"{call} of {len(payloads)} records at byte {offset_bytes}: "
                            f"{os.strerror(-got)}")
    return got
