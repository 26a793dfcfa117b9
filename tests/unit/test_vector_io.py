"""vector_io: iovecs by address, their system calls without the GIL, short transfers."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from tpkv.config import HostConfig, KvGeometry, SsdConfig
from tpkv.ssd import vector_io
from tpkv.ssd.backend import PosixFile
from tpkv.ssd.store import SsdStore
from tpkv.ssd.vector_io import IOVEC, iovecs, transfer
from tpkv.workers.pools import HostPool


def _pieces(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8)
            for _ in range(count)]


def _iov(bufs: list[np.ndarray]) -> np.ndarray:
    iov = np.empty(len(bufs), dtype=IOVEC)
    iov["base"] = [b.ctypes.data for b in bufs]
    iov["len"] = [b.nbytes for b in bufs]
    return iov


def _capped(call: vector_io.Syscall, cap: int, seen: list[int]) -> vector_io.Syscall:
    """The real call on at most `cap` bytes of its iovecs (a short transfer each time)."""
    def short(fd: int, at: int, count: int, offset: int) -> int:
        iov = np.frombuffer(ctypes.string_at(at, count * IOVEC.itemsize), dtype=IOVEC).copy()
        ends = np.cumsum(iov["len"])
        keep = min(len(iov), int(np.searchsorted(ends, cap, side="left")) + 1)
        iov = iov[:keep]
        iov["len"][-1] -= max(0, int(ends[keep - 1]) - cap)
        seen.append(int(iov["len"].sum()))
        return call(fd, iov.ctypes.data, len(iov), offset)
    return short


@pytest.mark.skipif(vector_io.PWRITEV is None, reason="no pwritev in the C library")
@pytest.mark.parametrize("cap", [1, 777, 4096, 1 << 30])
def test_short_transfers_go_on_where_they_stopped_bit_exact(tmp_path: Path, cap: int) -> None:
    rng = np.random.default_rng(cap)
    bufs = _pieces(rng, 12 if cap == 1 else 300)
    want = np.concatenate(bufs)
    assert vector_io.PWRITEV is not None and vector_io.PREADV is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        seen: list[int] = []
        transfer(_capped(vector_io.PWRITEV, min(cap, 4096 * 64), seen), fd, _iov(bufs), 100,
                 write=True)
        assert sum(seen) == want.nbytes and (cap >= want.nbytes or len(seen) > 1)
        assert os.pread(fd, want.nbytes + 1, 100) == want.tobytes()
        back = [np.zeros_like(b) for b in bufs]
        got = transfer(_capped(vector_io.PREADV, cap, []), fd, _iov(back), 100, write=False)
        assert got == want.nbytes
        assert np.array_equal(np.concatenate(back), want)
        # past the end of the file: the bytes there, then it stops
        tail = [np.zeros(want.nbytes, np.uint8)]
        assert transfer(vector_io.PREADV, fd, _iov(tail), 100 + want.nbytes - 10,
                        write=False) == 10
        assert np.array_equal(tail[0][:10], want[-10:])
    finally:
        os.close(fd)


def test_errors_raise_with_their_errno_and_a_write_of_nothing_is_eio() -> None:
    buf = np.ones(8, np.uint8)
    calls: list[int] = []

    def failing(code: int) -> vector_io.Syscall:
        def call(fd: int, at: int, count: int, offset: int) -> int:
            calls.append(code)
            if code == errno.EINTR and calls.count(code) > 1:
                return 8  # interrupted once, then done
            ctypes.set_errno(code)
            return -1
        return call

    with pytest.raises(OSError, match="pwritev of 1 iovecs at byte 4096") as info:
        transfer(failing(errno.ENOSPC), 3, _iov([buf]), 4096, write=True)
    assert info.value.errno == errno.ENOSPC
    assert transfer(failing(errno.EINTR), 3, _iov([buf]), 0, write=True) == 8
    with pytest.raises(OSError, match="wrote 0 bytes") as info:
        transfer(lambda *a: 0, 3, _iov([buf]), 0, write=True)
    assert info.value.errno == errno.EIO
    assert transfer(lambda *a: 0, 3, _iov([buf]), 0, write=False) == 0  # end of file


def test_iovecs_are_each_records_pieces_in_order() -> None:
    iov = iovecs([(np.array([10, 20], np.uint64), 4), (7, 2)], 2)
    assert iov["base"].tolist() == [10, 7, 20, 7]
    assert iov["len"].tolist() == [4, 2, 4, 2]


# blocks of 2,560 bytes: each record's payload is padded to 4,096 (a third iovec)
PADDED = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=40, dtype="float16", block_tokens=8)


@pytest.mark.skipif(not PosixFile.vector_io, reason="no pwritev/preadv in the C library")
@pytest.mark.parametrize("geo", [PADDED, KvGeometry(num_layers=2, num_kv_heads=1, head_dim=64,
                                                    dtype="float16", block_tokens=8)])
def test_an_l2_pools_blocks_go_to_disk_and_back_by_address_bit_exact(
        tmp_path: Path, geo: KvGeometry, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = HostPool(geo, 600, HostConfig(budget_bytes=600 * geo.block_bytes + (1 << 20)))
    used = {"write_iov": 0, "read_iov": 0}
    for name in used:
        real = getattr(PosixFile, name)

        def counted(self: PosixFile, iov: np.ndarray, offset: int, _name: str = name,
                    _real: object = real) -> object:
            used[_name] += 1
            return _real(self, iov, offset)  # type: ignore[operator]
        monkeypatch.setattr(PosixFile, name, counted)
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix", o_direct=False), geo,
                     "m", 0)
    try:
        rng = np.random.default_rng(geo.block_bytes)
        for s in range(600):
            pool.block_bytes_view(s)[:] = rng.integers(0, 256, geo.block_bytes)
        src = rng.permutation(600)[:500]
        want = [pool.block_bytes_view(int(s)).copy() for s in src]
        assert store.write_blocks("s", np.arange(500), pool.block_views(src))
        assert store.commit_manifest("s")
        assert used["write_iov"] >= 2  # more records than a call's iovecs: in chunks
        dst = rng.permutation(600)[:500]
        for s in dst:
            pool.block_bytes_view(int(s))[:] = 0
        wanted = rng.permutation(500)
        hits = store.read_blocks("s", wanted, pool.block_views(dst))
        assert hits.all() and used["read_iov"] >= 1
        for i, s in zip(wanted.tolist(), dst.tolist()):
            assert np.array_equal(pool.block_bytes_view(s), want[i]), i
        # a byte flipped in one payload on disk: that record alone is a miss
        seg = next(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
        data = bytearray(seg.read_bytes())
        data[4096 * 2 + 100] ^= 0xFF  # (the file header, record 0's header, its payload)
        seg.write_bytes(bytes(data))
        hits = store.read_blocks("s", np.array([0, 1]), pool.block_views(dst[:2]))
        assert hits.tolist() == [False, True]
    finally:
        store.close()
        pool.close()
