"""SlotMirror.session_logical through the mirror's per-session index: exactly what a scan of the
whole map gives, after any sequence of updates, without a pass over the map."""

from __future__ import annotations

import tracemalloc

import numpy as np

from tpkv.protocol.plan import MovePlan, Tier
from tpkv.workers.mirror import SlotMirror
from tpkv.workers.slots import SlotAllocator

NONE, H, D, S = int(Tier.NONE), int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)
NAMES = [f"s{i}" for i in range(6)]


def _scan(m: SlotMirror, name: str, tier: int) -> list[int]:
    """session_logical as a pass over the whole map (how it was computed before the index)."""
    i = m._name_idx.get(name)
    if i is None:
        return []
    rows = np.flatnonzero((m.session == i) & (m.tier == tier) & (m.ids >= 0))
    return np.sort(m.logical[rows]).tolist()


def _free_slot(m: SlotMirror, tier: int, rng: np.random.Generator, taken: set[int]) -> int:
    free = [s for s in np.flatnonzero(m.owner[tier] < 0).tolist() if s not in taken]
    return int(rng.choice(free)) if free else -1


class Driver:
    """Random updates of a mirror as a rank makes them: new blocks, moves between tiers, drops,
    sessions closed and opened again, rows reused, a resync."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.m = SlotMirror(SlotAllocator(12, "L1"), SlotAllocator(16, "L2"), capacity=8)
        self.gen = np.zeros(48, dtype=np.int64)  # table rows 0..47, generation of each
        self.next_logical = dict.fromkeys(NAMES, 0)

    def live(self) -> np.ndarray:
        return self.m.ids[self.m.ids >= 0]

    def _new_blocks(self, name: str, k: int, reuse: bool) -> None:
        """k new blocks of the session: in free table rows, or (reuse) rows whose block holds
        no L1/L2 slot, taken over without a release."""
        m, rng = self.m, self.rng
        used = np.zeros(len(self.gen), dtype=bool)
        live = self.live()
        used[live & 0xFFFFFFFF] = True
        if reuse:
            rows = [int(r) for r in live & 0xFFFFFFFF if m.tier[r] in (S, NONE)]
        else:
            rows = np.flatnonzero(~used).tolist()
        if not rows:
            return
        rows = rng.choice(rows, min(k, len(rows)), replace=False)
        self.gen[rows] += 1
        ids = (self.gen[rows] << 32) | rows
        tiers, slots, taken = [], [], {H: set(), D: set()}
        for _ in rows:
            t = int(rng.choice([H, D, S]))
            s = _free_slot(m, t, rng, taken[t]) if t != S else -1
            if t != S and s < 0:
                t = S
            if t != S:
                taken[t].add(s)
            tiers.append(t)
            slots.append(s)
        start = self.next_logical[name]
        self.next_logical[name] += len(rows)
        logical = np.arange(start, start + len(rows))
        if all(t == H for t in tiers) and rng.random() < 0.5:
            m.add_fresh(ids, np.array(slots), [name] * len(rows), logical)
        else:
            m.put(ids, np.array(tiers), np.array(slots), [name] * len(rows), logical)

    def _moves(self) -> None:
        """A plan of moves between tiers, some of them refused here (check)."""
        m, rng = self.m, self.rng
        live = self.live()
        live = live[m.where(live)[0] != NONE]  # (dropped blocks have nothing to move)
        if not len(live):
            return
        ids = rng.choice(live, min(len(live), int(rng.integers(1, 8))), replace=False)
        src_tier, src_slot = m.where(ids)
        dst_tier, dst_slot, taken = [], [], {H: set(), D: set()}
        for t in src_tier.tolist():
            d = int(rng.choice([x for x in (H, D, S) if x != t]))
            s = _free_slot(m, d, rng, taken[d]) if d != S else -1
            if d != S and s < 0:
                d, s = S, -1
            if d != S:
                taken[d].add(s)
            dst_tier.append(d)
            dst_slot.append(s)
        if rng.random() < 0.2:  # a move that does not start where this rank holds the block
            src_tier = src_tier.copy()
            src_tier[0] = H if src_tier[0] != H else D
        n = len(ids)
        plan = MovePlan(1, ids, src_tier, src_slot, np.array(dst_tier), np.array(dst_slot),
                        np.zeros(n, dtype=np.int64), np.arange(n), ("x",))
        m.apply(plan, m.check(plan))

    def step(self) -> str:
        m, rng = self.m, self.rng
        op = str(rng.choice(["new", "reuse", "move", "drop", "close", "release_some", "reput",
                             "resync"], p=[.3, .05, .3, .1, .1, .05, .05, .05]))
        live = self.live()
        if op in ("new", "reuse"):
            self._new_blocks(str(rng.choice(NAMES)), int(rng.integers(1, 6)), op == "reuse")
        elif op == "move":
            self._moves()
        elif op == "drop" and len(live):
            m.drop(rng.choice(live, min(len(live), 3), replace=False))
        elif op == "close":  # a session closes: all its blocks go (it may open again)
            name = str(rng.choice(NAMES))
            i = m._name_idx.get(name, -2)
            m.release(m.ids[(m.session == i) & (m.ids >= 0)])
            self.next_logical[name] = 0
        elif op == "release_some" and len(live):
            m.release(rng.choice(live, min(len(live), 2), replace=False))
        elif op == "reput" and len(live):  # known blocks placed again, under another session
            ids = rng.choice(live, min(len(live), 2), replace=False)
            tier, slot = m.where(ids)
            names = [str(rng.choice(NAMES)) for _ in ids]
            m.put(ids, tier, slot, names, np.arange(100, 100 + len(ids)))
        elif op == "resync":  # the controller's map (this one's, some blocks on L3) as truth
            out = m.export()
            flip = (out["tiers"] == D) & (rng.random(len(out["tiers"])) < 0.3)
            out["tiers"][flip], out["slots"][flip] = S, -1
            m.restore(out)
        return op


def test_session_logical_matches_a_scan_of_the_map_over_random_updates() -> None:
    ops: dict[str, int] = {}
    stale = 0  # steps after which the index held rows no longer their session's
    for seed in range(30):
        drv = Driver(seed)
        for _ in range(150):
            op = drv.step()
            ops[op] = ops.get(op, 0) + 1
            stale += any((drv.m.session[c] != i).any() for i, cs in drv.m._rows.items()
                         for c in cs)
            for name in [*NAMES, "never"]:
                for tier in (NONE, H, D, S):
                    assert drv.m.session_logical(name, tier).tolist() == _scan(drv.m, name, tier), \
                        (seed, op, name, tier)
    assert min(ops.values()) > 50 and len(ops) == 8  # every kind of update ran, often
    assert stale > 50  # lookups had rows to leave out
    # the map grew past its first capacity, and its rows were reused
    assert len(drv.m.ids) > 8 and int(drv.gen.max()) > 1


def test_the_index_forgets_closed_sessions_and_stays_small() -> None:
    """A session whose blocks are all released leaves nothing in the index; one that puts one
    block at a time keeps its rows in a few arrays."""
    m = SlotMirror(SlotAllocator(4, "L1"), SlotAllocator(4, "L2"), capacity=8)
    for k in range(200):
        m.put(np.array([k]), np.array([S]), np.array([-1]), ["a"], np.array([k]))
    m.put(np.array([500, 501]), np.array([S, S]), np.array([-1, -1]), ["b", "b"],
          np.arange(2))
    assert len(m._rows[m._name_idx["a"]]) <= 17
    assert m.session_logical("a", S).tolist() == list(range(200))
    m.release(np.arange(200))
    assert m._name_idx["a"] not in m._rows and m.session_logical("a", S).tolist() == []
    assert m.session_logical("b", S).tolist() == [0, 1]


def test_session_logical_makes_no_pass_over_the_whole_map() -> None:
    """A lookup of a session of 8 blocks in a map of 1 Mi rows allocates nothing near the size
    of the map (a scan makes masks of 1 MiB and more): its cost is the session's, not the
    table's (Returns.sample makes one per turn waiting outside the batch, every step)."""
    m = SlotMirror(SlotAllocator(4, "L1"), SlotAllocator(4, "L2"), capacity=1 << 20)
    rows = np.arange(8) * (1 << 17)
    m.put(rows, np.full(8, S), np.full(8, -1), ["a"] * 8, np.arange(8))
    m.put(np.arange(1, 1001), np.full(1000, S), np.full(1000, -1), ["b"] * 1000,
          np.arange(1000))
    assert m.session_logical("a", S).tolist() == list(range(8))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        on3 = m.session_logical("a", S)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert on3.tolist() == list(range(8))
    assert peak < 64 << 10, f"session_logical allocated {peak} bytes at its peak"


