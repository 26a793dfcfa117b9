"""A step's small results (sampled tokens, attention mass) read back without a copy engine.

A decode step's `.tolist()` is a device-to-host copy, and copies are served by the GPU's copy
engines in the order they were queued: when the step's demotions (hundreds of MB, copied beside
its forward) are ahead of it, the few bytes of tokens wait until the demotions are done, and the
step takes as long as its copies instead of its forward. Here the bytes are written into
pinned host memory by SM threads instead, a kernel that no copy queue holds up; the host waits
on an event after it and reads the buffer. On an H200, a 6.2 ms stand-in forward with 600 MB
of demotions beside it: 12.7 ms by .tolist() (the copies' time), 6.2 ms by this
(bench/readback_probe.py, bench/results/readback_probe.json).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from tpkv.workers import copy_kernel

_SOURCE = r"""
extern "C" __global__ void tpkv_to_host(const unsigned int* __restrict__ src,
                                        unsigned int* __restrict__ dst, const long long words) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""
THREADS = 256
MAX_CTAS = 32
_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
              torch.float64: np.float64}


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import cupy

    return cupy.RawKernel(_SOURCE, "tpkv_to_host")


class HostReadback:
    """Reads small device tensors into host memory: `mapped` (SM writes) when the GPU and CuPy
    allow it, `.cpu()` otherwise (`pinned`, a copy-engine copy into pinned memory, is there for
    bench/readback_probe.py to compare).

    One pinned buffer (cudaHostAlloc: with unified addressing, kernels write to it by its host
    address), reused: each result is copied out of it before the next read.
    """

    def __init__(self, device: torch.device | str, capacity: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.can_map = self.on_gpu and copy_kernel.available()
        self._buf: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self.on_gpu else None
        self.num_mapped = 0  # reads done by the kernel (tests check the path was taken)
        if self.on_gpu:
            self._grow(capacity)

    def tolist(self, t: torch.Tensor) -> list[Any]:
        """t.tolist(), by SM writes into pinned memory where possible."""
        return self.mapped(t).tolist() if self._maps(t) else t.tolist()

    def numpy(self, t: torch.Tensor) -> np.ndarray:
        """t.cpu().numpy(), by SM writes into pinned memory where possible."""
        return self.mapped(t) if self._maps(t) else t.cpu().numpy()

    def _maps(self, t: torch.Tensor) -> bool:
        return (self.can_map and t.device.type == "cuda" and t.dtype in _NP_DTYPES
                and t.numel() * t.element_size() % 4 == 0)

    def mapped(self, t: torch.Tensor) -> np.ndarray:
        """Copy t by a kernel on the current stream into the pinned buffer; wait for it."""
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        buf = self._room(nbytes)
        stream = torch.cuda.current_stream(self.device)
        words = nbytes // 4
        with copy_kernel.cupy_stream(stream):
            grid = max(1, min(MAX_CTAS, -(-words // THREADS)))
            _kernel()((grid,), (THREADS,),
                      (np.uint64(t.data_ptr()), np.uint64(buf.data_ptr()), np.int64(words)))
        self._sync(stream)
        self.num_mapped += 1
        return buf[:nbytes].numpy().view(_NP_DTYPES[t.dtype]).reshape(t.shape).copy()

    def pinned(self, t: torch.Tensor) -> np.ndarray:
        """t through a non-blocking copy into the pinned buffer (a copy engine's queue)."""
        nbytes = t.numel() * t.element_size()
        view = self._room(nbytes)[:nbytes].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=True)
        self._sync(torch.cuda.current_stream(self.device))
        return view.numpy().copy()

    def _room(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._grow(nbytes)
        assert self._buf is not None
        return self._buf

    def _grow(self, nbytes: int) -> None:
        self._buf = torch.empty(max(nbytes, 1 << 12), dtype=torch.uint8, pin_memory=True)

    def _sync(self, stream: torch.cuda.Stream) -> None:
        assert self._event is not None
        self._event.record(stream)
        self._event.synchronize()
