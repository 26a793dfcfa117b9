"""CRC32C of many buffers at once, spread over a few threads: the crc32c module releases the GIL
over a large buffer, and one core checksums 8.8 GB/s on the H200's host (11.4 on the CPU VM), so
a step's blocks (hundreds of MiB in the vLLM connector's saves and loads) take tens of
milliseconds on one core; 8 threads took 256 MiB in 6.8 ms there against 30.5. (format.crc_many
is the one-thread batch: no faster per core there, 33.4 ms.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tpkv.ssd.format import crc_of

MAX_THREADS = 8  # the caller's thread and up to 7 of the pool
MIN_SHARE_BYTES = 4 << 20  # less a thread: not worth handing over (tens of us a task)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Threads a large batch is spread over: the cores this process may run on, at most
    MAX_THREADS."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="tpkv-crc")
        return _pool


def crc_spread(bufs: Sequence[np.ndarray]) -> list[int]:
    """CRC32C of each buffer (contiguous arrays), in order: on the caller's thread alone for a
    small batch or a single core, else in contiguous shares of at least MIN_SHARE_BYTES, one
    on the caller's thread and the others on a pool of threads()-1 threads."""
    total = sum(b.nbytes for b in bufs)
    n = min(threads(), len(bufs), total // MIN_SHARE_BYTES)
    if n <= 1:
        return [crc_of(b) for b in bufs]
    bounds = [len(bufs) * i // n for i in range(n + 1)]

    def share(i: int) -> list[int]:
        return [crc_of(b) for b in bufs[bounds[i]:bounds[i + 1]]]

    pool = _executor(threads() - 1)
    futures: list[Future[list[int]]] = [pool.submit(share, i) for i in range(1, n)]
    out = share(0)
    for f in futures:
        out += f.result()
    return out
