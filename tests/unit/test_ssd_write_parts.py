"""L3 writes in parts: one spill's records written at once by the writer and helper threads."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_ssd_store import ALIGNED, PAGE, empty_out, geometry, make_stores, random_blocks
from tpkv.errors import SsdIoError
from tpkv.ssd import backend as ssd_backend
from tpkv.ssd.format import ALIGN_BYTES

# 2 records a piece, so a part (2 pieces at least) is 4 records
PIECE = 2 * (32 * 1024 + PAGE)


def _spy(monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None
         ) -> list[tuple[int, str, int]]:
    """Record (offset, thread name, records) of each pwritev; raise EIO for the one that
    starts at `fail_at`."""
    calls: list[tuple[int, str, int]] = []
    lock = threading.Lock()
    real = os.pwritev

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        with lock:
            calls.append((offset, threading.current_thread().name, len(bufs) // 2))
        if offset == fail_at:
            raise OSError(errno.EIO, "injected")
        return real(fd, bufs, offset)

    monkeypatch.setattr(ssd_backend.os, "pwritev", pwritev)
    return calls


def test_a_spill_of_many_pieces_is_written_in_parts_by_several_threads_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    geo = geometry(ALIGNED)
    (store,) = make_stores(tmp_path, geo, o_direct=False, write_piece_bytes=PIECE,
                           write_threads=3)
    record = ALIGN_BYTES + geo.block_bytes
    rng = np.random.default_rng(5)
    first, second = (random_blocks(rng, geo, n, aligned=True) for n in (25, 17))
    assert store.submit_write("s", np.arange(25), first).result(timeout=30) > 0
    # 25 records: 4 parts (the writer and 3 helpers) of 6-7 records, in pieces of 2
    body = [c for c in calls if c[0] > 0]
    covered = sorted(k for o, _, n in body for k in range((o - ALIGN_BYTES) // record,
                                                          (o - ALIGN_BYTES) // record + n))
    assert covered == list(range(25))  # every record once, contiguous from the header
    threads = {name for _, name, _ in body}
    assert len(threads) == 4
    assert sum(name.startswith("tpkv-l3-wp") for name in threads) == 3
    assert max(n for _, _, n in body) <= 2  # still in pieces (the reads-first pause)
    calls.clear()
    # an append in parts: its records are numbered on from the segment's
    assert store.write_blocks("s", np.arange(25, 42), second) > 0
    assert len({name for _, name, _ in calls}) == 4 and min(o for o, _, _ in calls) == (
        ALIGN_BYTES + 25 * record)
    assert store.commit_manifest("s")
    store.close()
    (store,) = make_stores(tmp_path, geo)  # a restart reads every record back, checked
    out = empty_out(geo, 42)
    assert store.read_blocks("s", np.arange(42), out).all()
    for got, want in zip(out, first + second):
        np.testing.assert_array_equal(got, want)
    store.close()


def test_a_part_that_fails_fails_the_write_after_every_part_ended_and_keeps_the_old_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    geo = geometry(ALIGNED)
    record = ALIGN_BYTES + geo.block_bytes
    (store,) = make_stores(tmp_path, geo, o_direct=False, write_piece_bytes=PIECE,
                           write_threads=3)
    rng = np.random.default_rng(6)
    old, new = random_blocks(rng, geo, 8, aligned=True), random_blocks(rng, geo, 24, aligned=True)
    assert store.write_blocks("s", np.arange(8), old) > 0 and store.commit_manifest("s")
    # the append's last part (records 18..23 of it) fails on its second piece
    (seg,) = tmp_path.rglob("*.r0.seg")
    size = seg.stat().st_size
    calls = _spy(monkeypatch, fail_at=ALIGN_BYTES + (8 + 20) * record)
    with pytest.raises(SsdIoError, match="appending 24 blocks"):
        store.write_blocks("s", np.arange(8, 32), new)
    ended = len(calls)
    threading.Event().wait(0.2)
    assert len(calls) == ended  # no part wrote after the error reached the caller
    assert len({name for _, name, _ in calls}) == 4
    assert seg.stat().st_size == size  # the failed tail cut off again
    monkeypatch.undo()
    out = empty_out(geo, 32)
    hits = store.read_blocks("s", np.arange(32), out)
    assert hits[:8].all() and not hits[8:].any()  # the committed records, and no new one
    for got, want in zip(out[:8], old):
        np.testing.assert_array_equal(got, want)
    # a fresh segment whose part fails leaves no file behind and no session
    calls = _spy(monkeypatch, fail_at=ALIGN_BYTES + 12 * record)
    with pytest.raises(SsdIoError, match="new segment of 24 blocks"):
        store.write_blocks("t", np.arange(24), new)
    assert "t" not in store.list_sessions()
    assert not list(tmp_path.rglob("*.tmp"))
    store.close()
