"""L3 faults: every damaged, stale, foreign or missing file is a miss, never wrong data."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tpkv.config import KvGeometry, SsdConfig
from tpkv.errors import SsdIoError
from tpkv.ssd import backend as ssd_backend
from tpkv.ssd import format as ssd_format
from tpkv.ssd import kernels
from tpkv.ssd.backend import BlockViews, PosixFile, aligned_empty
from tpkv.ssd.store import SsdStore

PAGE = 4096
KIND = dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_tokens=2)
NUM_BLOCKS = 4


def geometry(tp_size: int = 2, **changes: object) -> KvGeometry:
    return KvGeometry(**{**KIND, "tp_size": tp_size, **changes})  # type: ignore[arg-type]


def make_stores(root: Path, geo: KvGeometry, model: str = "model-a", o_direct: bool = True
                ) -> list[SsdStore]:
    config = SsdConfig(root=str(root), backend="posix", io_threads=1, o_direct=o_direct)
    return [SsdStore(config, geo, model, rank) for rank in range(geo.tp_size)]


def sha_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def files(root: Path, sid: str) -> dict[str, Path]:
    hexname = sha_hex(sid)
    d = root / hexname[:2]
    return {"seg0": d / f"{hexname}.r0.seg", "seg1": d / f"{hexname}.r1.seg",
            "commit0": d / f"{hexname}.r0.commit", "commit1": d / f"{hexname}.r1.commit",
            "manifest": d / f"{hexname}.manifest"}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def data_files(root: Path) -> dict[str, bytes]:
    """tree() without the stores' owner locks: the session files."""
    return {k: v for k, v in tree(root).items() if not k.startswith("owner.")}


def copy_in(root: Path, saved: dict[str, bytes]) -> None:
    """Files that appear after the stores started (a copy, a backup restored)."""
    for rel, data in saved.items():
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(data)


class Setup:
    """Two sessions on a TP-2 root, complete; remembers what every rank wrote."""

    def __init__(self, root: Path, o_direct: bool = True) -> None:
        self.root = root
        self.geo = geometry()
        self.stores = make_stores(root, self.geo, o_direct=o_direct)
        rng = np.random.default_rng(0)
        self.truth: dict[tuple[str, int], list[np.ndarray]] = {}
        for sid in ("s1", "s2"):
            for rank, store in enumerate(self.stores):
                blocks = [rng.integers(0, 256, self.geo.block_bytes, dtype=np.uint8)
                          for _ in range(NUM_BLOCKS)]
                store.write_blocks(sid, np.arange(2), blocks[:2])
                store.write_blocks(sid, np.arange(2, NUM_BLOCKS), blocks[2:])  # an append
                self.truth[(sid, rank)] = blocks
            assert self.stores[0].commit_manifest(sid)
        self.record_bytes = self.stores[0].record_bytes

    def read(self, sid: str = "s1", rank: int = 0, store: SsdStore | None = None
             ) -> list[bool]:
        """Read every block; assert each hit is bit-exact and each miss zeroed."""
        store = store or self.stores[rank]
        out = [aligned_empty(self.geo.block_bytes) for _ in range(NUM_BLOCKS)]
        for buf in out:
            buf.fill(0xAB)
        hits = store.read_blocks(sid, np.arange(NUM_BLOCKS), out)
        for k in range(NUM_BLOCKS):
            if hits[k]:
                np.testing.assert_array_equal(out[k], self.truth[(sid, rank)][k])
            else:
                assert not out[k].any()
        return hits.tolist()

    def record_at(self, k: int) -> int:
        return PAGE + k * self.record_bytes


ALL = [True] * NUM_BLOCKS
NONE = [False] * NUM_BLOCKS


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Setup:
    return Setup(tmp_path, o_direct=request.param)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


# ---- damaged bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", [0, 8, 100, 4091, 4092])
def test_flipped_byte_in_a_record_header_misses_that_record(setup: Setup, where: int) -> None:
    assert setup.read() == ALL
    flip(files(setup.root, "s1")["seg0"], setup.record_at(2) + where)
    assert setup.read() == [True, True, False, True]
    assert setup.read(rank=1) == ALL and setup.read("s2") == ALL


@pytest.mark.parametrize("where", [0, 1, -1])
def test_flipped_byte_in_a_payload_misses_that_record(setup: Setup, where: int) -> None:
    flip(files(setup.root, "s1")["seg0"],
         setup.record_at(1) + PAGE + where % setup.geo.block_bytes)
    assert setup.read() == [True, False, True, True]


