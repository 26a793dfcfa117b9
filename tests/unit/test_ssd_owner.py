"""L3 root ownership: one live store per (root, rank); a dead owner's root is reused warm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tpkv.config import KvGeometry, SsdConfig
from tpkv.errors import ConfigError, SsdRootInUseError
from tpkv.ssd.store import SsdStore

GEO = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", block_tokens=2,
                 tp_size=2)
MODEL = "owner-model"
SESSION = "chat-1"  # both "runtimes" use the same session id


def stores(root: Path, ranks: tuple[int, ...] = (0, 1)) -> list[SsdStore]:
    cfg = SsdConfig(root=str(root), backend="posix", o_direct=False, io_threads=1)
    return [SsdStore(cfg, GEO, MODEL, rank) for rank in ranks]


def blocks(value: int, count: int, rank: int) -> list[np.ndarray]:
    return [np.full(GEO.block_bytes, value + 16 * rank + k, np.uint8) for k in range(count)]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_two_runtimes_on_one_root_never_serve_each_other(tmp_path: Path) -> None:
    """Runtime A (TP 2: its two ranks share the root) writes a session; runtime B, same model,
    same session id, same root, would append to A's segment and commit over A's records (A then
    read B's K/V as hits). B's first store is refused and writes nothing."""
    a = stores(tmp_path)
    for store in a:
        store.write_blocks(SESSION, np.arange(4), blocks(1, 4, store.rank))
    assert a[0].commit_manifest(SESSION)
    before = tree(tmp_path)
    with pytest.raises(SsdRootInUseError) as info:
        b = stores(tmp_path)  # what a second runtime on the same disk would do with the root
        for store in b:
            store.write_blocks(SESSION, np.arange(2), blocks(101, 2, store.rank))
        b[0].commit_manifest(SESSION)
    msg = str(info.value)
    assert str(tmp_path) in msg and "rank 0" in msg and f"pid {os.getpid()}" in msg
    assert MODEL in msg
    assert isinstance(info.value, ConfigError)
    assert tree(tmp_path) == before  # nothing written, not even the lock's text
    for store in a:  # A reads its own bytes, all of them
        out = [np.empty(GEO.block_bytes, np.uint8) for _ in range(4)]
        assert store.read_blocks(SESSION, np.arange(4), out).all()
        for got, want in zip(out, blocks(1, 4, store.rank)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(SsdRootInUseError, match="rank 1"):  # each rank is owned on its own
        stores(tmp_path, ranks=(1,))
    for store in a:
        store.close()
    again = stores(tmp_path)  # closed: a restart of A takes the root and its records back
    assert again[0].list_sessions() == [SESSION]
    for store in again:
        store.close()


_HOLDER = textwrap.dedent("""
    import sys
    import numpy as np
    from tpkv.config import KvGeometry, SsdConfig
    from tpkv.ssd.store import SsdStore
    geo = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16",
                     block_tokens=2, tp_size=2)
    cfg = SsdConfig(root=sys.argv[1], backend="posix", o_direct=False, io_threads=1)
    stores = [SsdStore(cfg, geo, "owner-model", rank) for rank in (0, 1)]
    for s in stores:
        s.write_blocks("chat-1", np.arange(3),
                       [np.full(geo.block_bytes, 7 + 16 * s.rank + k, np.uint8)
                        for k in range(3)])
    assert stores[0].commit_manifest("chat-1")
    print("ready", flush=True)
    sys.stdin.read()  # held until killed
""")


def test_another_process_is_refused_until_the_owner_dies_then_its_records_are_reused(
        tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        for rank in (0, 1):
            with pytest.raises(SsdRootInUseError, match=f"rank {rank} .*pid {holder.pid}"):
                stores(tmp_path, ranks=(rank,))
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops its locks
        holder.wait(timeout=30)
    warm = stores(tmp_path)  # the restarted node, same fingerprint: its records are hits
    try:
        assert warm[0].list_sessions() == [SESSION]
        for store in warm:
            out = [np.empty(GEO.block_bytes, np.uint8) for _ in range(3)]
            assert store.read_blocks(SESSION, np.arange(3), out).all()
            for got, want in zip(out, blocks(7, 3, store.rank)):
                np.testing.assert_array_equal(got, want)
    finally:
        for store in warm:
            store.close()
