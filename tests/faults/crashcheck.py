"""Shared by the crash tests: a workload with known block bytes, and the after-crash check."""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tpkv.config import KvGeometry, SsdConfig
from tpkv.ssd.store import SsdStore

# One 4096-byte block per rank (1 layer x K,V x 16 tokens x 1 head x 64 x fp16), TP 2.
GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=2, head_dim=64, dtype="float16",
                      block_tokens=16, tp_size=2)
MODEL = "crash-model"
SESSIONS = tuple(f"sess-{k:02d}" for k in range(10))
MAX_INDEX = 8  # logical indices 0..7
_MAGIC = 0x7C0FFEE5


@functools.lru_cache(maxsize=1024)  # 4 MiB at most
def block_bytes_of(sid: str, rank: int, idx: int, version: int,
                   geo: KvGeometry = GEOMETRY) -> np.ndarray:
    """The one image a (session, rank, index, version) ever has: a tagged header, then noise.
    Read-only (cached)."""
    seed = int.from_bytes(hashlib.sha256(f"{sid}/{rank}/{idx}/{version}".encode()).digest()[:8],
                          "little")
    out = np.random.default_rng(seed).integers(0, 256, geo.block_bytes, dtype=np.uint8)
    tag = struct.pack("<IIqq", _MAGIC, rank, idx, version) + sid.encode()[:16].ljust(16, b"\0")
    out[:len(tag)] = np.frombuffer(tag, dtype=np.uint8)
    out.setflags(write=False)
    return out


def open_stores(root: str | Path, geo: KvGeometry = GEOMETRY, model: str = MODEL,
                o_direct: bool = False) -> list[SsdStore]:
    config = SsdConfig(root=str(root), backend="posix", io_threads=1, o_direct=o_direct,
                       budget_bytes=1 << 34)
    return [SsdStore(config, geo, model, rank) for rank in range(geo.tp_size)]


def close_stores(stores: Sequence[SsdStore]) -> None:
    for store in stores:
        store.close()


@dataclass(frozen=True)
class Op:
    """`put`: write `versions` ({index: version}) on every rank, then the manifest; `drop`."""

    kind: str
    sid: str
    versions: tuple[tuple[int, int], ...] = ()

    def to_list(self) -> list:
        return [self.kind, self.sid, [list(p) for p in self.versions]]

    @classmethod
    def from_list(cls, raw: list) -> Op:
        return cls(raw[0], raw[1], tuple((int(i), int(v)) for i, v in raw[2]))


def run_op(stores: Sequence[SsdStore], op: Op) -> None:
    """Carry an op out; on return the store says it is durable (the acknowledgement point)."""
    if op.kind == "drop":
        for store in stores:
            store.drop_session(op.sid)
        return
    indices = np.array([i for i, _ in op.versions], dtype=np.int64)
    for store in stores:
        blocks = [block_bytes_of(op.sid, store.rank, i, v) for i, v in op.versions]
        store.write_blocks(op.sid, indices, blocks)
    if not stores[0].commit_manifest(op.sid):
        raise AssertionError(f"commit_manifest refused {op.sid} after every rank wrote it")


@dataclass
class Model:
    """What must read back: acknowledged sessions {sid: {index: version}}; the op in flight."""

    acked: dict[str, dict[int, int]] = field(default_factory=dict)
    inflight: Op | None = None
    next_version: int = 1

    def pick(self, rng: np.random.Generator) -> Op:
        sid = SESSIONS[int(rng.integers(len(SESSIONS)))]
        if sid in self.acked and rng.random() < 0.15:
            return Op("drop", sid)
        count = int(rng.integers(1, 4))
        versions = []
        for idx in rng.choice(MAX_INDEX, size=count, replace=False):
            versions.append((int(idx), self.next_version))
            self.next_version += 1
        return Op("put", sid, tuple(versions))

    def ack(self, op: Op) -> None:
        if op.kind == "drop":
            self.acked.pop(op.sid, None)
        else:
            self.acked[op.sid] = {**self.acked.get(op.sid, {}), **dict(op.versions)}
        self.inflight = None

    def allowed(self, sid: str, idx: int) -> set[int]:
        """Versions a hit of (sid, idx) may hold: the acknowledged one, or the in-flight one."""
        out = set()
        if idx in self.acked.get(sid, {}):
            out.add(self.acked[sid][idx])
        if self.inflight is not None and self.inflight.sid == sid:
            out.update(v for i, v in self.inflight.versions if i == idx)
        return out

    def must_hit(self, sid: str, idx: int) -> bool:
        inflight = self.inflight is not None and self.inflight.sid == sid
        return not inflight and idx in self.acked.get(sid, {})