def test_no_single_flipped_byte_anywhere_gives_wrong_data(tmp_path: Path) -> None:
    s = Setup(tmp_path, o_direct=False)
    paths = files(tmp_path, "s1")
    for name in ("manifest", "commit0"):
        original = paths[name].read_bytes()
        for offset in range(len(original)):
            flip(paths[name], offset)
            assert s.read() == NONE, f"{name} byte {offset}"
            paths[name].write_bytes(original)
    segment = paths["seg0"]
    original = segment.read_bytes()
    block_bytes = s.geo.block_bytes
    for offset in list(range(0, len(original), 97)) + [len(original) - 1]:
        flip(segment, offset)
        hits = s.read()  # asserts every hit is bit-exact
        if offset < PAGE:
            assert hits == NONE, offset
        else:
            k, within = divmod(offset - PAGE, s.record_bytes)
            covered = within < PAGE + block_bytes  # padding is not data
            assert hits[k] is (not covered), offset
        segment.write_bytes(original)
    assert s.read() == ALL


def test_records_swapped_within_a_segment_are_misses(setup: Setup) -> None:
    path = files(setup.root, "s1")["seg0"]
    data = bytearray(path.read_bytes())
    a, b, r = setup.record_at(0), setup.record_at(3), setup.record_bytes
    data[a:a + r], data[b:b + r] = data[b:b + r], data[a:a + r]
    path.write_bytes(bytes(data))
    assert setup.read() == [False, True, True, False]


def test_records_of_the_same_index_swapped_are_misses(tmp_path: Path) -> None:
    geo = geometry(tp_size=1)
    (store,) = make_stores(tmp_path, geo)
    old, new = (np.full(geo.block_bytes, v, np.uint8) for v in (1, 2))
    store.write_blocks("s", np.array([5, 5]), [old, new])  # the newer record wins
    assert store.commit_manifest("s")
    seg = files(tmp_path, "s")["seg0"]
    data = bytearray(seg.read_bytes())
    r = store.record_bytes
    data[PAGE:PAGE + r], data[PAGE + r:PAGE + 2 * r] = data[PAGE + r:PAGE + 2 * r], data[
        PAGE:PAGE + r]
    seg.write_bytes(bytes(data))
    out = [np.empty(geo.block_bytes, np.uint8)]
    assert not store.read_blocks("s", np.array([5]), out).any()  # never the older bytes


def test_a_record_spliced_from_another_ranks_segment_is_a_miss(setup: Setup) -> None:
    paths = files(setup.root, "s1")
    theirs = paths["seg1"].read_bytes()
    data = bytearray(paths["seg0"].read_bytes())
    at, r = setup.record_at(1), setup.record_bytes
    data[at:at + r] = theirs[at:at + r]
    paths["seg0"].write_bytes(bytes(data))
    assert setup.read() == [True, False, True, True]


def test_a_restored_older_incarnation_of_a_segment_is_a_miss(setup: Setup) -> None:
    paths = files(setup.root, "s1")
    backup = {name: paths[name].read_bytes() for name in ("seg0", "commit0")}
    for store in setup.stores:
        store.drop_session("s1")
    rng = np.random.default_rng(3)
    for rank, store in enumerate(setup.stores):  # the same indices again, new bytes
        setup.truth[("s1", rank)] = [rng.integers(0, 256, setup.geo.block_bytes, dtype=np.uint8)
                                     for _ in range(NUM_BLOCKS)]
        store.write_blocks("s1", np.arange(NUM_BLOCKS), setup.truth[("s1", rank)])
    assert setup.stores[1].commit_manifest("s1")
    assert setup.read() == ALL
    current = paths["seg0"].read_bytes()
    at, r = setup.record_at(2), setup.record_bytes
    spliced = current[:at] + backup["seg0"][at:at + r] + current[at + r:]
    paths["seg0"].write_bytes(spliced)  # one old record: same index, rank, place, session
    assert setup.read() == [True, True, False, True]
    paths["seg0"].write_bytes(backup["seg0"])  # the old segment back under the new commit
    assert setup.read() == NONE
    paths["commit0"].write_bytes(backup["commit0"])  # and its commit: the manifest disagrees
    assert setup.read() == NONE
    assert setup.read(rank=1) == ALL