def test_an_unchanged_sessions_answer_is_kept_and_read_only() -> None:
    """A turn outside the batch is asked about every step: while none of its session's rows
    changes, session_logical gives the same read-only array; a change to another session
    keeps it, one to its own rows (a move, a drop, a release) gives a new answer. (The random
    updates above check each answer against a scan of the map.)"""
    m = SlotMirror(SlotAllocator(4, "L1"), SlotAllocator(4, "L2"), capacity=16)
    m.put(np.arange(3), np.full(3, S), np.full(3, -1), ["a"] * 3, np.arange(3))
    m.put(np.arange(3, 5), np.full(2, S), np.full(2, -1), ["b"] * 2, np.arange(2))
    first = m.session_logical("a", S)
    assert not first.flags.writeable and first.tolist() == [0, 1, 2]
    m.drop(np.array([4]))  # session b's
    assert m.session_logical("a", S) is first
    plan = MovePlan(epoch=1, block_ids=np.array([1]), src_tier=np.array([S], np.int8),
                    src_slot=np.array([-1]), dst_tier=np.array([D], np.int8),
                    dst_slot=np.array([2]), session_idx=np.array([0], np.int32),
                    logical_idx=np.array([1]), session_names=("a",))
    m.apply(plan, np.ones(1, dtype=bool))
    moved = m.session_logical("a", S)
    assert moved is not first and moved.tolist() == [0, 2]
    assert m.session_logical("a", D).tolist() == [1]
    m.drop(np.array([0]))
    assert m.session_logical("a", S).tolist() == [2]
    m.release(np.arange(3))
    assert m.session_logical("a", S).tolist() == [] and m.session_logical("a", D).tolist() == []
