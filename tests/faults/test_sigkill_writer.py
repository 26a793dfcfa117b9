"""SIGKILL the L3 spill writer at random points, hundreds of times: nothing acked is lost."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.faults.crashcheck import (
    GEOMETRY,
    MODEL,
    Model,
    Op,
    Tally,
    close_stores,
    files_outside,
    leftovers,
    open_stores,
    recover,
    run_op,
    verify,
)
from tests.faults.writer import KILLED, replay, spawn_and_kill, start_server
from tpkv.config import HbmConfig, HostConfig, KvGeometry, SsdConfig, TpkvConfig
from tpkv.controller.controller import Controller
from tpkv.controller.replica import SlotMapReplica
from tpkv.ssd import format as ssd_format

NUM_KILLS = int(os.environ.get("TPKV_CRASH_KILLS", "200"))
MAX_DELAY_S = 0.004  # after the awaited reports: lands before, inside or after the next op


def test_sigkilled_spill_writer_never_loses_acked_data_or_serves_wrong_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "l3"
    rng = np.random.default_rng(20261129)
    model, tally = Model(), Tally()
    acked_ops = mid_op_kills = early_kills = 0
    start_server()
    fds = len(os.listdir("/proc/self/fd"))
    for kill in range(NUM_KILLS):
        messages, exitcode = spawn_and_kill(root, model, seed=kill,
                                            wait_messages=int(rng.integers(0, 7)),
                                            delay_s=float(rng.uniform(0.0, MAX_DELAY_S)))
        acked_ops += replay(messages, model)
        assert exitcode == KILLED, f"kill {kill}: the writer exited with {exitcode}"
        early_kills += not messages  # before its first op (in fork or while opening)
        mid_op_kills += model.inflight is not None
        stores = open_stores(root)  # the restarted node
        assert leftovers(root) == [], f"kill {kill}: temp files survive a restart"
        verify(stores, model, tally, f"kill {kill}")
        recover(stores, model, tally, f"kill {kill}")
        verify(stores, model, tally, f"kill {kill} after recovery")
        close_stores(stores)
        assert tally.problems == [], tally.problems
    assert files_outside(root, tmp_path) == []
    # Pipes and restarted stores all closed (files of earlier tests may still be closing: a
    # leak can only make the count grow).
    assert len(os.listdir("/proc/self/fd")) <= fds
    # Stale data: the same directory under any other fingerprint, dtype, TP size, block size or
    # format version loads zero blocks; the original stores still read every acked block. (A
    # copy each: a stale store reclaims the files it can never read when it starts, and a copy
    # that lands after that still loads zero blocks.)
    stores = open_stores(root)
    extra = Op("put", "sess-00", ((7, model.next_version),))  # at least one session to find
    run_op(stores, extra)
    model.ack(extra)
    close_stores(stores)
    stale = _stale_geometries()
    for geo, model_name, version in stale:
        with monkeypatch.context() as patch:
            patch.setattr(ssd_format, "FORMAT_VERSION", version)
            copy = tmp_path / f"stale-{len(list(tmp_path.glob('stale-*')))}"
            stale_stores = open_stores(copy, geo, model_name)
            shutil.copytree(root, copy, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("owner.*"))
            for store in stale_stores:
                assert store.list_sessions() == []
                for sid in model.acked:
                    out = [np.empty(geo.block_bytes, np.uint8) for _ in range(8)]
                    assert not store.read_blocks(sid, np.arange(8), out).any()
                store.close()
    stores = open_stores(root)
    verify(stores, model, tally, "after the stale stores")
    _check_controller_rebuild(root, stores, model)
    close_stores(stores)
    assert tally.problems == [] and tally.wrong == 0 and tally.lost == 0
    assert acked_ops >= NUM_KILLS // 2 and mid_op_kills >= NUM_KILLS // 10  # the kills bit
    print(f"\nSIGKILL: kills={NUM_KILLS} mid_op={mid_op_kills} before_first_op={early_kills} "
          f"acked_ops={acked_ops} "
          f"blocks_checked={tally.checked} hits={tally.hits} wrong={tally.wrong} "
          f"lost={tally.lost} sessions_at_end={len(model.acked)} stale_stores={len(stale)}")


def _stale_geometries() -> list[tuple[KvGeometry, str, int]]:
    """One change each: model fingerprint, dtype (same block bytes), TP size, block size, format
    version."""
    g, v = GEOMETRY, ssd_format.FORMAT_VERSION
    return [
        (g, MODEL + "-v2", v),
        (KvGeometry(g.num_layers, g.num_kv_heads, g.head_dim, "bfloat16", g.block_tokens,
                    g.tp_size), MODEL, v),
        (KvGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.block_tokens, 1),
         MODEL, v),
        (KvGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, 2 * g.block_tokens,
                    g.tp_size), MODEL, v),
        (g, MODEL, v + 1),
    ]


def _check_controller_rebuild(root: Path, stores: list, model: Model) -> None:
    """A restarted controller rebuilt from the L3 manifests (no block in L1 or L2) holds every
    acked session, its acked indices in L3 and nothing else there (the rest is recomputed)."""
    g = GEOMETRY
    config = TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=16),
                        l2=HostConfig(budget_bytes=64 * g.block_bytes, arena_bytes=1 << 20),
                        l3=SsdConfig(root=str(root), budget_bytes=1 << 30),
                        model_fingerprint=MODEL)
    ctl = Controller(config, restarts=1, awaiting_rebuild=True)
    manifests = {sid: stores[0].session_indices(sid) for sid in stores[0].list_sessions()}
    summary = ctl.rebuild([SlotMapReplica(rank, 16, 32).export() for rank in range(2)],
                          manifests)
    assert summary["sessions"] == len(model.acked)
    for sid, versions in model.acked.items():
        blocks = ctl.session_blocks(sid)
        in_l3 = [idx for idx, tier in zip(blocks["logical"], blocks["tier"]) if tier == "L3"]
        assert in_l3 == sorted(versions), (sid, blocks["tier"])
    ctl.check_integrity()
