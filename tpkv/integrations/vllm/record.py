"""BlockRecord: one vLLM block as the connector's host store and disk writer hold it, and the
checks a record and a block's bytes must pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tpkv.integrations.prefix_index import block_key
from tpkv.ssd.format import crc_of


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


def record_problem(key: bytes, rec: BlockRecord, block_shape: tuple[int, int]) -> str:
    """Why `rec` is not the block `key` of this shape ("" when it is): another key, parent and
    tokens that hash to another key, another shape or dtype, or bytes whose CRC32C changed."""
    if rec.key != key:
        return f"record holds key {rec.key.hex()}"
    if block_key(rec.parent, rec.tokens) != key:
        return "its parent and tokens hash to another key"
    if rec.data.shape != block_shape or rec.data.dtype != np.uint8:
        return f"shape {rec.data.shape} {rec.data.dtype}, expected {block_shape} uint8"
    crc = crc_of(rec.data)
    if crc != rec.crc:
        return f"CRC32C {crc:#010x}, recorded {rec.crc:#010x}"
    return ""


def data_problem(data: np.ndarray | Sequence[torch.Tensor], block_shape: tuple[int, int]) -> str:
    """Why `data` is not a block of this shape ("" when it is): [layers, page_bytes] uint8, or
    a uint8 row of page_bytes for each layer."""
    layers, page = block_shape
    if isinstance(data, np.ndarray):
        if data.shape != block_shape or data.dtype != np.uint8:
            return f"has shape {data.shape} {data.dtype}, expected {block_shape} uint8"
        return ""
    if len(data) != layers:
        return f"has {len(data)} layers, expected {layers}"
    for layer, row in enumerate(data):
        if row.dtype != torch.uint8 or row.numel() != page:
            return f"layer {layer} has {row.numel()} {row.dtype} values, expected {page} uint8"
    return ""
