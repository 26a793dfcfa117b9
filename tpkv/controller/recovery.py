"""Rebuild the table after a restart (workers' slot maps + SSD manifests); integrity checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpkv.config import TpkvConfig
from tpkv.controller.epochs import Epochs
from tpkv.controller.sessions import SessionTable, check_session_id
from tpkv.controller.table import TIER_INDEX, BlockTable
from tpkv.errors import ArgumentTypeError, BadRequestError
from tpkv.limits import MAX_SESSION_BLOCKS, MAX_SESSION_TOKENS, check_count, check_counts
from tpkv.protocol.plan import Tier

_ID_SHIFT = 32
_ROW_MASK = (1 << _ID_SHIFT) - 1
_MAP_KEYS = ("block_ids", "tiers", "slots", "session_idx", "logical_idx", "session_names")


def _parse(m: Mapping[str, Any], tp: int) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise ArgumentTypeError(f"a slot map must be a map, got {type(m).__name__}")
    try:
        out: dict[str, Any] = {k: np.asarray(m[k], dtype=np.int64).reshape(-1)
                               for k in _MAP_KEYS[:5]}
        out["names"] = np.asarray([check_session_id(x) for x in m["session_names"]] + [""],
                                  dtype=object)[:-1]
        out["rank"] = int(m["rank"])
        out["epoch"] = int(m.get("epoch", 0))
        out["tick"] = int(m.get("tick", 0))
        out["tokens"] = {str(k): int(v) for k, v in dict(m.get("session_tokens", {})).items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequestError(f"slot map is missing or mistypes a field: {exc}") from exc
    n = len(out["block_ids"])
    if any(len(out[k]) != n for k in _MAP_KEYS[:5]) or not 0 <= out["rank"] < tp:
        raise BadRequestError(f"slot map of rank {out['rank']}: arrays differ in length or the "
                              f"rank is outside 0..{tp - 1}")
    if n and (out["session_idx"].min() < 0 or out["session_idx"].max() >= len(out["names"])):
        raise BadRequestError(f"slot map of rank {out['rank']}: session_idx out of range")
    if n:
        check_counts(f"slot map of rank {out['rank']}: logical_idx", out["logical_idx"],
                     MAX_SESSION_BLOCKS, "MAX_SESSION_BLOCKS")
    for name, tokens in out["tokens"].items():
        check_count(f"slot map of rank {out['rank']}: session_tokens[{name!r}]", tokens,
                    MAX_SESSION_TOKENS, "MAX_SESSION_TOKENS")
    return out


def _agreed(maps: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(session, logical) -> (block_id, tier, slot) for entries every rank holds identically."""
    if not maps:
        return {}
    ref = maps[0]
    keep = np.ones(len(ref["block_ids"]), dtype=bool)
    for other in maps[1:]:
        order = np.argsort(other["block_ids"], kind="stable")
        ids = other["block_ids"][order]
        at = np.clip(np.searchsorted(ids, ref["block_ids"]), 0, max(len(ids) - 1, 0))
        if len(ids) == 0:
            return {}
        j = order[at]
        keep &= ids[at] == ref["block_ids"]
        for k in ("tiers", "slots", "logical_idx"):
            keep &= other[k][j] == ref[k]
        keep &= other["names"][other["session_idx"][j]] == ref["names"][ref["session_idx"]]
    out: dict[tuple[str, int], tuple[int, int, int]] = {}
    for i in np.flatnonzero(keep).tolist():
        key = (str(ref["names"][ref["session_idx"][i]]), int(ref["logical_idx"][i]))
        out.setdefault(key, (int(ref["block_ids"][i]), int(ref["tiers"][i]),
                             int(ref["slots"][i])))
    return out


@dataclass
class Rebuilt:
    """A new table and sessions, and where the controller's counters go on from."""

    table: BlockTable
    sessions: SessionTable
    ssd_dropped: list[str]  # segments given up (their files go with the first step)
    next_epoch: int
    tick: int
    summary: dict[str, Any]


