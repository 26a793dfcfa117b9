"""L3 files never leak: closed sessions are deleted by close(), unreadable files at start."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.faults.engine_run import drive, tiny_tiers
from tpkv.config import KvGeometry, SsdConfig, ssd_record_bytes
from tpkv.errors import TierFullError
from tpkv.launch.join import init as tpkv_init
from tpkv.models.llama import build_model
from tpkv.models.tiered import TieredEngine
from tpkv.ssd.store import SsdStore

GEO = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_tokens=2,
                 tp_size=1)
MODEL = "leak-model"
PAGE = 4096


def store(root: Path, geo: KvGeometry = GEO, model: str = MODEL, budget: int = 1 << 30
          ) -> SsdStore:
    cfg = SsdConfig(root=str(root), backend="posix", o_direct=False, io_threads=1,
                    budget_bytes=budget)
    return SsdStore(cfg, geo, model, 0)


def blocks(geo: KvGeometry, count: int, value: int = 3) -> list[np.ndarray]:
    return [np.full(geo.block_bytes, value + k, np.uint8) for k in range(count)]


def hexname(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def path(root: Path, sid: str, suffix: str) -> Path:
    return root / hexname(sid)[:2] / f"{hexname(sid)}.{suffix}"


def put(root: Path, sid: str, geo: KvGeometry = GEO, model: str = MODEL, num: int = 2,
        manifest: bool = True) -> None:
    """A session as an earlier run left it (its writes are durable on return, so a crash
    right after leaves exactly these files). Written in a scratch root, then copied in: a store
    opened on `root` would reclaim what the earlier put() calls left there."""
    scratch = Path(tempfile.mkdtemp(prefix=f"scratch-{sid}-", dir=root.parent))
    s = store(scratch, geo, model)
    s.write_blocks(sid, np.arange(num), blocks(geo, num))
    if manifest:
        assert s.commit_manifest(sid)
    s.close()
    for src in scratch.glob("*/*"):
        (root / src.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / src.parent.name / src.name)


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def segment_bytes(root: Path, rank: int = 0) -> int:
    return sum(p.stat().st_size for p in root.glob(f"*/*.r{rank}.seg"))


def test_start_reclaims_every_file_that_can_never_be_read_and_nothing_else(
        tmp_path: Path) -> None:
    root = tmp_path
    record = ssd_record_bytes(GEO.block_bytes)
    put(root, "keep")
    put(root, "half", manifest=False)  # committed, no manifest: another rank may complete it
    put(root, "tail")
    with open(path(root, "tail", "r0.seg"), "ab") as f:  # a write that never committed
        f.write(b"\x07" * (record + 100))
    put(root, "other-model", model="someone-else")
    put(root, "other-geometry", geo=KvGeometry(**{**GEO.__dict__, "dtype": "bfloat16"}))
    put(root, "torn-commit")
    os.truncate(path(root, "torn-commit", "r0.commit"), 10)
    put(root, "garbage-header")
    with open(path(root, "garbage-header", "r0.seg"), "r+b") as f:
        f.write(b"garbage")
    put(root, "orphan-segment")
    path(root, "orphan-segment", "r0.commit").unlink()
    put(root, "orphan-commit")
    path(root, "orphan-commit", "r0.seg").unlink()
    put(root, "short")
    os.truncate(path(root, "short", "r0.seg"), PAGE + record // 2)
    for suffix in ("r0.seg.tmp", "r0.commit.tmp", "manifest.r0.tmp"):
        path(root, "keep", suffix).write_bytes(b"crash")
    untouched = {  # not tpkv's, or not this rank's: never deleted
        "notes.txt": b"mine", f"{hexname('keep')[:2]}/readme": b"x",
        str(path(root, "keep", "r0.seg.bak").relative_to(root)): b"y",
        str(path(root, "rank1", "r1.seg").relative_to(root)): b"z" * PAGE,
    }
    for rel, data in untouched.items():
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(data)

    s = store(root)
    kept = {"keep", "half", "tail"}
    want = {str(path(root, sid, suffix).relative_to(root)) for sid in kept
            for suffix in ("r0.seg", "r0.commit")}
    want |= {str(path(root, sid, "manifest").relative_to(root)) for sid in ("keep", "tail")}
    assert files(root) == want | set(untouched) | {"owner.r0.lock"}
    assert path(root, "tail", "r0.seg").stat().st_size == PAGE + 2 * record  # tail cut off
    # usage is the bytes of the readable segments, and no more
    assert s.usage_bytes() == segment_bytes(root) == 3 * (PAGE + 2 * record)
    for sid in ("keep", "tail"):
        out = [np.empty(GEO.block_bytes, np.uint8) for _ in range(2)]
        assert s.read_blocks(sid, np.arange(2), out).all()
        for got, exp in zip(out, blocks(GEO, 2)):
            np.testing.assert_array_equal(got, exp)
    assert s.list_sessions() == ["keep", "tail"]
    s.close()


@pytest.mark.parametrize("earlier", ["other-model", "same-model-crashed"])
def test_a_new_run_on_a_root_full_of_an_earlier_runs_files_can_spill(
        tmp_path: Path, earlier: str) -> None:
    record = ssd_record_bytes(GEO.block_bytes)
    budget = 3 * (PAGE + 2 * record)
    model = "someone-else" if earlier == "other-model" else MODEL
    for k in range(3):  # the earlier run filled the whole budget
        put(tmp_path, f"old-{k}", model=model, manifest=k != 1)
    path(tmp_path, "old-0", "r0.seg.tmp").write_bytes(b"\0" * record)  # its crash
    assert segment_bytes(tmp_path) == budget
    s = store(tmp_path, budget=budget)
    written = 0
    for k in range(3):  # the new run's spills: each fits once older files make room
        written += s.write_blocks(f"new-{k}", np.arange(2), blocks(GEO, 2, 40 + k))
        assert s.usage_bytes() == segment_bytes(tmp_path) <= budget
    assert written == budget
    for k in range(3):
        out = [np.empty(GEO.block_bytes, np.uint8) for _ in range(2)]
        assert s.commit_manifest(f"new-{k}")
        assert s.read_blocks(f"new-{k}", np.arange(2), out).all()
        np.testing.assert_array_equal(out[1], blocks(GEO, 2, 40 + k)[1])
    assert not list(tmp_path.rglob("*.tmp"))
    s.close()
    if earlier == "same-model-crashed":  # warm restart: what a run names is never deleted
        for sid in ("old-0", "old-2"):
            put(tmp_path, sid)
        s = store(tmp_path, budget=budget)  # new-0..2 (older) and old-0, old-2: 5/3 of it
        assert s.usage_bytes() == segment_bytes(tmp_path) == budget  # the two oldest went
        assert s.list_sessions() == ["new-2", "old-0", "old-2"]
        with pytest.raises(TierFullError):  # all of them named now: none is deleted for room
            s.write_blocks("new-3", np.arange(1), blocks(GEO, 1))
        assert s.list_sessions() == ["new-2", "old-0", "old-2"]
        s.close()


def test_closing_sessions_in_the_engine_deletes_their_l3_files_before_close_returns(
        tmp_path: Path) -> None:
    """TP 1, the tiny model on tiers too small for six sessions: some reach L3. Each
    close_session (the last calls of the workload; no step follows) leaves none of that
    session's files, and neither does leaving the runtime."""
    root = tmp_path / "l3"
    model = build_model("tiny", seed=0, device="cpu")
    rt = tpkv_init(tiny_tiers(model, str(root)), controller="local", device="cpu")
    had_files: list[str] = []
    try:
        tiered = TieredEngine(rt, model, report_prefill=False)
        engine = tiered.engine
        close = engine.close_session

        def checked_close(session: str) -> None:
            mine = f"{hexname(session)}."
            if any(p.name.startswith(mine) for p in root.glob("*/*")):
                had_files.append(session)
            close(session)
            left = [p.name for p in root.glob("*/*") if p.name.startswith(mine)]
            assert left == [], f"{session}: {left} left after close_session returned"

        engine.close_session = checked_close  # type: ignore[method-assign]
        drive(engine)
    finally:
        rt.close()
    assert had_files, "no session reached L3: the test would prove nothing"
    assert not [p for p in root.glob("*/*")], "L3 files left after the runtime closed"
