"""PinnedBuffers: which host buffers are pinned for GPU copies, pinned and unpinned through
hooks the caller gives (the store knows no CUDA)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

Register = Callable[[int, int], None]  # pin a host range: (address, bytes)
Unregister = Callable[[int], None]


class PinnedBuffers:
    """Buffers pinned by `register` once `use` gave the hooks (none before: nothing is pinned).
    The first pin that fails stops the pinning (`error`); the buffers stay usable, unpinned."""

    def __init__(self) -> None:
        self._hooks: tuple[Register, Unregister] | None = None
        self._pinned: set[int] = set()  # addresses
        self._lock = threading.Lock()
        self.error: str | None = None

    def use(self, register: Register, unregister: Unregister) -> None:
        self._hooks = (register, unregister)

    def pin(self, buf: np.ndarray) -> None:
        """Pin a new buffer (where the hooks are given and no pin failed yet)."""
        if self._hooks is None or self.error is not None:
            return
        try:
            self._hooks[0](buf.ctypes.data, buf.nbytes)
        except Exception as exc:  # a memory limit: the buffer still serves host copies
            self.error = str(exc)
            log.warning("pinning a %d-byte buffer failed (%s); the buffers stay unpinned from "
                        "now on", buf.nbytes, exc)
            return
        with self._lock:
            self._pinned.add(buf.ctypes.data)

    def holds(self, buf: np.ndarray) -> bool:
        return buf.ctypes.data in self._pinned

    def unpin(self, buf: np.ndarray) -> None:
        """A buffer about to be dropped (nothing reads it any more): unpin it first."""
        with self._lock:
            if buf.ctypes.data not in self._pinned:
                return
            self._pinned.discard(buf.ctypes.data)
        self._unregister(buf.ctypes.data)

    def close(self) -> None:
        """Unpin every buffer (before they can be unmapped)."""
        with self._lock:
            addresses, self._pinned = sorted(self._pinned), set()
        for address in addresses:
            self._unregister(address)

    def _unregister(self, address: int) -> None:
        assert self._hooks is not None
        try:
            self._hooks[1](address)
        except Exception as exc:  # nothing lost: the buffer is no longer used
            log.warning("unpinning a buffer failed: %s", exc)
