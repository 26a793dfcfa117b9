"""relocate_bytes: a resync's moves of block bytes on one rank, staged through host memory."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from tpkv.protocol.plan import Tier
from tpkv.ssd.store import SsdStore
from tpkv.workers.copy_engine import CopyEngine, CopyHandle
from tpkv.workers.mirror import Relocation
from tpkv.workers.outcome import wait_handle

log = logging.getLogger(__name__)

HBM, DRAM, SSD = int(Tier.HBM), int(Tier.DRAM), int(Tier.SSD)


def relocate_bytes(engine: CopyEngine, store: SsdStore | None,
                   commit: Callable[[str, float], object], rel: Relocation,
                   timeout_s: float) -> np.ndarray:
    """Move bytes so this rank matches the controller's table after a resync, with no copy or
    spill running: every source is staged in host memory first, so a chain of moves cannot
    overwrite its own input; an L3 destination is written and its manifest committed
    (`commit`, SpillTracker.commit). Returns the ids of blocks this rank holds nowhere (lost
    here; their bytes are zeros)."""
    hbm, host = engine.hbm, engine.host
    n, block_bytes = rel.num_blocks, hbm.block_bytes
    staging = np.zeros((n, block_bytes), dtype=np.uint8)
    have = np.zeros(n, dtype=bool)
    for i in range(n):
        tier, slot = int(rel.src_tier[i]), int(rel.src_slot[i])
        if tier == HBM:
            staging[i] = hbm.tensor[slot].reshape(-1).view(torch.uint8).cpu().numpy()
            have[i] = True
        elif tier == DRAM:
            staging[i], have[i] = host.block_bytes_view(slot), True
        elif tier == SSD and store is not None:
            have[i] = bool(store.read_blocks(rel.sessions[i], rel.logical_idx[i:i + 1],
                                             [staging[i]])[0])
    for i in range(n):
        tier, slot = int(rel.dst_tier[i]), int(rel.dst_slot[i])
        if tier == HBM:
            dst = hbm.tensor[slot].reshape(-1).view(torch.uint8)
            dst.copy_(torch.from_numpy(staging[i]).to(dst.device))
        elif tier == DRAM:
            host.block_bytes_view(slot)[:] = staging[i]
        elif tier == SSD and store is not None and have[i]:
            store.write_blocks(rel.sessions[i], rel.logical_idx[i:i + 1], [staging[i]])
            commit(rel.sessions[i], time.monotonic() + timeout_s)
    if engine.on_gpu:
        done = CopyHandle(n, n * block_bytes, "relocate", "h2d", torch.cuda.Event())
        assert done.event is not None
        done.event.record(torch.cuda.current_stream(hbm.device))
        wait_handle(done, time.monotonic() + timeout_s, "resync relocation")
    lost = rel.block_ids[~have]
    if len(lost):
        log.error("resync: %d blocks have no copy on this rank (e.g. %d); their bytes are "
                  "zeros here", len(lost), int(lost[0]))
    return lost
