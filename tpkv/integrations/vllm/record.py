"""BlockRecord: one vLLM block as the connector's host store and disk writer hold it, and the
checks a record and a block's bytes must pass."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpkv.integrations.prefix_index import block_key
from tpkv.ssd.crc_threads import crc_spread


class PendingCrc:
    """The CRC32C of a block saved this step, taken on a thread beside vLLM's steps (the
    store's CrcJobs): `value()` waits until it is set. A job that fails sets BAD_CRC, which no
    block matches."""

    __slots__ = ("_done", "_value")

    def __init__(self) -> None:
        self._value = BAD_CRC
        self._done = threading.Event()

    def set(self, value: int) -> None:
        self._value = value
        self._done.set()

    def value(self) -> int:
        self._done.wait()
        return self._value


BAD_CRC = -1  # matches no CRC32C


@dataclass(frozen=True)
class BlockRecord:
    """A stored block: its key, the parent key and tokens it was made from, its bytes
    ([layers, page_bytes] uint8) and their CRC32C (or the PendingCrc of a block just saved:
    `crc_value`), and the host slot holding them (HostSlots; -1: bytes of their own, a disk
    read with no room in memory)."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    data: np.ndarray
    crc: int | PendingCrc
    slot: int = -1


def crc_value(rec: BlockRecord) -> int:
    """The record's CRC32C, once taken (a PendingCrc is waited for)."""
    return rec.crc if isinstance(rec.crc, int) else rec.crc.value()


def record_problems(items: Sequence[tuple[bytes, BlockRecord]], block_shape: tuple[int, int]
                    ) -> list[str]:
    """Why each record is not the block of its key and this shape ("" when it is): another
    key, parent and tokens that hash to another key, another shape or dtype, or bytes whose
    CRC32C changed. The CRC32Cs of those that pass the other checks are taken at once
    (crc_spread); their bytes must not change meanwhile (held)."""
    problems = [_header_problem(key, rec, block_shape) for key, rec in items]
    todo = [i for i, p in enumerate(problems) if not p]
    for i, crc in zip(todo, crc_spread([items[i][1].data for i in todo])):
        recorded = crc_value(items[i][1])
        if crc != recorded:
            problems[i] = f"CRC32C {crc:#010x}, recorded {recorded:#010x}"
    return problems


def _header_problem(key: bytes, rec: BlockRecord, block_shape: tuple[int, int]) -> str:
    if rec.key != key:
        return f"record holds key {rec.key.hex()}"
    if block_key(rec.parent, rec.tokens) != key:
        return "its parent and tokens hash to another key"
    if rec.data.shape != block_shape or rec.data.dtype != np.uint8:
        return f"shape {rec.data.shape} {rec.data.dtype}, expected {block_shape} uint8"
    return ""


def data_problem(data: np.ndarray, block_shape: tuple[int, int]) -> str:
    """Why `data` is not a block of this shape, [layers, page_bytes] uint8 ("" when it is)."""
    if data.shape != block_shape or data.dtype != np.uint8:
        return f"has shape {data.shape} {data.dtype}, expected {block_shape} uint8"
    return ""
