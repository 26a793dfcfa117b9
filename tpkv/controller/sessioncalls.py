"""The session calls' work on the sessions and the block table: open, extend, close, pins.

Each function checks its arguments before it changes anything (a typed error leaves both
tables as they were) and returns the session index it changed, for the Controller to note
(`Controller._changed`) and report; the Controller checks readiness and records events.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpkv.controller.epochs import Epochs
from tpkv.controller.sessions import SessionTable
from tpkv.controller.table import PIN_EXPLICIT, BlockTable
from tpkv.errors import ArgumentError, ArgumentTypeError, BadRequestError
from tpkv.limits import (
    MAX_SESSION_BLOCKS,
    MAX_SESSION_TOKENS,
    check_block_range,
    check_count,
)


def open_session(S: SessionTable, session_id: str, num_tokens: int, tick: int) -> int:
    """A new session with `num_tokens` of prompt pending; -> its index."""
    num_tokens = check_count("num_tokens", num_tokens, MAX_SESSION_TOKENS, "MAX_SESSION_TOKENS")
    s = S.open(session_id, tick)
    S.pending[s] = num_tokens
    return s


def extend_session(S: SessionTable, session_id: str, num_tokens: int) -> None:
    """`num_tokens` more pending for the session's next step."""
    s = S.lookup(session_id)
    n = check_count("num_tokens", num_tokens, MAX_SESSION_TOKENS, "MAX_SESSION_TOKENS")
    total = int(S.tokens[s]) + int(S.pending[s]) + n
    if total > MAX_SESSION_TOKENS:
        raise ArgumentError(f"extend_session({session_id!r}, num_tokens={n}) would make the "
                            f"session {total} tokens, over MAX_SESSION_TOKENS "
                            f"({MAX_SESSION_TOKENS})")
    S.pending[s] += n


def close_session(S: SessionTable, T: BlockTable, E: Epochs, session_id: str,
                  tick: int) -> tuple[int, int]:
    """Forget the session and free its blocks (their ids go out with the next step);
    -> (its index, how many blocks it had)."""
    s = S.lookup(session_id)
    rows = S.rows(s).copy()
    E.note_closed(session_id, T.ids(rows))
    T.free_records(S.l3_other, s)  # its segment goes with it: that room is freed too
    T.release_rows(rows)
    S.close(s, tick)
    return s, len(rows)


def pin(S: SessionTable, T: BlockTable, session_id: str, start: int,
        stop: int | None) -> int:
    """Pin blocks [start, stop) (to the last block when stop is None), later ones in the
    range too; -> how many existing blocks it pinned."""
    s = S.lookup(session_id)
    start, given = check_block_range(start, stop)
    stop = S.nblocks(s) if given is None else given
    if start > stop:
        raise ArgumentError(f"pin range [{start}, {stop}) is not a range of blocks")
    S.pins.setdefault(s, []).append((start, stop))
    rows = S.rows(s)[start:stop]
    T.pinned[rows] |= PIN_EXPLICIT
    return len(rows)


def unpin(S: SessionTable, T: BlockTable, session_id: str, start: int,
          stop: int | None) -> int:
    """Cut [start, stop) out of the session's pinned ranges; -> how many blocks it unpinned
    (those no remaining range covers)."""
    s = S.lookup(session_id)
    start, given = check_block_range(start, stop)
    stop = MAX_SESSION_BLOCKS if given is None else given
    kept: list[tuple[int, int]] = []
    for a, z in S.pins.get(s, []):
        kept += [(a, min(z, start))] if a < start else []
        kept += [(max(a, stop), z)] if z > stop else []
    S.pins[s] = [(a, z) for a, z in kept if a < z]
    if not S.pins[s]:
        del S.pins[s]
    rows = S.rows(s)
    covered = np.zeros(len(rows), dtype=bool)
    for a, z in S.pins.get(s, []):
        covered[a:z] = True
    unpinned = rows[~covered & (T.pinned[rows] != 0)]
    T.pinned[unpinned] &= ~PIN_EXPLICIT
    S.clean[s] = False
    return len(unpinned)


def attention_rows(S: SessionTable, session_id: str, mass: Sequence[float] | np.ndarray,
                   start: int) -> tuple[np.ndarray, np.ndarray]:
    """report_attention's checks, changing nothing: the rows and the mass to add."""
    s = S.lookup(session_id)
    start = check_count("start", start, MAX_SESSION_BLOCKS, "MAX_SESSION_BLOCKS")
    if isinstance(mass, (str, bytes)):
        raise ArgumentTypeError(f"attention mass must be numbers, got {type(mass).__name__}")
    try:
        values = np.asarray(mass, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ArgumentTypeError(f"attention mass must be numbers ({session_id!r}): "
                                f"{exc}") from exc
    if not np.isfinite(values).all() or (values < 0).any():
        raise BadRequestError(f"attention mass must be finite and >= 0 ({session_id!r})")
    if start + len(values) > S.nblocks(s):
        raise BadRequestError(f"attention for blocks [{start}, {start + len(values)}) of "
                              f"{session_id!r}, which has {S.nblocks(s)} blocks")
    return S.rows(s)[start:start + len(values)], values


def add_attention(S: SessionTable, T: BlockTable, session_id: str,
                  mass: Sequence[float] | np.ndarray, start: int) -> int:
    """Add attention mass to blocks start, start+1, ... of a session; -> its index."""
    rows, values = attention_rows(S, session_id, mass, start)
    T.attn[rows] += values.astype(np.float32)
    s = S.lookup(session_id)
    S.attn_sum[s] += float(values.sum())
    return s
