"""CrcJobs: the CRC32Cs of the blocks a step saved, taken on a thread of their own once the save
has returned, so that vLLM's step waits only for the copies. Each job holds its blocks' slots
until it is done (HostSlots references: the bytes cannot change under it) and sets each block's
PendingCrc; a reader of a record whose CRC32C is pending (a load's check, a disk write) waits
for it. A job that fails sets BAD_CRC: its blocks are misses, never served."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tpkv.integrations.vllm.host_slots import HostSlots
from tpkv.integrations.vllm.record import BAD_CRC, PendingCrc
from tpkv.ssd.crc_threads import crc_spread

log = logging.getLogger(__name__)


class CrcJobs:
    """One thread running CRC jobs in order (each spreads its CRC32Cs with crc_spread)."""

    def __init__(self, slots: HostSlots) -> None:
        self.slots = slots
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None  # jobs run in order: the last one ends last

    def start(self, slots: list[int]) -> list[PendingCrc]:
        """The pending CRC32C of each slot's block, taken on the thread."""
        pending = [PendingCrc() for _ in slots]
        if not slots:
            return pending
        for slot in slots:
            self.slots.ref(slot)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpkv-vllm-crc")
        try:
            self._last = self._pool.submit(self._run, slots, pending)
        except BaseException:
            self._finish(slots, pending, [BAD_CRC] * len(slots))
            raise
        return pending

    def _run(self, slots: list[int], pending: list[PendingCrc]) -> None:
        crcs = [BAD_CRC] * len(slots)
        try:
            views: list[np.ndarray] = [self.slots.view(slot) for slot in slots]
            crcs = crc_spread(views)
        except Exception:
            log.exception("tpkv vLLM store: the CRC32Cs of %d saved blocks failed; they are "
                          "not served", len(slots))
        finally:
            self._finish(slots, pending, crcs)

    def _finish(self, slots: list[int], pending: list[PendingCrc], crcs: list[int]) -> None:
        for p, crc in zip(pending, crcs):
            p.set(crc)
        for slot in slots:
            self.slots.release(slot)

    def wait(self) -> None:
        """Return once every job started so far is done (their slots' holds are let go)."""
        last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        """Wait for every job (their slots must not be freed under them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
