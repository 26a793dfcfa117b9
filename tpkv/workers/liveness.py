"""Heartbeats of every TP rank in the rendezvous store, and who to blame when a collective fails."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Beat:
    """One rank's latest heartbeat: a counter, how far it got per channel, and its failure."""

    count: int
    seq: dict[str, int]
    failed: str = ""
    follower: bool = False  # it failed because another rank did (it gave up waiting)


class Liveness:
    """Each rank publishes `{count, seq per channel, failed}` under `<prefix>/hb/<rank>` every
    `interval_s` from a daemon thread (its own store connection), so a rank stuck in compute
    still beats, and a dead one stops.

    `enter(channel)` numbers the collectives of a channel (nothing is sent: the number rides on
    the next beat). `diagnose` reads every beat twice, `probe_s` apart, and names the ranks
    whose count did not move (dead or hung), that failed, or that are behind on the channel.
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float,
                 prefix: str = "tpkv", store_host_rank: int | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.probe_s = 2.5 * interval_s
        self.prefix = prefix
        self.store_host_rank = store_host_rank  # a rank whose death takes the store with it
        self.seq: dict[str, int] = {}
        self.failed = ""
        self.follower = False
        self._count = 0
        self._stop = threading.Event()
        self._beat_store = store.clone() if hasattr(store, "clone") else store
        self._beat(self.store)  # the first beat is synchronous: readable once we return
        self._thread = threading.Thread(target=self._run, name=f"tpkv-heartbeat-r{rank}",
                                        daemon=True)
        self._thread.start()

    def key(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    def enter(self, channel: str) -> int:
        """Number the next collective on `channel` (1, 2, ...)."""
        self.seq[channel] = self.seq.get(channel, 0) + 1
        return self.seq[channel]

    def fail(self, message: str, follower: bool = False) -> None:
        """Tell the other ranks this one has failed (best effort, at once); a `follower` gave
        up waiting on others, so it is not blamed while another rank is."""
        self.failed, self.follower = message[:500], follower
        self._beat(self.store)

    def read(self) -> dict[int, Beat | None]:
        """Every rank's latest beat (None where none was published); raises if the store is
        unreachable."""
        keys = [self.key(r) for r in range(self.world_size)]
        present = [self.store.check([k]) for k in keys]
        out: dict[int, Beat | None] = {}
        for r, (k, ok) in enumerate(zip(keys, present)):
            if not ok:
                out[r] = None
                continue
            d = json.loads(bytes(self.store.get(k)).decode())
            out[r] = Beat(int(d["count"]), {str(c): int(v) for c, v in d["seq"].items()},
                          str(d.get("failed", "")), bool(d.get("follower", False)))
        return out

    def diagnose(self, channel: str, seq: int) -> tuple[tuple[int, ...], str]:
        """(ranks to blame, a sentence per rank) for a failure of collective `seq` on `channel`."""
        try:
            first = self.read()
            time.sleep(self.probe_s)
            second = self.read()
        except Exception as exc:  # the store itself is gone
            host = self.store_host_rank
            who = f"rank {host}, which hosts it," if host is not None else "its host"
            culprit = (host,) if host is not None and host != self.rank else ()
            return culprit, (f"the rendezvous store is unreachable ({type(exc).__name__}: "
                           f"{exc}); {who} is down")
        blame: list[int] = []
        notes: list[str] = []
        followers: list[int] = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            a, b = first.get(r), second.get(r)
            if b is None:
                blame.append(r)
                notes.append(f"rank {r} never sent a heartbeat")
            elif b.failed and b.follower:
                followers.append(r)
            elif b.failed:
                blame.append(r)
                notes.append(f"rank {r} failed: {b.failed}")
            elif a is not None and a.count == b.count:
                blame.append(r)
                notes.append(f"rank {r} sent no heartbeat for {self.probe_s:.1f} s: dead or "
                             f"hung")
            elif b.seq.get(channel, 0) < seq:
                blame.append(r)
                notes.append(f"rank {r} is alive but behind: at {channel} collective "
                             f"{b.seq.get(channel, 0)}, this rank at {seq} (stuck?)")
        if followers and not blame:  # nobody else to blame: name those that gave up
            blame = followers
        notes += [f"rank {r} gave up waiting too" for r in followers]
        return tuple(blame), "; ".join(notes)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)

    # ---- internals -------------------------------------------------------------------------
    def _value(self) -> str:
        return json.dumps({"count": self._count, "seq": dict(self.seq), "failed": self.failed,
                           "follower": self.follower})

    def _beat(self, store: Any) -> None:
        self._count += 1
        try:
            store.set(self.key(self.rank), self._value())
        except Exception as exc:  # keep beating: the store may come back, peers judge for us
            log.debug("rank %d: heartbeat not stored: %s", self.rank, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat(self._beat_store)
