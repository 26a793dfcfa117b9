"""Argument checks of the L3 store's calls: logical indices and block buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpkv.errors import SsdRequestError
from tpkv.ssd.backend import BlockViews


def check_indices(logical_idx: np.ndarray, num_buffers: int) -> np.ndarray:
    """The indices as int64, if a 1-D integer array in 0..2**63-1 of one per buffer."""
    arr = np.asarray(logical_idx)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise SsdRequestError(f"logical_idx must be a 1-D integer array, got dtype "
                              f"{arr.dtype} shape {arr.shape}")
    if len(arr) != num_buffers:
        raise SsdRequestError(f"{len(arr)} logical indices for {num_buffers} buffers")
    if arr.size and (arr.min() < 0 or int(arr.max()) > np.iinfo(np.int64).max):
        raise SsdRequestError(f"logical indices must be in 0..2**63-1, got {arr.min()}.."
                              f"{arr.max()}")
    return arr.astype(np.int64)


def check_buffers(bufs: Sequence[np.ndarray], block_bytes: int, writable: bool) -> None:
    """Each buffer a 1-D contiguous uint8 array of `block_bytes` (writable for a read)."""
    if isinstance(bufs, BlockViews):  # an L2 pool's blocks: writable, of its block size
        if bufs.block_bytes != block_bytes:
            raise SsdRequestError(f"buffers of {bufs.block_bytes} bytes; L3 needs blocks "
                                  f"of {block_bytes} bytes")
        return
    for i, buf in enumerate(bufs):
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1 or (
                buf.nbytes != block_bytes) or not buf.flags.c_contiguous:
            desc = (f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray)
                    else type(buf).__name__)
            raise SsdRequestError(f"buffer {i} is {desc}; L3 needs 1-D contiguous uint8 "
                                  f"arrays of {block_bytes} bytes")
        if writable and not buf.flags.writeable:
            raise SsdRequestError(f"buffer {i} is read-only; reads need writable buffers")
