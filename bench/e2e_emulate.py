"""bench/e2e.py's emulated L3 (a RAM-backed directory paced to a given GB/s) and its 8B shape."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.transfer import raw_odirect
from tpkv.config import GiB
from tpkv.models.llama import ModelConfig

# Llama-3.1-8B shapes: 32 layers x 8 KV heads x head dim 128 x (K, V) x 2 bytes = 128 KiB of
# KV per token (the 1b preset's: 32 KiB), 8.0e9 parameters (16 GB in bf16).
MODELS = {"8b": ModelConfig(vocab_size=128_256, hidden_size=4096, num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, intermediate_size=14_336,
                            rope_theta=500_000.0, dtype="bfloat16")}
GPU_BYTES = 139 * GiB  # one H200 as the device reports it
HOST_BYTES = 128 * GiB  # its host's memory


def model_config(name: str) -> ModelConfig:
    """A tpkv preset, or one of MODELS (shapes only: the bench seeds the weights)."""
    return MODELS[name] if name in MODELS else ModelConfig.preset(name)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return cfg.kv_geometry(tp_size=1, block_tokens=1).block_bytes


def fit(cfg: ModelConfig, sizes: Any, configs: list[str], in_ram: list[str]) -> dict[str, Any]:
    """Bytes the largest configuration asks of the GPU (weights, L1, 2 GiB of activations and
    graphs) and of the host (its L2, its L3 when it is emulated in RAM: `in_ram`, 4 GiB for the
    process), against one H200 and its host (`fits`)."""
    weights = cfg.num_params() * cfg.torch_dtype.itemsize
    gpu = weights + int(sizes.l1_gib * GiB) + 2 * GiB
    l2 = {"b": sizes.l2_gib, "b2": sizes.l2_all_gib, "c": sizes.l2_gib, "c2": sizes.l2_gib,
          "c3": sizes.l2_gib}
    l3 = {"c": sizes.l3_gib, "c2": sizes.l3_gib, "c3": sizes.l3_all_gib}
    host = max((l2.get(k, 0.0) + (l3.get(k, 0.0) if k in in_ram else 0.0)) * GiB
               for k in [*configs, *in_ram, "a"]) + 4 * GiB
    per_token = kv_bytes_per_token(cfg)
    session = sum(sizes.context) / 2 * per_token
    out = {"kv_bytes_per_token": per_token, "mean_session_gib": round(session / GiB, 3),
           "all_sessions_gib": round(sizes.sessions * session / GiB, 1),
           "gpu_gib": round(gpu / GiB, 1), "host_gib": round(host / GiB, 1),
           "fits": gpu <= GPU_BYTES and host <= HOST_BYTES}
    return out


class Pace:
    """One direction of an emulated disk at `gbps`: each I/O, once done, takes the next
    interval of its length at that rate (from when it began, or when the last one ends) and
    returns at the interval's end. Late: I/Os (and their seconds) that ended after their
    interval: the store's own path (system calls, checksums, its threads) slower than the
    pace. With many late calls the emulated disk ran slower than it says: read the rate off
    the run's bytes and times, not the label."""

    def __init__(self, gbps: float) -> None:
        self.rate = gbps * 1e9
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.bytes = self.calls = self.late_calls = 0
        self.sleep_s = self.late_s = 0.0

    def wait(self, nbytes: int, began: float) -> None:
        with self._lock:
            start = max(began, self._free_at)
            end = self._free_at = start + nbytes / self.rate
            self.bytes += nbytes
            self.calls += 1
        left = end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        with self._lock:
            if left > 0:
                self.sleep_s += left
            else:
                self.late_s -= left
                self.late_calls += 1

    def stats(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "calls": self.calls, "sleep_s": round(self.sleep_s, 3),
                "late_calls": self.late_calls, "late_s": round(self.late_s, 3)}


class PacedStore:
    """Paces a built SsdStore's disk reads (its session reader's `read`, which a step's
    reads and the reads ahead of returning sessions both call through the instance; blocks
    served from what was read ahead are memory copies, not paced) and its write_blocks (its
    writer threads call it through the instance), in place; the library is untouched.
    paced_read_share: the bytes paced over those the store's read meter counted (below 1:
    some disk read bypassed the paced path and ran at RAM speed)."""

    def __init__(self, store: Any, gbps: float) -> None:
        self.store, self.gbps = store, gbps
        self.reads, self.writes = Pace(gbps), Pace(gbps)
        disk = store._sessions  # noqa: SLF001 (the emulation's one hook into the store)
        read, write, bb = disk.read, store.write_blocks, store.block_bytes

        def read_records(sid: str, paths: Any, indices: Any, out: Any, hits: Any) -> None:
            began = time.perf_counter()
            read(sid, paths, indices, out, hits)
            self.reads.wait(len(out) * bb, began)

        def write_blocks(session_id: str, logical_idx: Any, blocks: Any, *rest: Any) -> int:
            began = time.perf_counter()
            added = write(session_id, logical_idx, blocks, *rest)
            self.writes.wait(len(blocks) * bb, began)
            return int(added)

        disk.read, store.write_blocks = read_records, write_blocks

    def stats(self) -> dict[str, Any]:
        metered = self.store.read_stats().bytes
        return {"gbps": self.gbps, "reads": self.reads.stats(), "writes": self.writes.stats(),
                "paced_read_share": round(self.reads.bytes / metered, 3) if metered else None}


def mount_of(path: str, mounts: str | None = None) -> dict[str, Any]:
    """The mount that holds `path` (the longest mount point above it in /proc/self/mounts, or
    `mounts`, that file's text): its point, file system type and options, and whether it
    allocates huge pages (a tmpfs with huge= always or within_size)."""
    if mounts is None:
        mounts = Path("/proc/self/mounts").read_text()
    real = os.path.realpath(path)
    best: tuple[str, str, str] = ("", "", "")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        above = real == point or real.startswith(point.rstrip("/") + "/")
        if above and len(point) >= len(best[0]):
            best = (point, parts[2], parts[3])
    options = best[2].split(",") if best[2] else []
    huge = best[1] == "tmpfs" and any(o in ("huge=always", "huge=within_size") for o in options)
    return {"mount": best[0], "fs": best[1], "options": options, "huge_pages": huge}


def dir_speed(path: str, num_bytes: int = 256 << 20, request_bytes: int = 16 << 20
              ) -> dict[str, float]:
    """One thread's write then read of a fresh file of `num_bytes` in `path` (GB/s), through
    the page cache: what a store's thread can move there, the emulation's own ceiling per
    thread."""
    speed = raw_odirect(Path(path) / f".tpkv-speed-{os.getpid()}", num_bytes, request_bytes,
                        direct=False)
    return {k: round(v, 2) for k, v in speed.items()}