def rebuild(config: TpkvConfig, old: BlockTable, tick: int, next_epoch: int, restarts: int,
            slot_maps: Sequence[Mapping[str, Any]],
            ssd_manifests: Mapping[str, Sequence[int] | np.ndarray],
            ssd_records: Mapping[str, int] | None = None) -> Rebuilt:
    """A table of what every rank agrees on, to replace `old` (which it reads only); L3 blocks
    come from the manifests (a session's records count only if its manifest lists them, and
    only for blocks the ranks' maps hold in L3 or do not know at all). Anything else is
    Tier.NONE: recomputed when its session next runs. Bad input raises, changing nothing."""
    g, pol = config.geometry, config.policy
    if not isinstance(slot_maps, (Sequence, np.ndarray)) or isinstance(slot_maps, (str, bytes)):
        raise ArgumentTypeError(f"slot_maps must be a list of maps, got "
                                f"{type(slot_maps).__name__}")
    ssd_records = {} if ssd_records is None else ssd_records
    for name, arg in (("ssd_manifests", ssd_manifests), ("ssd_records", ssd_records)):
        if not isinstance(arg, Mapping):
            raise ArgumentTypeError(f"{name} must map session ids to block indices (counts), "
                                    f"got {type(arg).__name__}")
    maps = [_parse(m, g.tp_size) for m in slot_maps]
    if len({m["rank"] for m in maps}) != len(maps):
        raise BadRequestError(f"two slot maps name the same rank: {[m['rank'] for m in maps]}")
    manifests = {check_session_id(k): set(check_counts(f"ssd_manifests[{k!r}]", v,
                                                       MAX_SESSION_BLOCKS,
                                                       "MAX_SESSION_BLOCKS").tolist())
                 for k, v in ssd_manifests.items()}
    records = {check_session_id(k): check_count(f"ssd_records[{k!r}]", v, MAX_SESSION_BLOCKS,
                                                "MAX_SESSION_BLOCKS")
               for k, v in ssd_records.items()}
    agreed = _agreed(maps)
    # Blocks some rank's map knows: their tier is the maps' word. A manifest may still list an
    # older record of a block the maps hold nowhere (its last block written again since, then
    # dropped): taken from L3, that record would be wrong KV.
    known = {(str(m["names"][si]), int(j)) for m in maps
             for si, j in zip(m["session_idx"].tolist(), m["logical_idx"].tolist())}
    names: dict[str, int] = {}  # session -> number of blocks
    for (name, logical) in agreed:
        names[name] = max(names.get(name, 0), logical + 1)
    for name, idx in sorted(manifests.items()):
        names[name] = max(names.get(name, 0), max(idx, default=-1) + 1)
    tokens = {n: max([m["tokens"].get(n, 0) for m in maps] + [0]) for n in names}
    seen_gen: dict[int, int] = {}
    for m in maps:
        for bid in m["block_ids"].tolist():
            row, gen = bid & _ROW_MASK, bid >> _ID_SHIFT
            seen_gen[row] = max(seen_gen.get(row, -1), gen)
    total = sum(max(nb, -(-tokens[n] // g.block_tokens)) for n, nb in names.items())
    cap = max(old.capacity, total + 1024, max(seen_gen, default=0) + 1)
    if cap > pol.max_tracked_blocks:
        raise BadRequestError(f"rebuild needs {cap} rows, at most {pol.max_tracked_blocks}")
    T = BlockTable(old.full_slots(Tier.HBM), old.full_slots(Tier.DRAM), old.l3_capacity,
                   pol.lru_k, cap, config.l3.enabled)
    T.pace = old.pace  # (its measurements; the rebuilt L2 slots count as clean)
    S = SessionTable(pol.lru_k)
    taken = {t: np.zeros(T.full_slots(t), bool) for t in (Tier.HBM, Tier.DRAM)}
    used_rows: set[int] = set()
    plan: list[tuple[int, int, int, int, int, int]] = []  # (row, gen, tier, slot, sess, logical)
    unplaced: list[tuple[int, int, int]] = []  # (tier, sess, logical) needing a fresh row
    l3_left = T.l3_capacity
    counts = {t: 0 for t in TIER_INDEX}
    for name, nb in names.items():
        nb = max(nb, -(-tokens[name] // g.block_tokens))
        s = S.open(name, tick)
        S.tokens[s] = max(tokens[name], (nb - 1) * g.block_tokens + 1) if nb else tokens[name]
        on_ssd = manifests.get(name, set())
        for j in range(nb):
            bid, tier, slot = agreed.get((name, j), (-1, int(Tier.NONE), -1))
            if tier in (Tier.HBM, Tier.DRAM):
                pool = taken[Tier(tier)]
                if not 0 <= slot < len(pool) or pool[slot]:
                    tier, slot = int(Tier.NONE), -1
                else:
                    pool[slot] = True
            elif tier == Tier.SSD or (j in on_ssd and (name, j) not in known):
                tier, slot = (int(Tier.SSD), -1) if j in on_ssd and l3_left > 0 else (-1, -1)
                l3_left -= tier == Tier.SSD
            counts[Tier(tier)] += 1
            row = bid & _ROW_MASK if bid >= 0 else -1
            if row >= 0 and row not in used_rows:
                used_rows.add(row)
                plan.append((row, bid >> _ID_SHIFT, tier, slot, s, j))
            else:
                unplaced.append((tier, s, j))
    free = (r for r in range(cap) if r not in used_rows)
    for tier, s, j in unplaced:
        row = next(free)
        plan.append((row, seen_gen.get(row, -1) + 1, tier, -1 if tier != Tier.SSD else -1, s, j))
    _install(T, S, plan)
    T.set_l2_online(old.slots(Tier.DRAM))  # the ranks' maps hold nothing past it
    dropped = _count_l3_records(T, S, manifests, records) if T.keep_l3 else []
    next_epoch = max([m["epoch"] for m in maps] + [next_epoch - 1]) + 1
    tick = max([m["tick"] for m in maps] + [tick])
    summary = {"at_tick": tick, "restart": restarts,
               "ranks": sorted(m["rank"] for m in maps), "sessions": len(names),
               "blocks": len(plan), "l1": counts[Tier.HBM], "l2": counts[Tier.DRAM],
               "l3": counts[Tier.SSD], "recompute": counts[Tier.NONE],
               "from_manifests": len(manifests), "next_epoch": next_epoch}
    return Rebuilt(T, S, dropped, next_epoch, tick, summary)


def _count_l3_records(T: BlockTable, S: SessionTable, manifests: Mapping[str, set[int]],
                      records: Mapping[str, int]) -> list[str]:
    """With L3 copies: the records of a session's segment that are not blocks placed in L3
    hold room still (SessionTable.l3_other; none is vouched for as a copy): its record count
    from `records` where given, else its manifest's distinct indices (a block written more
    than once then counts once). If they would not fit in L3, segments holding no block in L3
    go (returned: their files are deleted when the ranks apply the first step; their room is
    held through its build)."""
    for name in set(manifests) | set(records):
        s = S.index.get(name)
        if s is not None:
            held = max(len(manifests.get(name, ())), records.get(name, 0))
            S.l3_other[s] = max(0, held - int(S.counts[int(Tier.SSD) + 1][s]))
    T.l3_other = int(S.l3_other.sum())
    gone: list[str] = []
    only = np.flatnonzero((S.l3_other > 0) & (S.counts[int(Tier.SSD) + 1] == 0))
    for s in only[np.argsort(-S.l3_other[only], kind="stable")].tolist():
        if T.used(Tier.SSD) + T.l3_other <= T.l3_capacity:
            break
        T.free_records(S.l3_other, s)  # held until the first step's files are deleted
        gone.append(S.name(s))
    return gone


def _install(T: BlockTable, S: SessionTable,
             plan: Sequence[tuple[int, int, int, int, int, int]]) -> None:
    if not plan:
        return
    row, gen, tier, slot, sess, logical = (np.asarray(c, dtype=np.int64) for c in zip(*plan))
    T.gen[row], T.tier[row], T.session[row], T.logical[row] = gen, tier, sess, logical
    T.slot[row] = np.where((tier == Tier.HBM) | (tier == Tier.DRAM), slot, -1)
    T.count[row] = 0
    for t in (int(Tier.HBM), int(Tier.DRAM)):
        sel = tier == t
        T.owner[t][slot[sel]] = row[sel]
        free = np.flatnonzero(T.owner[t] < 0)
        T.free[t].top = 0
        T.free[t].push(free)
    for t, col in TIER_INDEX.items():
        T.num_in[col] = int((tier == t).sum())
    used = np.zeros(T.capacity, bool)
    used[row] = True
    T.free_rows.top = 0
    T.free_rows.push(np.flatnonzero(~used))
    order = np.lexsort((logical, sess))
    ss, rows = sess[order], row[order].astype(np.int32)
    uniq, starts = np.unique(ss, return_index=True)
    sizes = np.diff(np.concatenate([starts, [len(ss)]]))
    S.arena.append(uniq, sizes, rows)
    np.add.at(S.counts.reshape(-1), S.count_keys(tier + 1, sess), 1)


def check_integrity(T: BlockTable, S: SessionTable, epochs: Epochs, bt: int) -> None:
    """Table invariants, plus: sessions and table agree on every block (of `bt` tokens),
    counts per tier agree, in-flight blocks belong to pending plans. AssertionError names the
    first broken one."""
    T.check_integrity(settled=True)
    seen = 0
    for s in S.open_indices().tolist():
        rows = S.rows(s)
        seen += len(rows)
        assert (T.session[rows] == s).all(), f"session {s}: a row belongs to another session"
        assert (T.logical[rows] == np.arange(len(rows))).all(), f"session {s}: logical order"
        counts = np.bincount(T.tier[rows].astype(np.int64) + 1, minlength=4)
        assert (counts == S.counts[:, s]).all(), f"session {s}: counts {S.counts[:, s]} != {counts}"
        assert len(rows) == -(-int(S.tokens[s]) // bt), f"session {s}: blocks != tokens"
        copies = int(np.count_nonzero(T.l3copy[rows]))
        assert copies <= S.l3_other[s], f"session {s}: {copies} L3 copies > {S.l3_other[s]}"
    assert seen == T.capacity - T.free_rows.top, "rows of sessions != live rows"
    assert not S.counts[:, ~S.is_open].any(), "a closed session still counts blocks"
    assert int(S.l3_other.sum()) == T.l3_other, f"L3 other records {T.l3_other} != " \
        f"{int(S.l3_other.sum())} counted per session"
    assert (S.l3_other >= 0).all() and not S.l3_other[~S.is_open].any(), "L3 other records"
    flying = np.flatnonzero(T.in_flight)
    if len(flying):
        assert np.isin(flying, epochs.in_flight_rows()).all(), \
            "a block is in flight without a pending plan"
