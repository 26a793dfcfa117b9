"""Open files, threads and RSS of a long-lived L3 store stay flat through work and failures."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.faults.crashcheck import block_bytes_of, open_stores
from tpkv.errors import SsdIoError
from tpkv.ssd import backend as ssd_backend

CYCLES = 300


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _failing(code: int) -> Callable[..., int]:
    def fail(*args: object) -> int:
        raise OSError(code, os.strerror(code))
    return fail


def test_a_long_run_with_failures_leaks_no_files_threads_or_memory(
        mem_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = open_stores(mem_path / "l3")
    rng = np.random.default_rng(5)
    counts = {"ok": 0, "enospc": 0, "eio_misses": 0}

    def cycle(k: int) -> None:
        sid = f"s{k % 16}"
        indices = np.sort(rng.choice(8, size=3, replace=False))
        if k % 10 == 3:  # the disk fills up in the middle of a spill
            monkeypatch.setattr(ssd_backend.os, "pwritev", _failing(errno.ENOSPC))
        futures = [s.submit_write(sid, indices, [block_bytes_of(sid, s.rank, int(i), k)
                                                 for i in indices]) for s in stores]
        failed = [f.exception() for f in futures]  # waits for every rank
        monkeypatch.undo()
        if any(failed):
            assert all(isinstance(e, SsdIoError) and e.errno == errno.ENOSPC for e in failed)
            assert k % 10 == 3
            counts["enospc"] += 1
            for store in stores:  # as the node does: the session is recomputed later
                store.drop_session(sid)
        else:
            assert stores[k % 2].commit_manifest(sid)
            counts["ok"] += 1
        if k % 7 == 5:  # the disk fails reads: misses, never an exception
            monkeypatch.setattr(ssd_backend.os, "preadv", _failing(errno.EIO))
        out = [np.empty(stores[0].block_bytes, np.uint8) for _ in indices]
        hits = stores[0].submit_read(sid, indices, out).result()
        monkeypatch.undo()
        if k % 7 == 5:
            assert not hits.any()
            counts["eio_misses"] += 1
        if k % 5 == 4:
            for store in stores:
                store.drop_session(sid)

    for k in range(20):  # warm-up: the I/O threads and per-thread buffers come into being
        cycle(k)
    # Threads and files of earlier tests in this process may still be ending: count only what
    # this run adds (a leak grows them; others' closing can only shrink them).
    fds, threads, rss = open_fds(), set(threading.enumerate()), rss_bytes()
    for k in range(20, CYCLES):
        cycle(k)
        assert open_fds() <= fds, f"cycle {k}: {open_fds()} open files, {fds} before"
    assert set(threading.enumerate()) <= threads, "threads started and not ended"
    grown = rss_bytes() - rss
    assert grown < 16 << 20, f"RSS grew {grown} bytes over {CYCLES - 20} cycles"
    assert counts["enospc"] >= 25 and counts["eio_misses"] >= 35 and counts["ok"] >= 200
    for store in stores:
        store.close()
    assert open_fds() <= fds
