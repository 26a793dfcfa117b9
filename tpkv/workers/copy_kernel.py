"""Zero-copy CuPy kernel: SM threads copy whole blocks between device and mapped pinned memory."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import torch

_SOURCE = r"""
extern "C" __global__ void tpkv_copy_blocks(const unsigned long long* __restrict__ src_ptrs,
                                            const unsigned long long* __restrict__ dst_ptrs,
                                            const long long words_per_block,
                                            const int ctas_per_block,
                                            const long long num_items) {
    // Work item w = (block w / ctas_per_block, part w % ctas_per_block); a grid smaller than
    // the number of items strides over them, so a copy can be held to a few SMs.
    const long long per_cta = (words_per_block + ctas_per_block - 1) / ctas_per_block;
    const long long step = blockDim.x;
    for (long long w = blockIdx.x; w < num_items; w += gridDim.x) {
        const long long blk = w / ctas_per_block;
        const long long part = w % ctas_per_block;
        const int4* __restrict__ src = reinterpret_cast<const int4*>(src_ptrs[blk]);
        int4* __restrict__ dst = reinterpret_cast<int4*>(dst_ptrs[blk]);
        const long long start = part * per_cta;
        const long long stop = min(start + per_cta, words_per_block);
        long long i = start + threadIdx.x;
        // Four independent 16-byte loads in flight per thread before the stores.
        for (; i + 3 * step < stop; i += 4 * step) {
            int4 a = src[i]; int4 b = src[i + step]; int4 c = src[i + 2 * step];
            int4 d = src[i + 3 * step];
            dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
        }
        for (; i < stop; i += step) dst[i] = src[i];
    }
}
"""

THREADS = 512
WORDS_PER_CTA = 8192  # 128 KiB of a block per CTA


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import cupy

    return cupy.RawKernel(_SOURCE, "tpkv_copy_blocks")


def cupy_stream(stream: torch.cuda.Stream) -> Any:
    """The torch stream as a CuPy stream (`with` it: CuPy launches go on that stream)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.cuda_stream)


def launch(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, block_bytes: int,
           stream: torch.cuda.Stream, threads: int = THREADS,
           words_per_cta: int = WORDS_PER_CTA, max_ctas: int | None = None) -> None:
    """Copy block i from src_ptrs[i] to dst_ptrs[i] on `stream`. `max_ctas` caps the grid (the
    CTAs stride over the work), leaving the other SMs to compute or to a copy the other way.

    Host pointers must be of memory registered with cudaHostRegister (usable from the device on
    this platform); every pointer and `block_bytes` must be 16-byte aligned.
    """
    import cupy

    n = len(src_ptrs)
    if n == 0:
        return
    if block_bytes % 16:
        raise ValueError(f"kernel copy needs block_bytes % 16 == 0, got {block_bytes}")
    words = block_bytes // 16
    ctas_per_block = max(1, -(-words // words_per_cta))
    with cupy_stream(stream):
        ptrs = cupy.asarray(np.stack([np.asarray(src_ptrs, dtype=np.uint64),
                                      np.asarray(dst_ptrs, dtype=np.uint64)]))
        items = n * ctas_per_block
        grid = items if max_ctas is None else max(1, min(items, max_ctas))
        _kernel()((grid,), (threads,),
                  (ptrs[0], ptrs[1], np.int64(words), np.int32(ctas_per_block), np.int64(items)))
