"""vector_io: records with payloads by address, moved in one compiled call without the GIL."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tpkv.config import HostConfig, KvGeometry, SsdConfig
from tpkv.errors import SsdIoError
from tpkv.ssd import vector_io
from tpkv.ssd.backend import PosixFile
from tpkv.ssd.store import SsdStore
from tpkv.workers.pools import HostPool

pytestmark = pytest.mark.skipif(not vector_io.available(),
                                reason="compiled vector I/O does not run here")


class Records:
    """n records of random header rows and payloads (each its own array, by address)."""

    def __init__(self, seed: int, n: int, header_bytes: int, payload_bytes: int,
                 pad_bytes: int) -> None:
        rng = np.random.default_rng(seed)
        self.headers = rng.integers(0, 256, (n, header_bytes), dtype=np.uint8)
        self.payloads = [rng.integers(0, 256, payload_bytes, dtype=np.uint8) for _ in range(n)]
        self.pad = np.zeros(pad_bytes, np.uint8)
        self.payload_bytes = payload_bytes

    def addresses(self) -> np.ndarray:
        return np.array([p.ctypes.data for p in self.payloads], dtype=np.uint64)

    def image(self) -> bytes:
        """The bytes on disk: each header row, its payload, then the pad."""
        return b"".join(h.tobytes() + p.tobytes() + self.pad.tobytes()
                        for h, p in zip(self.headers, self.payloads))

    def empty(self) -> Records:
        back = Records(0, len(self.headers), self.headers.shape[1], self.payload_bytes,
                       len(self.pad))
        back.headers[:] = 0
        for p in back.payloads:
            p[:] = 0
        back.pad[:] = 0xAB  # the sink: overwritten by the padding read
        return back


@pytest.mark.parametrize("iov_max", [1, 2, 5, vector_io.IOV_MAX])
@pytest.mark.parametrize("pad_bytes", [0, 96])
def test_records_go_to_disk_and_back_bit_exact(tmp_path: Path, iov_max: int,
                                               pad_bytes: int) -> None:
    recs = Records(iov_max + pad_bytes, 700, 64, 1000, pad_bytes)
    want = recs.image()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = vector_io.move_records(fd, recs.headers, recs.addresses(), recs.payload_bytes,
                                     recs.pad, 100, write=True, iov_max=iov_max)
        assert got == len(want)
        assert os.pread(fd, len(want) + 1, 100) == want
        back = recs.empty()
        got = vector_io.move_records(fd, back.headers, back.addresses(), back.payload_bytes,
                                     back.pad, 100, write=False, iov_max=iov_max)
        assert got == len(want) and back.image() == want
    finally:
        os.close(fd)


def test_a_read_past_the_end_of_the_file_stops_there(tmp_path: Path) -> None:
    recs = Records(3, 4, 16, 100, 12)
    want = recs.image()
    cut = 2 * 128 + 16 + 40  # the file ends 40 bytes into record 2's payload
    (tmp_path / "f").write_bytes(want[:cut])
    back = recs.empty()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = vector_io.move_records(fd, back.headers, back.addresses(), back.payload_bytes,
                                     back.pad, 0, write=False, iov_max=3)
    finally:
        os.close(fd)
    assert got == cut
    assert back.image()[:cut] == want[:cut]
    assert not back.payloads[2][40:].any() and not back.payloads[3].any()
    assert not back.headers[3].any()


def test_a_short_write_goes_on_where_it_stopped_until_the_error(tmp_path: Path) -> None:
    """A file size limit cuts a write short in a payload; the next call fails (EFBIG): the
    bytes before the limit are the records' own, and the error is raised with its errno."""
    code = textwrap.dedent(f"""
        import errno, os, resource, sys
        import numpy as np
        sys.path.insert(0, {os.getcwd()!r})
        from tpkv.ssd import vector_io
        rng = np.random.default_rng(1)
        headers = rng.integers(0, 256, (6, 32), dtype=np.uint8)
        payloads = [rng.integers(0, 256, 200, dtype=np.uint8) for _ in range(6)]
        want = b"".join(h.tobytes() + p.tobytes() for h, p in zip(headers, payloads))
        addrs = np.array([p.ctypes.data for p in payloads], np.uint64)
        fd = os.open({str(tmp_path / "f")!r}, os.O_RDWR | os.O_CREAT, 0o600)
        resource.setrlimit(resource.RLIMIT_FSIZE, (700, resource.RLIM_INFINITY))
        try:
            vector_io.move_records(fd, headers, addrs, 200, np.zeros(0, np.uint8), 0,
                                   write=True)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
            assert "pwritev of 6 records at byte 0" in str(exc), exc
        else:
            raise AssertionError("the write past the size limit did not fail")
        assert os.pread(fd, 2000, 0) == want[:700]
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_errors_raise_typed_with_their_numbers() -> None:
    recs = Records(4, 2, 8, 16, 0)
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)  # a closed descriptor: EBADF
    for write, call in ((True, "pwritev"), (False, "preadv")):
        with pytest.raises(OSError, match=f"{call} of 2 records at byte 4096") as info:
            vector_io.move_records(fd, recs.headers, recs.addresses(), 16, recs.pad, 4096,
                                   write=write)
        assert info.value.errno == errno.EBADF
    with pytest.raises(ValueError, match=r"headers \(2, 8\) .* one for each of 3 payloads"):
        vector_io.move_records(fd, recs.headers, np.zeros(3, np.uint64), 16, recs.pad, 0,
                               write=True)
    with pytest.raises(ValueError, match="iov_max 0"):
        vector_io.move_records(fd, recs.headers, recs.addresses(), 16, recs.pad, 0,
                               write=True, iov_max=0)


def test_advance_skips_the_iovecs_moved_and_cuts_into_the_next() -> None:
    iov = np.array([[1000, 10], [2000, 20], [3000, 30]], dtype=np.uint64)
    assert vector_io.advance(iov, 0, 10) == 1  # exactly the first
    assert vector_io.advance(iov, 1, 25) == 2  # the second, and 5 bytes of the third
    assert iov[2].tolist() == [3005, 25]
    assert vector_io.advance(iov, 2, 25) == 3
    assert iov[:2].tolist() == [[1000, 10], [2000, 20]]  # (those moved are left as they were)


# blocks of 2,560 bytes: each record's payload is padded to 4,096 (a third iovec)
PADDED = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=40, dtype="float16", block_tokens=8)
UNPADDED = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", block_tokens=8)


class Counted:
    """Counts PosixFile's calls of records by address (and can make one fail)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.used = {"write_records": 0, "read_records": 0}
        for name in self.used:
            monkeypatch.setattr(PosixFile, name, self._counted(name, getattr(PosixFile, name)))

    def _counted(self, name: str, real: object) -> object:
        def call(file: PosixFile, *args: object) -> object:
            self.used[name] += 1
            return real(file, *args)  # type: ignore[operator]
        return call


@pytest.fixture
def pool_and_store(tmp_path: Path, request: pytest.FixtureRequest
                   ) -> tuple[HostPool, SsdStore, KvGeometry]:
    geo: KvGeometry = getattr(request, "param", UNPADDED)
    pool = HostPool(geo, 600, HostConfig(budget_bytes=600 * geo.block_bytes + (1 << 20)))
    store = SsdStore(SsdConfig(root=str(tmp_path), backend="posix", o_direct=False), geo,
                     "m", 0)
    rng = np.random.default_rng(geo.block_bytes)
    for s in range(600):
        pool.block_bytes_view(s)[:] = rng.integers(0, 256, geo.block_bytes)
    yield pool, store, geo
    store.close()
    pool.close()


@pytest.mark.parametrize("pool_and_store", [PADDED, UNPADDED], indirect=True)
def test_an_l2_pools_blocks_go_to_disk_and_back_by_address_bit_exact(
        tmp_path: Path, pool_and_store: tuple[HostPool, SsdStore, KvGeometry],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool, store, geo = pool_and_store
    counted = Counted(monkeypatch)
    rng = np.random.default_rng(1)
    src = rng.permutation(600)[:500]
    want = [pool.block_bytes_view(int(s)).copy() for s in src]
    assert store.write_blocks("s", np.arange(500), pool.block_views(src))
    assert store.commit_manifest("s")
    assert counted.used["write_records"] >= 2  # more records than a chunk's iovecs
    dst = rng.permutation(600)[:500]
    for s in dst:
        pool.block_bytes_view(int(s))[:] = 0
    wanted = rng.permutation(500)
    hits = store.read_blocks("s", wanted, pool.block_views(dst))
    assert hits.all() and counted.used["read_records"] >= 1
    for i, s in zip(wanted.tolist(), dst.tolist()):
        assert np.array_equal(pool.block_bytes_view(s), want[i]), i
    # a byte flipped in one payload on disk: that record alone is a miss
    seg = next(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    data = bytearray(seg.read_bytes())
    data[4096 * 2 + 100] ^= 0xFF  # (the file header, record 0's header, its payload)
    seg.write_bytes(bytes(data))
    hits = store.read_blocks("s", np.array([0, 1]), pool.block_views(dst[:2]))
    assert hits.tolist() == [False, True]


def test_a_failed_write_by_address_is_cut_back_and_a_failed_read_is_a_miss(
        pool_and_store: tuple[HostPool, SsdStore, KvGeometry],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool, store, geo = pool_and_store
    assert store.write_blocks("s", np.arange(4), pool.block_views(np.arange(4)))
    assert store.commit_manifest("s")
    usage = store.usage_bytes()
    real_write = PosixFile.write_records

    def first_then_enospc(file: PosixFile, headers: np.ndarray, payloads: np.ndarray,
                          *args: int) -> None:  # one whole record lands, then the disk is full
        real_write(file, headers[:1], payloads[:1], *args)  # type: ignore[arg-type]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PosixFile, "write_records", first_then_enospc)
    with pytest.raises(SsdIoError) as info:
        store.write_blocks("s", np.array([4, 5]), pool.block_views(np.array([4, 5])))
    assert info.value.errno == errno.ENOSPC and store.usage_bytes() == usage
    monkeypatch.undo()

    def eio(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(PosixFile, "read_records", eio)
    dst = np.arange(100, 104)
    assert not store.read_blocks("s", np.arange(4), pool.block_views(dst)).any()
    monkeypatch.undo()
    hits = store.read_blocks("s", np.arange(6), pool.block_views(np.arange(100, 106)))
    assert hits.tolist() == [True] * 4 + [False] * 2  # the cut append left nothing behind
    for k in range(4):
        assert np.array_equal(pool.block_bytes_view(100 + k), pool.block_bytes_view(k))