def test_commits_resealed_with_other_indices_are_misses_where_records_disagree(
        setup: Setup) -> None:
    # A writer bug, simulated: both ranks' commits list indices 0 and 1 the other way round.
    for rank, store in enumerate(setup.stores):
        path = files(setup.root, "s1")[f"commit{rank}"]
        seg = files(setup.root, "s1")[f"seg{rank}"].read_bytes()
        ident = replace(store._files.ident(store._files.paths("s1")),
                        segment_id=int.from_bytes(seg[40:48], "little"))
        path.write_bytes(ssd_format.pack_commit(ident, np.array([1, 0, 2, 3])))
    assert setup.stores[0].commit_manifest("s1")
    assert setup.read() == [False, False, True, True]


def test_an_older_commit_than_the_manifest_is_a_miss(setup: Setup) -> None:
    commit = files(setup.root, "s1")["commit0"]
    rng = np.random.default_rng(4)
    older = commit.read_bytes()
    for store in setup.stores:
        block = rng.integers(0, 256, setup.geo.block_bytes, dtype=np.uint8)
        store.write_blocks("s1", np.array([NUM_BLOCKS]), [block])
    assert setup.stores[0].commit_manifest("s1")
    commit.write_bytes(older)  # 4 records committed, the manifest covers 5
    assert setup.read() == NONE
    assert setup.read(rank=1) == ALL


# ---- truncation and torn tails ------------------------------------------------------------------


def test_truncated_tail_misses_only_the_cut_records(setup: Setup) -> None:
    path = files(setup.root, "s1")["seg0"]
    os.truncate(path, setup.record_at(3) + 100)
    assert setup.read() == [True, True, True, False]
    assert setup.stores[0].list_sessions() == ["s2"]  # no longer whole on this rank
    assert setup.stores[1].list_sessions() == ["s1", "s2"]
    os.truncate(path, setup.record_at(1))
    assert setup.read() == [True, False, False, False]
    os.truncate(path, 1000)  # into the file header
    assert setup.read() == NONE
    assert setup.read(rank=1) == ALL


