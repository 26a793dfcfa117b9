"""L3 read ahead: records read into memory before the step that loads them; never stale bytes."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_ssd_store import SMALL, empty_out, geometry, make_stores, random_blocks
from tpkv.config import SsdConfig
from tpkv.errors import ArgumentError, ConfigError
from tpkv.ssd.store import SsdStore

N = 6


def written(tmp_path: Path, **cfg: object) -> tuple[SsdStore, list[np.ndarray]]:
    geo = geometry(SMALL)
    [store] = make_stores(tmp_path, geo, **cfg)
    blocks = random_blocks(np.random.default_rng(1), geo, N)
    store.write_blocks("s", np.arange(N), blocks)
    assert store.commit_manifest("s")
    return store, blocks


def wait_done(store: SsdStore, sid: str = "s") -> None:
    store.ahead.wait_any([sid], 10.0)
    assert store.ahead.done(sid)


def read_all(store: SsdStore) -> tuple[np.ndarray, list[np.ndarray]]:
    out = empty_out(store.geometry, N)
    for buf in out:
        buf.fill(0xAB)
    return store.read_blocks("s", np.arange(N), out), out


def test_blocks_read_ahead_are_served_from_memory_bit_exact(tmp_path: Path) -> None:
    store, blocks = written(tmp_path)
    assert store.ahead.done("s") is None
    assert store.read_ahead("s", np.arange(1, N))
    wait_done(store)
    disk_bytes = store.read_stats().bytes
    hits, out = read_all(store)
    assert hits.all()
    for got, want in zip(out, blocks):
        np.testing.assert_array_equal(got, want)
    assert store.ahead.num_served == N - 1  # block 0 came from the disk
    assert store.step_disk_blocks == 1
    assert store.read_stats().bytes - disk_bytes == store.block_bytes
    store.close()


def test_a_write_after_the_read_ahead_makes_it_stale(tmp_path: Path) -> None:
    store, blocks = written(tmp_path)
    assert store.read_ahead("s", np.arange(N))
    wait_done(store)
    new = random_blocks(np.random.default_rng(2), store.geometry, 1)
    store.write_blocks("s", np.array([3]), new)  # block 3 written again
    assert store.commit_manifest("s")
    assert store.ahead.done("s") is None  # discarded
    hits, out = read_all(store)
    assert hits.all() and store.ahead.num_served == 0
    np.testing.assert_array_equal(out[3], new[0])
    np.testing.assert_array_equal(out[2], blocks[2])
    assert store.ahead.held_bytes == 0
    store.close()


def test_a_change_during_the_read_ahead_is_never_served(tmp_path: Path) -> None:
    """A write that starts after the read ahead began: the generation it was read under is
    older, whatever order the two finish in."""
    store, _ = written(tmp_path)
    gate = threading.Event()
    real = store._read

    def slow(sid: str, idx: np.ndarray, out: list[np.ndarray], ahead: bool) -> np.ndarray:
        gate.wait(10)
        return real(sid, idx, out, ahead)

    store._read = slow  # type: ignore[method-assign]
    assert store.read_ahead("s", np.arange(N))
    store._read = real  # type: ignore[method-assign]
    new = random_blocks(np.random.default_rng(3), store.geometry, N)
    store.write_blocks("s", np.arange(N), new)
    assert store.commit_manifest("s")
    gate.set()
    hits, out = read_all(store)
    assert hits.all() and store.ahead.num_served == 0
    for got, want in zip(out, new):
        np.testing.assert_array_equal(got, want)
    store.ahead.wait_any(["s"], 1.0)
    store.close()
    assert store.ahead.held_bytes == 0


def test_a_corrupt_record_read_ahead_is_read_again_and_misses(tmp_path: Path) -> None:
    store, blocks = written(tmp_path, o_direct=False)
    segment = next(p for p in tmp_path.rglob("*") if p.is_file() and ".seg" in p.name)
    data = bytearray(segment.read_bytes())
    at = 4096 + 2 * store.record_bytes + 100  # inside record 2
    data[at] ^= 0x5A
    segment.write_bytes(bytes(data))
    assert store.read_ahead("s", np.arange(N))
    wait_done(store)
    hits, out = read_all(store)
    assert hits.tolist() == [True, True, False, True, True, True]
    assert not out[2].any()  # a miss is zeroed, never the bytes read
    assert store.ahead.num_served == N - 1
    np.testing.assert_array_equal(out[4], blocks[4])
    store.close()


def test_the_budget_bounds_what_is_held(tmp_path: Path) -> None:
    geo = geometry(SMALL)
    store, _ = written(tmp_path, read_ahead_bytes=3 * geo.block_bytes)
    assert not store.read_ahead("s", np.arange(N))  # does not fit: nothing started
    assert store.ahead.done("s") is None and store.ahead.held_bytes == 0
    assert store.read_ahead("s", np.arange(3))
    assert store.ahead.held_bytes == 3 * geo.block_bytes
    assert not store.ahead.fits(1)
    wait_done(store)
    store.ahead.drop("s")
    assert store.ahead.held_bytes == 0 and store.ahead.fits(3)
    store.close()


def test_dropping_the_session_discards_its_read_ahead(tmp_path: Path) -> None:
    store, _ = written(tmp_path)
    assert store.read_ahead("s", np.arange(N))
    wait_done(store)
    store.drop_session_later("s")
    assert store.ahead.done("s") is None
    hits, _ = read_all(store)
    assert not hits.any() and store.ahead.num_served == 0
    store.close()


def test_bad_input_is_refused(tmp_path: Path) -> None:
    store, _ = written(tmp_path)
    with pytest.raises(ArgumentError, match="-2"):
        store.read_ahead("s", np.array([1, -2]))
    assert store.ahead.held_bytes == 0
    with pytest.raises(ConfigError, match="read_ahead_bytes"):
        SsdConfig(root=str(tmp_path), read_ahead_bytes=-1)
    store.close()


def test_the_read_rate_counts_the_time_reads_run_at_once_once() -> None:
    """Four sessions read at once on four threads, each job 0.2 s: the rate the read aheads
    report is their bytes over about 0.2 s (the disk's rate for them together), not over the
    0.8 s their per-session times add up to."""
    from tpkv.ssd.readahead import ReadAhead

    block = 1 << 20
    ahead = ReadAhead(block, 64 * block, threads=4, rank=0)
    gate = threading.Barrier(4)

    def read(sid: str, idx: np.ndarray, bufs: object) -> np.ndarray:
        gate.wait(5.0)  # all four in flight together
        threading.Event().wait(0.2)
        return np.ones(len(idx), dtype=bool)

    try:
        for i in range(4):
            assert ahead.start(f"s{i}", np.arange(4), read)
        ahead.wait_any([f"s{i}" for i in range(4)], 5.0)
        for i in range(4):
            ahead.wait_any([f"s{i}"], 5.0)
            assert ahead.done(f"s{i}")
        assert ahead.read_bytes == 16 * block
        assert 0.19 <= ahead.read_s < 0.5, ahead.read_s  # per session: 0.8 s
    finally:
        ahead.close()


def _filling(value: int):  # type: ignore[no-untyped-def]
    """A read function that fills every buffer with `value` and reports all hits."""
    def read(sid: str, idx: np.ndarray, bufs: list[np.ndarray]) -> np.ndarray:
        for buf in bufs:
            buf.fill(value)
        return np.ones(len(idx), dtype=bool)
    return read


def test_buffers_given_back_are_reused_page_aligned() -> None:
    """A read ahead given back leaves its buffers (page-aligned, so O_DIRECT needs no staging
    copy) to the next one: their pages are not faulted in again."""
    from tpkv.ssd.backend import is_direct_capable
    from tpkv.ssd.readahead import ReadAhead

    block = 1 << 16
    ahead = ReadAhead(block, 64 * block, threads=1, rank=0)
    try:
        assert ahead.start("a", np.arange(8), _filling(1))
        ahead.wait_any(["a"], 5.0)
        first = [job.base for job in ahead._sessions["a"].jobs]
        assert all(is_direct_capable(b) for job in ahead._sessions["a"].jobs
                   for b in job.buffers)
        ahead.drop("a")
        assert ahead.held_bytes == 0
        assert ahead.start("b", np.arange(8), _filling(2))
        ahead.wait_any(["b"], 5.0)
        assert [job.base for job in ahead._sessions["b"].jobs] == first
        out = [np.zeros(block, np.uint8) for _ in range(8)]
        hits = np.zeros(8, dtype=bool)
        ahead.take("b", np.arange(8), out, hits)
        assert hits.all() and all((o == 2).all() for o in out)
    finally:
        ahead.close()


def test_a_buffer_being_copied_out_is_not_reused_until_the_copy_ends() -> None:
    """drop() while take() copies: the buffers stay the dropped session's until the copy ends,
    so a read ahead started meanwhile never overwrites the bytes being served."""
    from tpkv.ssd.readahead import ReadAhead

    block = 1 << 16
    ahead = ReadAhead(block, 8 * block, threads=1, rank=0)
    copying, go_on = threading.Event(), threading.Event()

    class SlowOut(list):  # type: ignore[type-arg]
        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            copying.set()
            go_on.wait(5.0)
            return super().__getitem__(i)

    try:
        assert ahead.start("a", np.arange(8), _filling(1))
        ahead.wait_any(["a"], 5.0)
        out = SlowOut(np.zeros(block, np.uint8) for _ in range(8))
        hits = np.zeros(8, dtype=bool)
        taker = threading.Thread(target=ahead.take, args=("a", np.arange(8), out, hits))
        taker.start()
        assert copying.wait(5.0)
        ahead.drop("a")
        assert ahead.held_bytes == 8 * block  # still copied out of
        assert not ahead.start("b", np.arange(8), _filling(9))  # no room: not reused
        go_on.set()
        taker.join(5.0)
        assert hits.all() and all((list.__getitem__(out, i) == 1).all() for i in range(8))
        assert ahead.held_bytes == 0
        assert ahead.start("b", np.arange(8), _filling(9))
    finally:
        go_on.set()
        ahead.close()


def test_a_read_ahead_is_extended_to_blocks_it_did_not_start_with(tmp_path: Path) -> None:
    """Blocks that came to L3 after the read ahead began without a write (their records on
    disk since an earlier load) are read by more jobs of the same read ahead, and served from
    memory with the others."""
    store, blocks = written(tmp_path)
    assert store.read_ahead("s", np.arange(0, 3))
    wait_done(store)
    assert store.ahead.covers("s", np.arange(0, 3))
    assert not store.ahead.covers("s", np.arange(N))
    assert store.read_ahead("s", np.arange(N))  # the rest: 3 more blocks, one more job
    wait_done(store)
    assert store.ahead.covers("s", np.arange(N))
    frozen = np.arange(N)
    frozen.flags.writeable = False  # (as a mirror's answer: the covers() answer is kept)
    assert store.ahead.covers("s", frozen) and store.ahead.covers("s", frozen)
    hits, out = read_all(store)
    assert hits.all() and store.ahead.num_served == N and store.step_disk_blocks == 0
    for got, want in zip(out, blocks):
        np.testing.assert_array_equal(got, want)
    store.ahead.changed("s")  # stale: discarded, and the kept answer with it
    assert not store.ahead.covers("s", frozen)
    store.close()


def test_an_extension_the_budget_cannot_hold_starts_nothing(tmp_path: Path) -> None:
    geo = geometry(SMALL)
    store, _ = written(tmp_path, read_ahead_bytes=3 * geo.block_bytes)
    assert store.read_ahead("s", np.arange(0, 3))
    wait_done(store)
    assert store.read_ahead("s", np.arange(N))  # held; the rest does not fit: not read
    assert store.ahead.done("s") and not store.ahead.covers("s", np.arange(N))
    hits, _ = read_all(store)
    assert hits.all() and store.ahead.num_served == 3 and store.step_disk_blocks == 3
    store.close()


def test_blocks_read_ahead_into_an_l2_pools_views_are_copied_by_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into an L2 pool's BlockViews (slots in any order) the read ahead is copied by address in
    one call, bit-exact, and the slots not read stay as they were."""
    from tpkv.ssd import kernels
    from tpkv.ssd.backend import BlockViews

    store, blocks = written(tmp_path)
    assert store.read_ahead("s", np.arange(N))
    wait_done(store)
    pool = np.full((2 * N, store.block_bytes), 0xAB, dtype=np.uint8)
    base = pool.__array_interface__["data"][0]
    slots = np.array([9, 2, 7, 0, 11, 4])
    views = BlockViews(lambda k: pool[k], slots, store.block_bytes, False,
                       lambda s: base + s * store.block_bytes)
    np.testing.assert_array_equal(views.addresses(np.array([1, 3])),
                                  [base + 2 * store.block_bytes, base])
    if kernels.available():  # the views are never taken one by one
        monkeypatch.setattr(kernels, "copy_many", lambda *a: pytest.fail("copied by view"))
    hits = store.read_blocks("s", np.arange(N), views)
    assert hits.all() and store.ahead.num_served == N and store.step_disk_blocks == 0
    for k, want in zip(slots, blocks):
        np.testing.assert_array_equal(pool[k], want.reshape(-1).view(np.uint8))
    rest = np.setdiff1d(np.arange(2 * N), slots)
    assert (pool[rest] == 0xAB).all()
    store.close()


def test_reads_in_chunks_across_many_jobs_are_served_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session read ahead in many jobs, then read in chunks that straddle the jobs and come
    in no order (as a step's read jobs do): each chunk is served from the jobs that hold its
    blocks, bit exact, and blocks outside every job come from the disk."""
    geo = geometry(SMALL)
    [store] = make_stores(tmp_path, geo)
    n = 23
    blocks = random_blocks(np.random.default_rng(7), geo, n)
    store.write_blocks("s", np.arange(n), blocks)
    assert store.commit_manifest("s")
    monkeypatch.setattr(store.ahead, "_job_rows", 3)  # jobs of 3 blocks: 7 of them
    ahead = np.setdiff1d(np.arange(n), [0, 11, 22])  # three blocks only on disk
    assert store.ahead.start("s", ahead, lambda s, idx, out: store._read(s, idx, out, False))
    wait_done(store)
    assert len(store.ahead._sessions["s"].jobs) == -(-len(ahead) // 3)
    order = np.random.default_rng(3).permutation(n)
    served = 0
    for chunk in np.array_split(order, 5):
        out = empty_out(geo, len(chunk))
        for buf in out:
            buf.fill(0xAB)
        hits = store.read_blocks("s", chunk, out)
        assert hits.all()
        for i, got in zip(chunk.tolist(), out):
            np.testing.assert_array_equal(got, blocks[i])
        served += int(np.isin(chunk, ahead).sum())
        assert store.ahead.num_served == served
    assert store.step_disk_blocks == 3
    store.close()
