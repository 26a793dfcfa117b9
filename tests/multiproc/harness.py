"""Multiprocess harness: spawn TP ranks on CPU (gloo), a seeded workload, byte-pattern checks."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from tpkv.config import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.launch.bootstrap import EXTERNAL_STORE_ENV, free_port
from tpkv.protocol.plan import Tier

RankFn = Callable[..., dict[str, Any]]


def make_config(tp: int, ssd_root: str | None, l1: int = 16, l2: int = 16, l3: int = 256,
                wait_timeout_s: float = 20.0, heartbeat_s: float = 0.25,
                num_layers: int = 3) -> TpkvConfig:
    """Tiny blocks (num_layers x 2 x 4 tokens x 1 head x 8 dims, fp16 = 192 B a layer), small
    tiers so that nearly every step moves blocks; per-layer H2D copies (layer_chunk_bytes=1)."""
    g = KvGeometry(num_layers=num_layers, num_kv_heads=tp, head_dim=8, dtype="float16",
                   block_tokens=4, tp_size=tp)
    l3_cfg = (SsdConfig(root=ssd_root, budget_bytes=l3 << 20, o_direct=False, io_threads=2)
              if ssd_root else SsdConfig())
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=l1),
                      l2=HostConfig(budget_bytes=l2 * tp * g.block_bytes, arena_bytes=64 << 10),
                      l3=l3_cfg, policy=PolicyConfig(cooldown_s=0.0),
                      wait_timeout_s=wait_timeout_s, heartbeat_s=heartbeat_s,
                      layer_events=True, layer_chunk_bytes=1)


class Workload:
    """A seeded stream of steps over a rotating set of sessions (the same on every rank)."""

    def __init__(self, seed: int, num_sessions: int = 12, max_tokens: int = 20) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_tokens = max_tokens
        self.next_id = 0
        self.tokens: dict[str, int] = {}
        self.unannounced = [self._new() for _ in range(num_sessions)]

    def _new(self) -> str:
        name = f"s{self.next_id}"
        self.next_id += 1
        self.tokens[name] = 0
        return name

    def next(self) -> tuple[list[str], list[str], list[int], list[str]]:
        """(closed sessions, opened sessions, batch, new tokens per batch session)."""
        fresh, self.unannounced = self.unannounced, []
        closed = [n for n, t in self.tokens.items() if t >= self.max_tokens]
        closed += [n for n in self.tokens
                   if self.rng.random() < 0.01 and n not in closed and n not in fresh]
        for name in closed:
            del self.tokens[name]
        opened = fresh + [self._new() for _ in closed]
        names = sorted(self.tokens)
        size = int(self.rng.integers(1, 3))
        batch = [names[i] for i in self.rng.choice(len(names), size, replace=False)]
        add = [int(self.rng.integers(1, 6)) for _ in batch]
        for name, n in zip(batch, add):
            self.tokens[name] += n
        return closed, opened, batch, add


def pattern(block_id: int, rank: int, block_bytes: int) -> np.ndarray:
    """The bytes a block holds on a rank: recognisable per (block, rank)."""
    words = np.arange(block_bytes // 8, dtype=np.int64) + block_id * 1_000_003 + rank * 7919
    return words.view(np.uint8)


def write_fresh(worker: Any, step: Any, rank: int) -> None:
    """What the engine would do: write KV of new and recomputed blocks into their L1 slots."""
    g = worker.hbm.geometry
    for bid, slot in zip(step.fresh_block_ids.tolist(), step.fresh_slots.tolist()):
        dst = worker.hbm.tensor[slot].reshape(-1).view(torch.uint8)
        dst.copy_(torch.from_numpy(pattern(bid, rank, g.block_bytes)))


def workload_step(rt: Any, workload: Workload, rank: int,
                  forward: Callable[[Any], Any] | None = None) -> None:
    """One step of the random workload: close and open its sessions, run its batch; the
    forward pass writes the fresh blocks' pattern (or is `forward`, which should)."""
    closed, opened, batch, add = workload.next()
    for name in closed:
        rt.close_session(name)
    for name in opened:
        rt.open_session(name)
    rt.run_step(batch, add, forward or (lambda step: write_fresh(rt.worker, step, rank)))


