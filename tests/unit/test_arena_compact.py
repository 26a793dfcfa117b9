"""RowArena's compaction (kernel compact_extents) and its early run between steps (make_room)."""

from __future__ import annotations

import numpy as np

from tpkv.controller.arena import RowArena, extent_index


def _reference(a: RowArena, want: int) -> tuple[np.ndarray, np.ndarray, int]:
    """What _compact_or_grow made before compact_extents: numpy gathers into a fresh array."""
    live = np.flatnonzero(a.cap > 0)
    order = live[np.argsort(a.start[live], kind="stable")]
    caps, lens = a.cap[order], a.length[order]
    new_start = np.cumsum(caps) - caps
    size = len(a.arena)
    if a.live_cap + want > size - size // 8:
        size = (a.live_cap + want) * 3 // 2
    fresh = np.full(size, -1, dtype=np.int32)
    fresh[extent_index(new_start, lens)] = a.arena[extent_index(a.start[order], lens)]
    start = a.start.copy()
    start[order] = new_start
    return fresh, start, int(caps.sum())


def _random_arena(rng: np.random.Generator, sessions: int) -> RowArena:
    """Sessions appended to in random order and amounts, some released: extents moved to the
    end, dead space between them."""
    a = RowArena(sessions, capacity=64)
    row = 0
    for _ in range(int(rng.integers(1, 60))):
        chosen = np.unique(rng.integers(0, sessions, int(rng.integers(1, sessions + 1))))
        counts = rng.integers(0, 12, len(chosen)).astype(np.int64)
        a.append(chosen, counts, np.arange(row, row + int(counts.sum()), dtype=np.int32))
        row += int(counts.sum())
        if rng.random() < 0.2:
            s = int(rng.integers(0, sessions))
            if a.cap[s]:
                a.release(s)
    return a


def test_compaction_is_the_numpy_compaction() -> None:
    """Same arena contents (-1 past rows and past the top), starts and top as the numpy code,
    in place and into a larger arena; every session keeps its rows."""
    rng = np.random.default_rng(3)
    grown = in_place = 0
    for _ in range(300):
        a = _random_arena(rng, int(rng.integers(1, 40)))
        rows = [a.rows(s).copy() for s in range(len(a.start))]
        want = int(rng.choice([0, 0, 8, 1000]))
        arena, start, top = _reference(a, want)
        before = len(a.arena)
        a._compact_or_grow(want)
        grown += len(a.arena) > before
        in_place += len(a.arena) == before
        assert np.array_equal(a.arena, arena)
        assert np.array_equal(a.start[a.cap > 0], start[a.cap > 0])
        assert a.top == top
        assert all(np.array_equal(a.rows(s), r) for s, r in enumerate(rows))
    assert grown > 20 and in_place > 20


def test_make_room_compacts_only_when_the_end_is_near() -> None:
    a = RowArena(4, capacity=4096)
    a.append(np.array([0, 1]), np.array([8, 8]), np.arange(16, dtype=np.int32))
    row = 16
    assert not a.make_room()  # (nearly all of it free)
    while a.top <= len(a.arena) - len(a.arena) // 16:
        n = int(a.cap[0] - a.length[0]) + 1  # outgrow the extent: it moves to the end
        a.append(np.array([0]), np.array([n]), np.arange(row, row + n, dtype=np.int32))
        row += n
        if a.top <= len(a.arena) - len(a.arena) // 16:
            assert not a.make_room()
    size, rows = len(a.arena), (a.rows(0).copy(), a.rows(1).copy())
    assert a.make_room()
    assert a.top == int(a.cap.sum()) and len(a.arena) == size
    assert np.array_equal(a.rows(0), rows[0]) and np.array_equal(a.rows(1), rows[1])
    assert (a.arena[a.top:] == -1).all()
    assert not a.make_room()
