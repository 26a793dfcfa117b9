"""Per-session lists of block rows, stored as extents of one int32 arena (vectorized gathers)."""

from __future__ import annotations

import numpy as np

from tpkv.controller.kernels import A, _jit

_MIN_EXTENT = 8
_SLICE_GATHER = 32  # gather() copies this many sessions or fewer slice by slice


class RowArena:
    """The rows of session `s` in logical order are `arena[start[s] : start[s] + length[s]]`.

    Appending grows an extent in place while it has room; otherwise the extent moves to the end of
    the arena with 1/8 more room. Dead space is compacted away when the end is reached; when
    live extents would fill 7/8 of it, the arena is resized to 3/2 of them (~1.7x its rows).
    """

    def __init__(self, num_sessions: int, capacity: int = 1 << 12) -> None:
        self.arena = np.full(max(capacity, _MIN_EXTENT), -1, dtype=np.int32)
        self.start = np.zeros(num_sessions, dtype=np.int64)
        self.cap = np.zeros(num_sessions, dtype=np.int64)
        self.length = np.zeros(num_sessions, dtype=np.int64)
        self.top = 0  # first unused position at the end of the arena
        self._index = np.zeros(0, dtype=np.int64)  # scratch of gather(reuse=True)
        self._rows = np.zeros(0, dtype=np.int32)
        self.live_cap = 0  # sum of the capacities of live extents

    def grow_sessions(self, num_sessions: int, length: np.ndarray | None = None,
                      start: np.ndarray | None = None) -> None:
        """Room for num_sessions sessions. `length`, `start`: where the lengths and extent
        starts live from now on (the owner's arrays, holding the current values; SessionTable
        keeps them in its per-session records)."""
        extra = num_sessions - len(self.start)
        if extra > 0:
            self.start = np.concatenate([self.start, np.zeros(extra, dtype=np.int64)])
            self.cap = np.concatenate([self.cap, np.zeros(extra, dtype=np.int64)])
            self.length = np.concatenate([self.length, np.zeros(extra, dtype=np.int64)])
        for name, given in (("length", length), ("start", start)):
            if given is not None:
                assert len(given) == len(self.start) and given.dtype == np.int64
                setattr(self, name, given)

    def rows(self, s: int) -> np.ndarray:
        """View of session s's rows in logical order (do not keep it across appends)."""
        begin = int(self.start[s])
        return self.arena[begin:begin + int(self.length[s])]

    def gather(self, sessions: np.ndarray,
               reuse: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `sessions`, concatenated in the given order, and offsets [len(sessions) + 1].

        With `reuse` the rows land in a buffer the next reuse=True call overwrites (no fresh
        pages to fault in on the hot path); copy them to keep them.
        """
        lens = self.length[sessions]
        offsets = np.zeros(len(sessions) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        if total == 0:
            return np.zeros(0, dtype=np.int32), offsets
        if len(sessions) <= _SLICE_GATHER:  # a few sessions: slices beat an index of every row
            arena = self.arena
            return np.concatenate([arena[a:a + n] for a, n in zip(self.start[sessions].tolist(),
                                                                  lens.tolist())]), offsets
        if reuse:
            if len(self._index) < total:
                self._index = np.empty(total + total // 2, dtype=np.int64)
                self._rows = np.empty(len(self._index), dtype=np.int32)
            out = self._rows[:total]
            step = extent_index(self.start[sessions], lens, self._index)
        else:
            out = np.empty(total, dtype=np.int32)
            step = extent_index(self.start[sessions], lens)
        np.take(self.arena, step, out=out)
        return out, offsets

    def append_new(self, batch: np.ndarray, n_new: np.ndarray, rows: np.ndarray) -> None:
        """append() for the sessions of a step with n_new[i] > 0, in one compiled pass unless
        the arena must be compacted or grown first."""
        done, self.top, grown = append_rows(batch, n_new, rows, self.arena, self.start,
                                            self.cap, self.length, self.top)
        if done:
            self.live_cap += grown
            return
        has_new = n_new > 0
        self.append(batch[has_new], n_new[has_new], rows)

    def append(self, sessions: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> None:
        """Append counts[i] rows (taken in order from `rows`) to sessions[i]; sessions unique."""
        length = self.length[sessions]
        need = length + counts
        move = need > self.cap[sessions]
        if move.any():
            self._relocate(sessions[move], need[move])
        total = int(counts.sum())
        if total == 0:
            return
        if total == len(sessions) and counts.min() == 1:  # one row each
            self.arena[self.start[sessions] + length] = rows
        else:
            ends = np.cumsum(counts)
            base = np.repeat(self.start[sessions] + length - (ends - counts), counts)
            self.arena[base + np.arange(total)] = rows
        self.length[sessions] = need

    def release(self, s: int) -> None:
        self.live_cap -= int(self.cap[s])
        self.start[s] = self.cap[s] = self.length[s] = 0

    def set_rows(self, s: int, rows: np.ndarray) -> None:
        """Replace session s's rows (used when the table is rebuilt)."""
        self.release(s)
        self._relocate(np.array([s]), np.array([len(rows)], dtype=np.int64))
        self.rows_view_set(s, rows)

    def rows_view_set(self, s: int, rows: np.ndarray) -> None:
        begin = int(self.start[s])
        self.arena[begin:begin + len(rows)] = rows
        self.length[s] = len(rows)

    def nbytes(self) -> int:
        own = sum(a.nbytes for a in (self.start, self.length)
                  if a.flags.owndata)  # else the owner counts them
        return int(self.arena.nbytes + self.cap.nbytes + own + self._index.nbytes
                   + self._rows.nbytes)

    def _relocate(self, sessions: np.ndarray, need: np.ndarray) -> None:
        """Move the extents of `sessions` (unique) to the end, one after the other, with room
        for need[i] rows and some more."""
        new_cap = np.maximum(need + np.maximum(need // 8, 4), _MIN_EXTENT)
        want = int(new_cap.sum())
        if self.top + want > len(self.arena):
            self._compact_or_grow(want)
        new_start = self.top + np.cumsum(new_cap) - new_cap
        lens = self.length[sessions]
        arena = self.arena
        if len(sessions) <= _SLICE_GATHER:
            view = arena.data  # memoryview slices: a plain memmove each
            for a, b, n in zip(self.start[sessions].tolist(), new_start.tolist(), lens.tolist()):
                view[b:b + n] = view[a:a + n]  # a new extent never overlaps a live one
        elif lens.any():
            arena[extent_index(new_start, lens)] = arena[extent_index(self.start[sessions], lens)]
        self.live_cap += want - int(self.cap[sessions].sum())
        self.start[sessions], self.cap[sessions] = new_start, new_cap
        self.top += want

    def make_room(self, fraction: int = 16) -> bool:
        """Compact now (Controller.prepare, between steps) if less than 1/`fraction` of the
        arena is left at its end: the append that would otherwise compact runs inside a step
        (13-20 ms at 1M blocks before compact_extents, 1-2 ms with it; about every 1000 steps
        of bench/controller.py). -> whether it compacted."""
        if len(self.arena) - self.top >= len(self.arena) // fraction:
            return False
        self._compact_or_grow(0)
        return True

    def _compact_or_grow(self, want: int) -> None:
        """Move live extents to the front, in place order (one compiled pass); resize the
        arena if that would leave less than an eighth of it free. Past each extent's rows up to
        its capacity, and past the last, the arena holds -1."""
        live = np.flatnonzero(self.cap > 0)
        order = live[np.argsort(self.start[live], kind="stable")]
        size = len(self.arena)
        if self.live_cap + want > size - size // 8:
            size = (self.live_cap + want) * 3 // 2
        out = self.arena if size == len(self.arena) else np.empty(size, dtype=np.int32)
        self.top = compact_extents(order, self.start, self.cap, self.length, self.arena, out)
        self.arena = out


def extent_index(starts: np.ndarray, lens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """starts[0] .. starts[0] + lens[0] - 1, then the same for the next extent, concatenated."""
    total = int(lens.sum())
    step = np.empty(total, dtype=np.int64) if out is None else out[:total]
    if total == 0:
        return step
    keep = lens > 0
    first, n = starts[keep], lens[keep]
    begin = np.cumsum(n) - n
    step.fill(1)  # the running sum of these steps walks every extent in turn
    step[0] = first[0]
    step[begin[1:]] = first[1:] - (first[:-1] + n[:-1] - 1)
    np.cumsum(step, out=step)
    return step


@_jit
def append_rows(batch: A, n_new: A, rows: A, arena: A, start: A, cap: A, length: A,
                top: int) -> tuple[bool, int, int]:
    """RowArena.append of n_new[i] > 0 rows to batch[i], taken in order from `rows`, moving a
    full extent to the end as _relocate does. Returns (False, top, 0) and changes nothing when
    the moved extents do not fit before the end (the caller compacts); else (True, new top,
    growth of live capacity)."""
    want = 0
    for i in range(len(batch)):
        if n_new[i] <= 0:  # most sessions of a decode step: no read of their (cold) entries
            continue
        s = batch[i]
        need = length[s] + n_new[i]
        if need > cap[s]:
            want += max(need + max(need // 8, 4), _MIN_EXTENT)
    if top + want > len(arena):
        return False, top, 0
    grown = 0
    k = 0
    for i in range(len(batch)):
        c = n_new[i]
        if c <= 0:
            continue
        s = batch[i]
        n = length[s]
        if n + c > cap[s]:  # a new extent never overlaps a live one
            new_cap = max(n + c + max((n + c) // 8, 4), _MIN_EXTENT)
            dst, src = arena[top:top + n], arena[start[s]:start[s] + n]
            for j in range(n):
                dst[j] = src[j]
            grown += new_cap - cap[s]
            start[s], cap[s] = top, new_cap
            top += new_cap
        dst = arena[start[s] + n:start[s] + n + c]
        for j in range(c):
            dst[j] = rows[k + j]
        k += c
        length[s] = n + c
    return True, top, grown


@_jit
def compact_extents(order: A, start: A, cap: A, length: A, arena: A, out: A) -> int:
    """RowArena._compact_or_grow's copy: the extents of `order` (ascending starts) one after
    the other from 0 in `out` (`arena` itself, or a larger array), each with its capacity, -1
    past its rows and past the last extent; `start` follows. In place, each extent moves
    down, never onto one not moved yet (copied from its first row on). -> the new top."""
    top = 0
    for i in range(len(order)):
        s = order[i]
        n, c, begin = length[s], cap[s], start[s]
        dst, src = out[top:top + c], arena[begin:begin + n]
        for j in range(n):
            dst[j] = src[j]
        for j in range(n, c):
            dst[j] = -1
        start[s] = top
        top += c
    out[top:] = -1
    return top
