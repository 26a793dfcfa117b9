"""A damaged manifest: its session's blocks miss until a commit_manifest rewrites it from the
ranks' commit records, which a manifest only ever summarizes (what RELIABILITY.md says)."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_ssd_faults import ALL, NONE, Setup, files, flip


def test_a_flipped_manifest_misses_until_commit_manifest_rewrites_it(tmp_path: Path) -> None:
    setup = Setup(tmp_path)
    manifest = files(tmp_path, "s1")["manifest"]
    flip(manifest, 200)
    assert setup.read() == NONE and setup.read(rank=1) == NONE  # detected: a miss on each rank
    assert setup.stores[0].list_sessions() == ["s2"]
    assert setup.stores[1].commit_manifest("s1")  # any rank: rebuilt from the commit records
    assert setup.read() == ALL and setup.read(rank=1) == ALL  # bit-exact (read checks bytes)
    assert setup.stores[0].list_sessions() == ["s1", "s2"]


def test_a_manifest_is_not_rebuilt_over_a_damaged_commit_record(tmp_path: Path) -> None:
    setup = Setup(tmp_path)
    paths = files(tmp_path, "s1")
    flip(paths["manifest"], 200)
    flip(paths["commit1"], 100)
    assert not setup.stores[0].commit_manifest("s1")
    assert setup.read() == NONE and setup.read(rank=1) == NONE
