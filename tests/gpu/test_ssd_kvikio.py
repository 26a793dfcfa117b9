"""kvikio L3 backend (GPU machine): bit-exact round trips, and the POSIX backend's bytes on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tpkv.config import KvGeometry, SsdConfig
from tpkv.ssd import session_io
from tpkv.ssd.backend import aligned_empty
from tpkv.ssd.store import SsdStore

pytestmark = pytest.mark.gpu

GEOMS = [
    KvGeometry(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", tp_size=2),  # 64 KiB
    KvGeometry(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float16", tp_size=2),  # 768 B
]


def tree(root: Path) -> dict[str, bytes]:
    """The store's data files (not the per-rank owner locks, which name their process)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not (p.name.startswith("owner.r") and p.suffix == ".lock")}


def open_stores(root: Path, geo: KvGeometry, backend: str) -> list[SsdStore]:
    config = SsdConfig(root=str(root), backend=backend)  # type: ignore[arg-type]
    stores = [SsdStore(config, geo, "model", rank) for rank in range(geo.tp_size)]
    assert all(store.backend_name == backend for store in stores)
    return stores


def write(root: Path, geo: KvGeometry, backend: str) -> dict[tuple[str, int], list[np.ndarray]]:
    stores = open_stores(root, geo, backend)
    rng = np.random.default_rng(0)
    truth = {}
    for sid in ("a", "b:2"):
        for rank, store in enumerate(stores):
            blocks = []
            for k in range(6):  # aligned and plain numpy buffers alike
                block = aligned_empty(geo.block_bytes) if k % 2 else np.empty(geo.block_bytes,
                                                                                np.uint8)
                block[:] = rng.integers(0, 256, geo.block_bytes, dtype=np.uint8)
                blocks.append(block)
            store.write_blocks(sid, np.arange(4), blocks[:4])
            store.write_blocks(sid, np.arange(4, 6), blocks[4:])  # an append
            truth[(sid, rank)] = blocks
        assert stores[0].commit_manifest(sid)
    for store in stores:
        store.close()
    return truth


def read_back(root: Path, geo: KvGeometry, backend: str,
              truth: dict[tuple[str, int], list[np.ndarray]]) -> None:
    for rank, store in enumerate(open_stores(root, geo, backend)):
        for sid in ("a", "b:2"):
            for aligned in (False, True):
                out = [aligned_empty(geo.block_bytes) if aligned
                       else np.empty(geo.block_bytes, np.uint8) for _ in range(6)]
                assert store.read_blocks(sid, np.arange(6)[::-1], out).all()
                for got, want in zip(out, truth[(sid, rank)][::-1]):
                    np.testing.assert_array_equal(got, want)
        store.close()


@pytest.mark.parametrize("geo", GEOMS, ids=lambda g: str(g.block_bytes))
def test_kvikio_round_trip_writes_the_same_bytes_as_posix(
        tmp_path: Path, geo: KvGeometry, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kvikio")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # Segment ids are random; fix them so that the two trees can be compared byte for byte.
    monkeypatch.setattr(session_io, "new_segment_id", lambda: 0x5EED_0000_0000_0001)
    truth = write(tmp_path / "posix", geo, "posix")
    assert write(tmp_path / "kvikio", geo, "kvikio").keys() == truth.keys()
    posix, kvikio = tree(tmp_path / "posix"), tree(tmp_path / "kvikio")
    assert sorted(posix) == sorted(kvikio) and len(posix) == 2 * 2 * 2 + 2
    for name in posix:
        assert posix[name] == kvikio[name], name
    # Each backend reads what the other wrote.
    read_back(tmp_path / "posix", geo, "kvikio", truth)
    read_back(tmp_path / "kvikio", geo, "posix", truth)
    read_back(tmp_path / "kvikio", geo, "kvikio", truth)


def test_auto_picks_kvikio_only_with_gds(tmp_path: Path) -> None:
    kvikio = pytest.importorskip("kvikio")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from tpkv.ssd.backend import _gds_active

    store = SsdStore(SsdConfig(root=str(tmp_path), backend="auto"), GEOMS[1], "model", 0)
    assert store.backend_name == ("kvikio" if _gds_active(kvikio) else "posix")
    print(f"GDS active: {_gds_active(kvikio)}; auto took {store.backend_name}")
    store.close()