def check_against_controller(rt: Any) -> dict[str, int]:
    """Every rank: its slot map equals the controller's, and every block's bytes are its own."""
    ctl, mine = rt.controller_slot_map(), rt.worker.slot_map()

    def table(m: dict[str, Any]) -> list[tuple[int, int, int, str, int]]:
        names = m["session_names"]
        return sorted(zip(np.asarray(m["block_ids"]).tolist(), np.asarray(m["tiers"]).tolist(),
                          np.asarray(m["slots"]).tolist(),
                          [names[i] for i in np.asarray(m["session_idx"]).tolist()],
                          np.asarray(m["logical_idx"]).tolist()))

    assert table(ctl) == table(mine), f"rank {rt.rank}: slot map differs from the controller's"
    assert ctl["digest"] == mine["digest"]
    w, g = rt.worker, rt.worker.hbm.geometry
    w.executor.synchronize()  # background spills: their records are on disk from here on
    if rt.world_size > 1:  # and on every rank's disk: a manifest completes once all ranks wrote
        rt.ctx.ctl.barrier("spills written")
    on_ssd = {session for _, tier, _, session, _ in table(mine) if tier == Tier.SSD}
    for session in sorted(on_ssd):  # what a load does first (SpillTracker.await_manifest)
        w.store.commit_manifest(session)
    counts = {"l1": 0, "l2": 0, "l3": 0}
    buf = np.zeros(g.block_bytes, dtype=np.uint8)
    for bid, tier, slot, session, logical in table(mine):
        want = pattern(bid, rt.rank, g.block_bytes)
        if tier == Tier.HBM:
            got = w.hbm.tensor[slot].reshape(-1).view(torch.uint8).cpu().numpy()
            counts["l1"] += 1
        elif tier == Tier.DRAM:
            got = w.host.block_bytes_view(slot)
            counts["l2"] += 1
        elif tier == Tier.SSD:
            hit = w.store.read_blocks(session, np.array([logical]), [buf])
            assert hit[0], f"rank {rt.rank}: L3 block {bid} ({session}/{logical}) misses"
            got = buf
            counts["l3"] += 1
        else:
            continue
        assert np.array_equal(got, want), f"rank {rt.rank}: block {bid} on tier {tier} slot " \
                                          f"{slot} holds other bytes"
    return counts


# ---- spawning ranks --------------------------------------------------------------------------
def _child(fn: RankFn, rank: int, world: int, port: int, args: tuple[Any, ...],
           results: Any, release: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RAY_USAGE_STATS_ENABLED="0", **{EXTERNAL_STORE_ENV: "1"})
    torch.set_num_threads(1)
    started = time.monotonic()
    try:
        out = fn(rank, world, *args)
        results.put({"rank": rank, "ok": True, **out})
    except BaseException as exc:  # reported to the test, which asserts on it
        results.put({"rank": rank, "ok": False, "error": type(exc).__name__,
                     "message": str(exc), "ranks": list(getattr(exc, "ranks", ()) or ()),
                     "at_s": time.monotonic() - started,
                     "failed_at": time.monotonic(), "trace": traceback.format_exc()[-3000:]})
    release.wait(60)
    os._exit(0)  # no process-group teardown: a peer may be dead or hung on purpose


def run_ranks(fn: RankFn, world: int, *args: Any, timeout_s: float = 150.0,
              expect: int | None = None) -> dict[int, dict[str, Any]]:
    """Run fn(rank, world, *args) in `world` spawned processes; the parent hosts the store.
    Waits for `expect` reports (default: all ranks), then ends the processes it started."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results, release),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < (world if expect is None else expect):
            try:
                item = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            out[item["rank"]] = item
    finally:
        release.set()
        for p in procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
    return out
