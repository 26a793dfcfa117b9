"""BlockRecord: one vLLM block as the connector's host store and disk writer hold it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockRecord:
    """A stored block: its key, the parent key and tokens it was made from, its bytes
    ([layers, page_bytes] uint8) and their CRC32C, and the host slot holding them (HostSlots;
    -1: bytes of their own, a disk read with no room in memory)."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    data: np.ndarray
    crc: int
    slot: int = -1
