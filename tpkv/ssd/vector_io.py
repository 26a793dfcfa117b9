"""Gather writes and scatter reads of host memory given by address (iovec arrays).

A spill or read of hundreds of L2 blocks through os.pwritev/os.preadv builds a view and a
memoryview a block under the GIL, beside the step's host work. Here the iovecs are one numpy
array built at once from the blocks' addresses, and the system call goes through ctypes, which
lets go of the GIL for it. Used for an L2 pool's blocks (BlockViews) on the POSIX backend.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

import numpy as np

IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])  # struct iovec on 64-bit Linux
IOV_MAX = int(os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024

# (fd, address of the first iovec, count, offset) -> bytes moved, or -1 with errno set
Syscall = Callable[[int, int, int, int], int]


def _libc_call(name: str) -> Syscall | None:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_ssize_t
    return fn  # type: ignore[no-any-return]


# None where the C library has no such call: the callers keep os.pwritev/os.preadv
PWRITEV: Syscall | None = _libc_call("pwritev") if ctypes.sizeof(ctypes.c_void_p) == 8 else None
PREADV: Syscall | None = _libc_call("preadv") if ctypes.sizeof(ctypes.c_void_p) == 8 else None


def iovecs(columns: list[tuple[np.ndarray | int, int]], rows: int) -> np.ndarray:
    """The iovecs of `rows` records, each the columns' pieces in order: (addresses, or one
    address for every record, and the piece's length); flattened record by record."""
    iov = np.empty((rows, len(columns)), dtype=IOVEC)
    for j, (base, length) in enumerate(columns):
        iov["base"][:, j] = base
        iov["len"][:, j] = length
    return iov.reshape(-1)


def transfer(call: Syscall, fd: int, iov: np.ndarray, offset_bytes: int, *,
             write: bool) -> int:
    """Move the bytes of `iov` (IOVEC) at `offset_bytes`, at most IOV_MAX iovecs a call, on
    after a short one; returns the bytes moved. A write that moves nothing raises OSError
    (EIO); a read stops there (end of file). Errors raise OSError with the call's errno."""
    iov = np.array(iov, dtype=IOVEC, copy=True)  # advanced in place after a short call
    lens = iov["len"]
    start, total = 0, 0
    while start < len(iov):
        count = min(IOV_MAX, len(iov) - start)
        moved = int(call(fd, iov.ctypes.data + start * IOVEC.itemsize, count, offset_bytes))
        if moved < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, f"{'pwritev' if write else 'preadv'} of {count} iovecs at "
                                f"byte {offset_bytes}: {os.strerror(code)}")
        if moved == 0:
            if write:
                raise OSError(errno.EIO, f"pwritev wrote 0 bytes at {offset_bytes}")
            break
        offset_bytes += moved
        total += moved
        ends = np.cumsum(lens[start:start + count], dtype=np.uint64)
        done = int(np.searchsorted(ends, moved, side="right"))  # iovecs moved in full
        start += done
        if done < count:  # part of iovec `start` moved: the rest of it goes next
            part = moved - (int(ends[done - 1]) if done else 0)
            iov["base"][start] += np.uint64(part)
            lens[start] -= np.uint64(part)
    return total