@dataclass
class Tally:
    checked: int = 0  # blocks read after crashes
    hits: int = 0  # bit-exact hits
    wrong: int = 0  # hits whose bytes are not an allowed version (must stay 0)
    lost: int = 0  # acknowledged blocks that missed (must stay 0)
    dirty_misses: int = 0  # misses whose buffer was not zeroed (must stay 0)
    problems: list[str] = field(default_factory=list)

    def fail(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def verify(stores: Sequence[SsdStore], model: Model, tally: Tally, label: str,
           sessions: Sequence[str] = SESSIONS) -> None:
    """Every acknowledged block reads back bit-exact; every other one is a miss or (for the
    session in flight) one of the versions that op or the last acknowledged one wrote."""
    geo = stores[0].geometry
    for sid in sessions:
        for store in stores:
            out = [np.full(geo.block_bytes, 0xAB, dtype=np.uint8) for _ in range(MAX_INDEX)]
            hits = store.read_blocks(sid, np.arange(MAX_INDEX), out)
            for idx in range(MAX_INDEX):
                tally.checked += 1
                where = f"{label}: {sid} rank {store.rank} index {idx}"
                if hits[idx]:
                    if not any(np.array_equal(out[idx], block_bytes_of(sid, store.rank, idx, v))
                               for v in model.allowed(sid, idx)):
                        tally.wrong += 1
                        tally.fail(f"{where}: WRONG BYTES (allowed {model.allowed(sid, idx)})")
                    else:
                        tally.hits += 1
                else:
                    if out[idx].any():
                        tally.dirty_misses += 1
                        tally.fail(f"{where}: miss buffer not zeroed")
                    if model.must_hit(sid, idx):
                        tally.lost += 1
                        tally.fail(f"{where}: acknowledged version {model.acked[sid][idx]} lost")


def recover(stores: Sequence[SsdStore], model: Model, tally: Tally, label: str) -> None:
    """What a restarted node does: keep the complete sessions (manifests), drop the rest.

    Every acknowledged session not in flight must be listed by every rank; nothing else may be,
    bar the session in flight. The in-flight session is dropped (its blocks are recomputed)."""
    inflight = model.inflight.sid if model.inflight is not None else None
    want = {sid for sid in model.acked if sid != inflight}
    for store in stores:
        listed = set(store.list_sessions())
        if not want <= listed or not listed <= want | {inflight}:
            tally.fail(f"{label}: rank {store.rank} lists {sorted(listed)}, acked {sorted(want)}"
                       f", in flight {inflight}")
            tally.lost += len(want - listed)
            tally.wrong += len(listed - want - {inflight})
    for sid in SESSIONS:
        if sid not in want:
            for store in stores:
                store.drop_session(sid)
    if inflight is not None:
        model.acked.pop(inflight, None)
    model.inflight = None


def leftovers(root: str | Path) -> list[str]:
    """Temp files of an earlier life still under the root (a fresh store removes its own)."""
    return sorted(str(p) for p in Path(root).rglob("*.tmp"))


def files_outside(root: str | Path, parent: str | Path) -> list[str]:
    """Files below `parent` that are not below `root` (nothing may be written elsewhere)."""
    root_real = os.path.realpath(root)
    return sorted(str(p) for p in Path(parent).rglob("*")
                  if p.is_file() and not os.path.realpath(p).startswith(root_real + os.sep))
