"""Which loads the connector runs in the background (vLLM's asynchronous KV loads)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tpkv.checks import check_int
from tpkv.errors import ConfigError
from tpkv.integrations.vllm.options import ASYNC_LOAD_MODES


class LoadPolicy:
    """Decides, when vLLM asks how many tokens tpkv holds, whether their load runs in the
    background: the request waits in vLLM's WAITING_FOR_REMOTE_KVS state while other requests'
    steps go on, and joins a later step once every rank loaded it (one step later at least).
    A load from host memory takes a copy per block and is done in the step, layer by layer
    as the forward reaches each layer (a small one costs less than the extra step); a read
    from the disk tier is the slow part, so in mode "auto" a load runs in the background when
    one of its blocks is likely on disk, or when it is `min_bytes` or more (each rank's bytes).
    "always" and "never" do as they say.

    The scheduler does not see which tier a worker holds a block in, so the policy keeps its
    own estimate: the last `host_blocks` keys stored or loaded by this process, the ones the
    workers' host memory keeps most recently used (a block found on disk at start, or pushed
    out since, is not among them). A wrong guess costs time, never correctness."""

    def __init__(self, mode: str, min_bytes: int, block_bytes: int, host_blocks: int) -> None:
        if mode not in ASYNC_LOAD_MODES:
            raise ConfigError(f"async_loads must be one of {list(ASYNC_LOAD_MODES)}, got {mode!r}")
        check_int("async_load_bytes", min_bytes, lo=0)
        check_int("block_bytes", block_bytes)
        check_int("host_blocks", host_blocks, lo=0)
        self.mode = mode
        self.min_bytes = min_bytes
        self.block_bytes = block_bytes
        self.host_blocks = host_blocks
        self._hot: OrderedDict[bytes, None] = OrderedDict()  # oldest use first

    def runs_async(self, keys: Sequence[bytes]) -> bool:
        """Whether the load of `keys` runs in the background."""
        if not keys or self.mode == "never":
            return False
        if self.mode == "always" or len(keys) * self.block_bytes >= self.min_bytes:
            return True
        return any(key not in self._hot for key in keys)

    def used(self, keys: Iterable[bytes]) -> None:
        """Keys stored or loaded now: host memory holds them, most recently used."""
        for key in keys:
            self._hot[key] = None
            self._hot.move_to_end(key)
        while len(self._hot) > self.host_blocks:
            self._hot.popitem(last=False)

    def gone(self, keys: Iterable[bytes]) -> None:
        """Keys dropped or forgotten: held nowhere."""
        for key in keys:
            self._hot.pop(key, None)

    def clear(self) -> None:
        self._hot.clear()
