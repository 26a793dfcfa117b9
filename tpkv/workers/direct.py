"""DirectLoads: L3 loads whose blocks are read ahead, copied from the read-ahead buffers straight
into L1.

A returning session's L3 blocks are read ahead into pinned buffers of the store's own
(ssd/readahead.py) while its turn waits outside the batch. The step that lets it in loads them
into L2 (plan N) and promotes them into L1 (plan N+1, chained: workers/chain.py). Through L2, the
copy into L1 waits for a copy on the host from the buffers into the L2 slots (about 20 GB/s
across the store's threads on the H200 host: some 25 ms for a session of 900 blocks of 512 KiB).
Here the copy into L1 reads the buffers as the plan begins, and the L2 slots are filled from L1
afterwards by a copy on the L1 -> L2 stream that the executor tracks as a demotion piece: every
copy that reads or writes such an L2 slot, or fills such an L1 slot, and compute that writes
new K/V there, waits for it as for any demotion (DemotionPieces). So the L2 copy the controller
counts on is there before anything can use it, and the step's forward waits only for PCIe.

The lease on the buffers (ReadAhead.lease) is given back once the copy into L1 is done (`reap`,
`drain`). Only blocks the read ahead holds as hits under the session's current generation are
leased, so they are the bytes a read of the records gives now.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tpkv.protocol.plan import MovePlan
from tpkv.ssd.readahead import Lease
from tpkv.ssd.store import SsdStore
from tpkv.workers.chain import Chain
from tpkv.workers.copy_engine import CopyHandle
from tpkv.workers.layer_copies import LayerCopies


@dataclass
class Leased:
    """What DirectLoads.lease found: per block, the plan's load move, the chain's row, its
    host address and (on the CPU) bytes; and the leases that hold them."""

    loads: np.ndarray
    rows: np.ndarray
    addresses: np.ndarray
    blocks: list[np.ndarray]
    leases: list[Lease]


class DirectLoads:
    """One rank's leases of read-ahead buffers for copies into L1, until those are done."""

    def __init__(self, store: SsdStore, layers: LayerCopies) -> None:
        self.store, self.layers = store, layers
        self._held: list[tuple[CopyHandle, list[Lease]]] = []  # oldest first
        self.num_blocks = 0  # blocks loaded so in all

    @property
    def usable(self) -> bool:
        return self.layers.reads_addresses

    def lease(self, plan: MovePlan, idx: np.ndarray, chain: Chain) -> Leased | None:
        """The blocks of the plan's loads `idx` that `chain` promotes into L1 (rows not yet
        issued) and the read ahead holds; None when there are none."""
        self.reap()
        wanted = np.zeros(plan.num_moves, dtype=bool)
        wanted[idx] = True
        rows = np.flatnonzero(wanted[chain.loads] & ~chain.issued)
        if not len(rows):
            return None
        sessions = plan.session_idx[chain.loads[rows]]
        order = np.argsort(sessions, kind="stable")
        cuts = np.flatnonzero(np.diff(sessions[order])) + 1
        pinned = self.layers.engine.on_gpu
        got: list[np.ndarray] = []
        addresses: list[np.ndarray] = []
        blocks: list[np.ndarray] = []
        leases: list[Lease] = []
        for group in np.split(order, cuts):
            r = rows[group]
            loads = chain.loads[r]
            name = plan.session_names[int(plan.session_idx[loads[0]])]
            # on a GPU the copies take addresses; on the CPU they copy the rows as arrays
            lease = self.store.ahead.lease(name, plan.logical_idx[loads], pinned=pinned,
                                           views=not pinned)
            if lease is None:
                continue
            got.append(r[lease.rows])
            addresses.append(lease.addresses)
            blocks += lease.blocks
            leases.append(lease)
        if not got:
            return None
        r = np.concatenate(got)
        self.num_blocks += len(r)
        return Leased(chain.loads[r], r, np.concatenate(addresses), blocks, leases)

    def hold(self, handle: CopyHandle, leases: list[Lease]) -> None:
        """The copies that read `leases` end with `handle` (done already on the CPU)."""
        self._held.append((handle, leases))
        self.reap()

    def reap(self) -> None:
        """Give back the leases whose copies are done (they end in order, on one stream)."""
        while self._held and self._held[0][0].done():
            self._give_back(self._held.pop(0)[1])

    def drain(self) -> None:
        """Wait for every copy that reads a lease, and give them all back."""
        while self._held:
            handle, leases = self._held.pop(0)
            handle.wait()
            self._give_back(leases)

    def _give_back(self, leases: list[Lease]) -> None:
        for lease in leases:
            self.store.ahead.release(lease)