def test_bytes_past_the_committed_length_are_ignored_and_overwritten(setup: Setup) -> None:
    path = files(setup.root, "s1")["seg0"]
    committed = path.stat().st_size
    with open(path, "ab") as f:  # a torn append: half a record of garbage
        f.write(b"\xff" * (setup.record_bytes // 2))
    assert setup.read() == ALL
    rng = np.random.default_rng(1)
    more = [rng.integers(0, 256, setup.geo.block_bytes, dtype=np.uint8) for _ in range(2)]
    for rank, store in enumerate(setup.stores):
        store.write_blocks("s1", np.array([10, 11]), more if rank == 0 else more[::-1])
    assert setup.stores[1].commit_manifest("s1")
    assert path.stat().st_size == committed + 2 * setup.record_bytes
    out = [np.empty(setup.geo.block_bytes, np.uint8) for _ in range(2)]
    assert setup.stores[0].read_blocks("s1", np.array([10, 11]), out).all()
    for got, want in zip(out, more):
        np.testing.assert_array_equal(got, want)
    assert setup.read() == ALL


# ---- headers, fingerprints, stale stores --------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 8, 12, 16, 20, 24, 32, 40, 48, 80, 112, 200, 4092])
def test_garbled_file_header_misses_the_whole_segment(setup: Setup, offset: int) -> None:
    flip(files(setup.root, "s1")["seg0"], offset)
    assert setup.read() == NONE
    assert setup.read(rank=1) == ALL and setup.read("s2") == ALL


def test_a_header_resealed_with_a_valid_crc_but_wrong_fields_is_still_a_miss(
        setup: Setup) -> None:
    path = files(setup.root, "s1")["seg0"]
    data = bytearray(path.read_bytes())
    header = np.zeros(PAGE, np.uint8)
    ident = setup.stores[0]._files.ident(setup.stores[0]._files.paths("s1"))
    ident = replace(ident, segment_id=int.from_bytes(data[40:48], "little"))
    ssd_format.pack_segment_header(ident, header)
    assert header.tobytes() == bytes(data[:PAGE])  # resealing the right fields changes nothing
    for wrong in (dict(rank=1), dict(tp_size=4), dict(block_bytes=1024), dict(segment_id=3),
                  dict(session_hash=b"\2" * 32), dict(geometry_digest=b"\0" * 32),
                  dict(model_digest=b"\1" * 32)):
        ssd_format.pack_segment_header(replace(ident, **wrong), header)  # type: ignore[arg-type]
        data[:PAGE] = header.tobytes()
        path.write_bytes(bytes(data))
        assert setup.read() == NONE, wrong


@pytest.mark.parametrize("change", [
    dict(dtype="bfloat16"), dict(dtype="float32"), dict(block_tokens=4), dict(head_dim=16),
    dict(num_layers=3), dict(tp_size=4), dict(tp_size=1, num_kv_heads=2),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_changed_geometry_loads_zero_blocks(setup: Setup, change: dict) -> None:
    saved = data_files(setup.root)
    for store in setup.stores:  # one live store per (root, rank): the old ones go first
        store.close()
    geo = geometry(**{"tp_size": 2, **change})
    stores = make_stores(setup.root, geo)
    for store in stores:  # the other geometry's files of its rank were reclaimed at start
        assert store.usage_bytes() == 0
        assert not list(setup.root.glob(f"*/*.r{store.rank}.*"))
    copy_in(setup.root, saved)  # and the same files copied in later still read as misses
    for store in stores:
        assert store.list_sessions() == []
        out = [np.empty(geo.block_bytes, np.uint8) for _ in range(NUM_BLOCKS)]
        assert not store.read_blocks("s1", np.arange(NUM_BLOCKS), out).any()


def test_a_changed_model_fingerprint_loads_zero_blocks(setup: Setup) -> None:
    saved = data_files(setup.root)
    for store in setup.stores:
        store.close()
    other = make_stores(setup.root, setup.geo, model="model-b")
    assert data_files(setup.root) == {}  # model-a's files can never be read here: reclaimed
    assert [s.usage_bytes() for s in other] == [0, 0]
    copy_in(setup.root, saved)
    assert other[0].list_sessions() == [] and other[1].list_sessions() == []
    assert setup.read(store=other[0]) == NONE


def test_a_changed_format_version_loads_zero_blocks(setup: Setup,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    saved = data_files(setup.root)
    for store in setup.stores:
        store.close()
    monkeypatch.setattr(ssd_format, "FORMAT_VERSION", ssd_format.FORMAT_VERSION + 1)
    newer = make_stores(setup.root, setup.geo)
    assert data_files(setup.root) == {}
    copy_in(setup.root, saved)
    assert newer[0].list_sessions() == []
    assert setup.read(store=newer[0]) == NONE


def test_a_stale_segment_is_replaced_by_the_next_write(setup: Setup) -> None:
    saved = data_files(setup.root)
    for store in setup.stores:
        store.close()
    geo = geometry(dtype="bfloat16")
    stores = make_stores(setup.root, geo)
    copy_in(setup.root, saved)  # stale files that appear after the start (not reclaimed)
    rng = np.random.default_rng(2)
    fresh = {r: [rng.integers(0, 256, geo.block_bytes, dtype=np.uint8)] for r in range(2)}
    for rank, store in enumerate(stores):
        assert store.write_blocks("s1", np.array([0]), fresh[rank]) == PAGE + store.record_bytes
        assert store.usage_bytes() == PAGE + store.record_bytes
        # the stale segment was replaced by the new one
        assert files(setup.root, "s1")[f"seg{rank}"].stat().st_size == PAGE + store.record_bytes
    assert stores[0].commit_manifest("s1")
    out = [np.empty(geo.block_bytes, np.uint8)]
    assert stores[1].read_blocks("s1", np.array([0]), out).all()
    np.testing.assert_array_equal(out[0], fresh[1][0])


# ---- missing and foreign files ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["manifest", "commit0", "seg0"])
def test_a_missing_file_is_a_miss(setup: Setup, name: str) -> None:
    files(setup.root, "s1")[name].unlink()
    assert setup.read() == NONE
    assert setup.read(rank=1) == (NONE if name == "manifest" else ALL)
    assert setup.read("s2") == ALL
    assert setup.stores[0].list_sessions() == ["s2"]


def test_a_session_written_but_never_committed_is_a_miss(tmp_path: Path) -> None:
    geo = geometry()
    stores = make_stores(tmp_path, geo)
    for store in stores:
        store.write_blocks("s", np.arange(2), [np.ones(geo.block_bytes, np.uint8)] * 2)
    out = [np.empty(geo.block_bytes, np.uint8) for _ in range(2)]
    assert not stores[0].read_blocks("s", np.arange(2), out).any()
    assert stores[0].list_sessions() == []


@pytest.mark.parametrize("name", ["seg0", "commit0", "manifest"])
def test_truncated_or_empty_metadata_and_headers_are_misses(setup: Setup, name: str) -> None:
    path = files(setup.root, "s1")[name]
    for size in (0, 3, 50, 135, path.stat().st_size - 1):
        os.truncate(path, min(size, PAGE - 1))
        assert setup.read() == NONE


def test_another_ranks_segment_copied_over_is_a_miss(setup: Setup) -> None:
    paths = files(setup.root, "s1")
    shutil.copyfile(paths["seg1"], paths["seg0"])
    assert setup.read() == NONE
    shutil.copyfile(paths["commit1"], paths["commit0"])  # commit too: rank field disagrees
    assert setup.read() == NONE
    assert setup.read(rank=1) == ALL


def test_another_sessions_files_copied_over_are_misses(setup: Setup) -> None:
    mine, theirs = files(setup.root, "s1"), files(setup.root, "s2")
    shutil.copyfile(theirs["seg0"], mine["seg0"])
    assert setup.read() == NONE
    for name in ("commit0", "commit1", "seg1", "manifest"):
        shutil.copyfile(theirs[name], mine[name])
    assert setup.read() == NONE and setup.read(rank=1) == NONE
    assert setup.stores[0].list_sessions() == ["s2"]
    assert setup.read("s2") == ALL


def test_a_symlinked_segment_is_not_followed(setup: Setup, tmp_path: Path) -> None:
    seg = files(setup.root, "s1")["seg0"]
    target = tmp_path.parent / f"{tmp_path.name}-outside.seg"
    shutil.copyfile(seg, target)
    seg.unlink()
    seg.symlink_to(target)
    assert setup.read() == NONE
    target.unlink()


# ---- OS errors ----------------------------------------------------------------------------------


def test_an_io_error_during_read_is_a_logged_miss(setup: Setup, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    real = PosixFile.read_at

    def failing(self: PosixFile, bufs: list[np.ndarray], offset_bytes: int) -> int:
        if offset_bytes >= PAGE:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, bufs, offset_bytes)

    monkeypatch.setattr(PosixFile, "read_at", failing)
    with caplog.at_level(logging.WARNING):
        assert setup.read() == NONE
    assert any("Input/output error" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(ssd_backend.os, "open", _raise(errno.EACCES))
    assert setup.read() == NONE
    assert setup.stores[0].list_sessions() == []


def _raise(code: int) -> Callable[..., int]:
    def fail(*args: object, **kwargs: object) -> int:
        raise OSError(code, os.strerror(code))
    return fail


def test_enospc_during_an_append_keeps_the_committed_state(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    before, usage = tree(setup.root), setup.stores[0].usage_bytes()
    monkeypatch.setattr(ssd_backend.os, "pwritev", _raise(errno.ENOSPC))
    with pytest.raises(SsdIoError, match="appending 2 blocks") as info:
        setup.stores[0].write_blocks("s1", np.array([7, 8]), setup.truth[("s1", 0)][:2])
    assert info.value.errno == errno.ENOSPC
    assert tree(setup.root) == before and setup.stores[0].usage_bytes() == usage
    assert setup.read() == ALL
    monkeypatch.undo()
    setup.stores[0].write_blocks("s1", np.array([7]), setup.truth[("s1", 0)][:1])
    assert setup.stores[0].usage_bytes() == usage + setup.record_bytes


def test_a_partial_append_is_cut_back(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    seg = files(setup.root, "s1")["seg0"]
    size = seg.stat().st_size

    def half_then_enospc(fd: int, bufs: list[memoryview], offset: int) -> int:
        if offset > size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs[:1], offset)  # writes only the first record header

    monkeypatch.setattr(ssd_backend.os, "pwritev", half_then_enospc)
    with pytest.raises(SsdIoError):
        setup.stores[0].write_blocks("s1", np.array([7]), setup.truth[("s1", 0)][:1])
    assert seg.stat().st_size == size
    assert setup.read() == ALL


def test_enospc_during_a_first_write_leaves_no_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    geo = geometry()
    stores = make_stores(tmp_path, geo)
    monkeypatch.setattr(ssd_backend.os, "pwritev", _raise(errno.ENOSPC))
    with pytest.raises(SsdIoError, match="new segment of 2 blocks") as info:
        stores[0].write_blocks("s", np.arange(2), [np.ones(geo.block_bytes, np.uint8)] * 2)
    assert info.value.errno == errno.ENOSPC
    assert data_files(tmp_path) == {}
    assert stores[0].usage_bytes() == 0


def test_a_failed_rewrite_never_leaves_the_old_commit_beside_the_new_segment(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = files(setup.root, "s1")
    paths["seg0"].unlink()  # the commit is valid but its segment is gone: next write rewrites
    monkeypatch.setattr(ssd_backend.os, "write", _raise(errno.ENOSPC))
    with pytest.raises(SsdIoError, match="commit of session s1"):
        setup.stores[0].write_blocks("s1", np.array([0]), setup.truth[("s1", 0)][:1])
    monkeypatch.undo()
    assert paths["seg0"].exists() and not paths["commit0"].exists()
    assert setup.read() == NONE and setup.read(rank=1) == ALL
    assert setup.stores[0].usage_bytes() == (PAGE + setup.record_bytes
                                             + PAGE + NUM_BLOCKS * setup.record_bytes)


def test_enospc_while_writing_the_commit_keeps_the_old_commit(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    commit = files(setup.root, "s1")["commit0"]
    old = commit.read_bytes()
    monkeypatch.setattr(ssd_backend.os, "write", _raise(errno.ENOSPC))
    with pytest.raises(SsdIoError, match="commit of session s1"):
        setup.stores[0].write_blocks("s1", np.array([9]), setup.truth[("s1", 0)][:1])
    assert commit.read_bytes() == old
    assert not list(setup.root.rglob("*.tmp"))
    assert setup.read() == ALL
    assert setup.stores[0].usage_bytes() == 2 * (PAGE + NUM_BLOCKS * setup.record_bytes)
    monkeypatch.undo()
    # The uncommitted tail is ignored and overwritten by the next append.
    setup.stores[0].write_blocks("s1", np.array([9]), setup.truth[("s1", 0)][:1])
    setup.stores[1].write_blocks("s1", np.array([9]), setup.truth[("s1", 1)][:1])
    assert setup.stores[0].commit_manifest("s1")
    out = [np.empty(setup.geo.block_bytes, np.uint8)]
    assert setup.stores[0].read_blocks("s1", np.array([9]), out).all()
    np.testing.assert_array_equal(out[0], setup.truth[("s1", 0)][0])


def _read_views(setup: Setup) -> list[bool]:
    """Setup.read into an L2 pool's kind of views (BlockViews: the CRCs from addresses taken
    at once), over one page-aligned array in a shuffled slot order."""
    bb = setup.geo.block_bytes
    pool = aligned_empty(2 * NUM_BLOCKS * bb).reshape(2 * NUM_BLOCKS, bb)
    pool.fill(0xAB)
    base = pool.__array_interface__["data"][0]
    slots = np.array([5, 0, 7, 2])[:NUM_BLOCKS]
    views = BlockViews(pool.__getitem__, slots, bb, bb % PAGE == 0,
                       lambda s: base + np.asarray(s, dtype=np.int64) * bb)
    hits = setup.stores[0].read_blocks("s1", np.arange(NUM_BLOCKS), views)
    for k, slot in enumerate(slots.tolist()):
        if hits[k]:
            np.testing.assert_array_equal(pool[slot], setup.truth[("s1", 0)][k])
        else:
            assert not pool[slot].any()
    return hits.tolist()


@pytest.mark.parametrize("where", [0, 8, 100, 4091, 4092, PAGE, PAGE + 1])
def test_a_flipped_byte_read_into_pool_views_misses_that_record(
        setup: Setup, where: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers and payloads read into BlockViews are checked as into buffers: a byte flipped
    in record 2's header (or seal), or in its payload, misses that record alone. (Buffered,
    their CRCs come from the views' addresses; with O_DIRECT these blocks, not whole pages,
    are staged and checked as buffers.)"""
    sizes: list[int] = []
    real = kernels.crc_at
    monkeypatch.setattr(kernels, "crc_at", lambda a, n: sizes.append(n) or real(a, n))
    assert _read_views(setup) == ALL
    direct = setup.stores[0].direct_io
    assert bool(sizes) != direct, (direct, sizes)
    flip(files(setup.root, "s1")["seg0"], setup.record_at(2) + where)
    assert _read_views(setup) == [True, True, False, True]
