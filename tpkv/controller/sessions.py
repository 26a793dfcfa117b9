"""Session registry: ids and handles, token counts, run history, pins, per-tier block counts."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from tpkv.controller.arena import RowArena
from tpkv.controller.policy import shift_ticks
from tpkv.controller.stepkernels import resolve_handles
from tpkv.errors import (
    ArgumentTypeError,
    DuplicateSessionError,
    InvalidSessionIdError,
    SessionClosedError,
    UnknownSessionError,
)

MAX_SESSION_ID_CHARS = 256
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]+")
_ID_SHIFT = 32
_REMEMBER_CLOSED = 4096
CHOICE_NAMES = {-1: "none", 0: "load", 1: "recompute"}


def check_session_id(session_id: object) -> str:
    """Return the id if it matches ^[A-Za-z0-9._:-]{1,256}$, else InvalidSessionIdError."""
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a str, got {type(session_id).__name__}")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_CHARS:
        raise InvalidSessionIdError(f"session id has {len(session_id)} characters, allowed "
                                    f"1..{MAX_SESSION_ID_CHARS}")
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise InvalidSessionIdError(f"session id {session_id[:64]!r} has characters outside "
                                    f"A-Z a-z 0-9 . _ : -")
    return session_id


def add_counts(target: np.ndarray, keys: np.ndarray, delta: int) -> None:
    """target.flat[k] += delta for every k in keys (repeats add up). Runs of equal keys (rows
    of one session come together) are counted first, so ufunc.at sees few entries."""
    if len(keys) == 0:
        return
    starts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    lengths = np.diff(np.concatenate([[0], starts, [len(keys)]]))
    first = keys[np.concatenate([[0], starts])] if len(starts) else keys[:1]
    np.add.at(target.reshape(-1), first, delta * lengths)


_LINE = 64  # bytes of a cache line
_HOT_FILL = {"handle_of": -1, "tokens": 0, "pending": 0, "table_pos": -1, "length": 0,
             "start": 0, "run_hist": -1, "runs": 0, "plan_local": -1}


def _hot_dtype(lru_k: int) -> np.dtype:
    """SessionTable's per-session record, padded to whole cache lines."""
    fields = [("handle_of", np.int64), ("tokens", np.int64), ("pending", np.int64),
              ("table_pos", np.int64), ("length", np.int64), ("start", np.int64),
              ("run_hist", np.dtype((np.int32, (lru_k,)))), ("runs", np.int32),
              ("plan_local", np.int32)]
    packed = np.dtype(fields, align=True)
    assert packed.fields is not None
    return np.dtype({"names": [n for n, _ in fields], "formats": [f for _, f in fields],
                     "offsets": [packed.fields[n][1] for n, _ in fields],
                     "itemsize": -(-packed.itemsize // _LINE) * _LINE})


class SessionTable:
    """Struct of arrays over session indices; indices are reused after close, handles never."""

    gen: np.ndarray
    handle_of: np.ndarray
    is_open: np.ndarray
    tokens: np.ndarray
    pending: np.ndarray
    runs: np.ndarray
    run_hist: np.ndarray
    attn_sum: np.ndarray
    clean: np.ndarray
    kept_last: np.ndarray
    counts: np.ndarray
    choice: np.ndarray
    load_s: np.ndarray
    recompute_s: np.ndarray
    opened_tick: np.ndarray
    table_pos: np.ndarray
    dirty: np.ndarray
    plan_local: np.ndarray
    l3_other: np.ndarray
    l3_epoch: np.ndarray
    l3_last: np.ndarray

    def __init__(self, lru_k: int, capacity: int = 256) -> None:
        self.lru_k = lru_k
        self.names: list[str | None] = []
        self.index: dict[str, int] = {}
        self.recently_closed: OrderedDict[str, int] = OrderedDict()  # id -> tick of close
        self.pins: dict[int, list[tuple[int, int]]] = {}  # explicit pins: [start, stop) ranges
        self.free_idx: list[int] = []
        self.capacity = 0
        self.arena = RowArena(0)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        def grow(name: str, dtype: type, fill: float, lead: int = 0) -> None:
            """1-D over sessions, or [lead, sessions] so that each row is a 1-D array."""
            shape = (lead, capacity) if lead else (capacity,)
            new: np.ndarray = np.full(shape, fill, dtype=dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[..., :old.shape[-1]] = old
            setattr(self, name, new)

        grow("gen", np.int32, 0)
        grow("is_open", np.bool_, False)
        grow("attn_sum", np.float64, 0.0)  # sum of its blocks' attention mass
        grow("clean", np.bool_, False)  # L1 holds only its pinned blocks (after a demotion)
        grow("counts", np.int32, 0, 4)  # [4, S] blocks per tier: NONE, L1, L2, L3
        grow("choice", np.int8, -1)  # cost model: -1 none, 0 load, 1 recompute
        grow("load_s", np.float32, 0.0)
        grow("recompute_s", np.float32, 0.0)
        grow("opened_tick", np.int64, 0)
        # An L1 slot of a block changed since the batch table (BatchTable): moves set it for
        # sessions of any step, the table reads it for the whole batch; dense, it stays cached.
        grow("dirty", np.bool_, True)
        # A block of it was promoted keeping its L2 copy since it last got tokens: the step
        # that next writes its last block looks whether that block's copy is stale
        # (stepkernels.written_kept); the others skip the lookup.
        grow("kept_last", np.bool_, False)
        # Records in its L3 segment that are not blocks in L3: copies of blocks loaded back
        # (BlockTable.l3copy) and dead ones (written or dropped since); they hold L3 room until
        # the segment goes (BlockTable.keep_l3)
        grow("l3_other", np.int32, 0)
        # Epoch of the last plan that moved a block of it into or out of L3 (-1: none)
        grow("l3_epoch", np.int64, -1)
        # A block of it was loaded from L3, or recomputed, keeping its record since it last
        # got tokens: the step that next writes its last block voids that block's copy
        # (stepkernels.written_kept); the others skip the lookup, as kept_last does for L2 copies
        grow("l3_last", np.bool_, False)
        self._grow_hot(capacity)
        self.arena.grow_sessions(capacity, self._hot["length"], self._hot["start"])
        self.names.extend([None] * (capacity - len(self.names)))
        self.capacity = capacity

    def _grow_hot(self, capacity: int) -> None:
        """The fields every step reads or writes for each session of its batch, one record of a
        cache line per session (a step's 1024 sessions are spread over arrays too large to stay
        in cache: one line each instead of one per field). The attributes are views into it.
        The block count and first arena position (RowArena.length, .start) and the run history
        are in it too: every step reads or writes them for each session of its batch, and an
        eviction scan or walk reads them only for its candidates. Fields that eviction scans
        read over every session (clean, counts), and the dirty flag that moves set for sessions
        outside the batch, stay in arrays of their own: in the record, each session scanned or
        moved would cost a line."""
        dtype = _hot_dtype(self.lru_k)
        buf = np.zeros(capacity * dtype.itemsize + _LINE, dtype=np.uint8)
        at = -buf.ctypes.data % _LINE
        hot = buf[at:at + capacity * dtype.itemsize].view(dtype)
        for name, fill in _HOT_FILL.items():
            hot[name] = fill
        old = getattr(self, "_hot", None)
        if old is not None:
            hot[:len(old)] = old
        self._hot_buf, self._hot = buf, hot
        self.handle_of = hot["handle_of"]  # the handle of an open session, -1 when closed
        self.tokens = hot["tokens"]  # tokens with KV (or KV being written this step)
        self.pending = hot["pending"]  # tokens announced by extend(), written at the next run
        self.table_pos = hot["table_pos"]  # position in the last step's batch table, or -1
        self.runs = hot["runs"]  # how many steps the session ran in
        # [K, S] ticks of its latest runs, newest first (a view of the records' [S, K])
        self.run_hist = hot["run_hist"].T
        self.plan_local = hot["plan_local"]  # kernels' scratch (plan_arrays...), -1 between calls

    # ---- lifecycle -----------------------------------------------------------------------------
    def open(self, name: str, tick: int) -> int:
        check_session_id(name)
        if name in self.index:
            raise DuplicateSessionError(f"session {name!r} is already open "
                                        f"({len(self.index)} sessions open)")
        if not self.free_idx:
            old = self.capacity
            self._grow(max(old + old // 2, 64))
            self.free_idx = list(range(self.capacity - 1, old - 1, -1))
        s = self.free_idx.pop()
        self.names[s] = name
        self.index[name] = s
        self.recently_closed.pop(name, None)
        self.is_open[s] = True
        self.dirty[s] = True
        self.handle_of[s] = self.handle(s)
        self.tokens[s] = self.pending[s] = self.runs[s] = 0
        self.run_hist[:, s] = -1
        self.attn_sum[s] = 0.0
        self.clean[s] = False
        self.counts[:, s] = 0
        self.l3_other[s] = 0
        self.l3_epoch[s] = -1
        self.l3_last[s] = False
        self.choice[s], self.load_s[s], self.recompute_s[s] = -1, 0.0, 0.0
        self.opened_tick[s] = tick
        return s

    def close(self, s: int, tick: int) -> None:
        name = self.names[s]
        assert name is not None
        del self.index[name]
        self.recently_closed[name] = tick
        while len(self.recently_closed) > _REMEMBER_CLOSED:
            self.recently_closed.popitem(last=False)
        self.names[s] = None
        self.is_open[s] = False
        self.counts[:, s] = 0
        self.l3_other[s] = 0
        self.dirty[s] = True
        self.handle_of[s] = -1
        self.gen[s] += 1
        self.pins.pop(s, None)
        self.arena.release(s)
        self.free_idx.append(s)

    # ---- lookups -------------------------------------------------------------------------------
    def lookup(self, name: str) -> int:
        if not isinstance(name, str):  # (an unhashable one would raise TypeError below)
            raise UnknownSessionError(f"session ids are str, got {type(name).__name__} "
                                      f"{repr(name)[:64]}")
        s = self.index.get(name)
        if s is not None:
            return s
        if name in self.recently_closed:
            raise SessionClosedError(f"session {name!r} was closed at tick "
                                     f"{self.recently_closed[name]}")
        raise UnknownSessionError(f"unknown session {name!r} ({len(self.index)} sessions open)")

    def resolve(self, sessions: Sequence[str] | np.ndarray) -> np.ndarray:
        """Session indices for ids (str) or handles (int64 array from `handle`)."""
        if isinstance(sessions, np.ndarray) and sessions.dtype.kind in "iu":
            if sessions.ndim != 1:
                raise ArgumentTypeError(f"session handles must be a 1-D array, got shape "
                                        f"{sessions.shape}")
            return self._resolve_handles(sessions.astype(np.int64))
        if isinstance(sessions, (str, bytes)) or not isinstance(sessions, (Sequence,
                                                                            np.ndarray)):
            raise ArgumentTypeError(f"session_ids must be a list of str or an array of handles, "
                                    f"got {type(sessions).__name__} {repr(sessions)[:64]}")
        index = self.index
        try:
            return np.array([index[name] for name in sessions], dtype=np.int64)
        except (KeyError, TypeError):
            for name in sessions:
                self.lookup(name)
            raise

    def _resolve_handles(self, handles: np.ndarray) -> np.ndarray:
        ok, idx = resolve_handles(handles, self.handle_of)
        if ok:
            return idx
        idx = handles & ((1 << _ID_SHIFT) - 1)  # the checks again, to name the bad handle
        if len(idx) and (handles.min() < 0 or idx.max() >= self.capacity):
            bad = handles[(handles < 0) | (idx >= self.capacity)]
            raise UnknownSessionError(f"session handle {int(bad[0])} names no session")
        ok = self.handle_of[idx] == handles
        if not ok.all():
            raise UnknownSessionError(f"session handle {int(handles[~ok][0])} names no open "
                                      f"session ({int((~ok).sum())} of {len(handles)} handles "
                                      f"are stale)")
        return idx

    def handle(self, s: int) -> int:
        return (int(self.gen[s]) << _ID_SHIFT) | s

    def name(self, s: int) -> str:
        name = self.names[s]
        assert name is not None, f"session index {s} is not open"
        return name

    def nblocks(self, s: int) -> int:
        return int(self.arena.length[s])

    def rows(self, s: int) -> np.ndarray:
        return self.arena.rows(s)

    def count_keys(self, tier_cols: np.ndarray | int, sessions: np.ndarray) -> np.ndarray:
        """Flat indices into `counts` for add_counts (tier column 0..3, session)."""
        return np.asarray(tier_cols, dtype=np.int64) * self.capacity + sessions

    def open_indices(self) -> np.ndarray:
        return np.flatnonzero(self.is_open)

    def rebase_ticks(self, shift: int) -> None:
        """Ticks `shift` earlier (never below 0; -1, none, stays)."""
        shift_ticks(self.run_hist, shift)
        self.opened_tick -= shift

    def nbytes(self) -> int:
        arrays = [v for v in vars(self).values() if isinstance(v, np.ndarray) and v.flags.owndata]
        return int(sum(a.nbytes for a in arrays)) + self.arena.nbytes()
