"""Content-addressed blocks: a hash chain over block-sized token chunks, and an LRU index of them.

A block's key is xxh3-128 of its parent's key and its tokens (int64, little-endian); the chain
starts from a seed made of the model's fingerprint and the block size, so two prompts that share
their first n full blocks share their first n keys, and keys of different models or block sizes
never meet. The index has no torch, no Ray and no engine types: the vLLM scheduler holds it, or
an IndexService actor does (index_service.py, vllm/ray_index.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tpkv.checks import check_int
from tpkv.errors import BadRequestError

KEY_BYTES = 16


def chain_seed(model_fingerprint: str, block_tokens: int) -> bytes:
    """The parent key of a sequence's first block, for this model and block size."""
    if not isinstance(model_fingerprint, str) or not model_fingerprint:
        raise BadRequestError(f"model_fingerprint must be a non-empty str, got "
                              f"{model_fingerprint!r}")
    check_int("block_tokens", block_tokens)
    return xxhash.xxh3_128_digest(f"tpkv-blocks|{model_fingerprint}|{block_tokens}".encode())


def block_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The key of one block: its parent's key and its tokens."""
    h = xxhash.xxh3_128(parent)
    h.update(np.ascontiguousarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def extend_chain(keys: list[bytes], token_ids: Sequence[int], block_tokens: int,
                 seed: bytes) -> list[bytes]:
    """Append to `keys` (the chain of token_ids' first len(keys) blocks) the keys of every further
    full block of token_ids; return `keys`. A partial last block has no key."""
    num_full = len(token_ids) // block_tokens
    if len(keys) > num_full:
        raise BadRequestError(f"{len(keys)} keys given for {len(token_ids)} tokens, which hold "
                              f"{num_full} full blocks of {block_tokens}")
    parent = keys[-1] if keys else seed
    for i in range(len(keys), num_full):
        parent = block_key(parent, token_ids[i * block_tokens:(i + 1) * block_tokens])
        keys.append(parent)
    return keys


@dataclass
class IndexStats:
    """Counts since start: blocks asked to be stored, of them already held (stored once), kept
    after the store confirmed them, dropped for room, and forgotten on a failed save or load."""

    reserved: int = 0
    deduplicated: int = 0
    confirmed: int = 0
    evicted: int = 0
    forgotten: int = 0


class KeySets:
    """The stored and pending keys of an index (PrefixIndex's own, or a RemoteIndex's mirror of
    a service's), and what is read off them alone."""

    _stored: Any  # stored keys: an LRU OrderedDict, or a mirror's set
    _pending: Any  # keys being written

    def __len__(self) -> int:
        return len(self._stored) + len(self._pending)

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def holds(self, key: bytes) -> bool:
        return key in self._stored

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored (a prefix: it stops at the first that is not)."""
        n = 0
        for key in keys:
            if key not in self._stored:
                break
            n += 1
        return n

    def clear(self) -> list[bytes]:
        """Forget every key, stored or pending; return them (the store is to drop them). A
        pending key's later confirmation is ignored."""
        keys = list(self._stored) + sorted(self._pending)
        self._stored.clear()
        self._pending.clear()
        return keys


class PrefixIndex(KeySets):
    """Which block keys the store holds (`stored`) or is writing (`pending`), in LRU order.

    The index decides and the store follows: `reserve` names the keys to write and the keys to
    drop for room; `confirm` and `forget` take the store's report. Only stored keys match, so a
    prefix is served only once every block of it was written.
    """

    def __init__(self, capacity_blocks: int) -> None:
        check_int("capacity_blocks", capacity_blocks)
        self.capacity_blocks = capacity_blocks
        # Oldest use first. Chains are touched and confirmed deepest first, so a chain's deeper
        # blocks usually go before its parents; a block whose parent went first no longer
        # matches (matches are prefixes) and ages out.
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._pending: dict[bytes, None] = {}  # in the order reserved (parents first)
        self.stats = IndexStats()

    def state(self) -> tuple[list[bytes], list[bytes]]:
        """The stored keys (oldest use first) and the pending ones (in the order reserved)."""
        return list(self._stored), list(self._pending)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark stored keys as just used, the last one most recently (callers pass a chain
        deepest first, so that its parent is evicted after it)."""
        for key in keys:
            if key in self._stored:
                self._stored.move_to_end(key)

    def reserve(self, keys: Sequence[bytes], keep: Iterable[bytes] = ()
                ) -> tuple[list[bytes], list[bytes]]:
        """Claim room for `keys`: returns (keys to write, keys to drop). A key already stored or
        pending is not written again (it is touched); room comes from the least recently used
        stored keys outside `keep` (blocks loading this step). Keys that find no room are left
        out of both lists, in order: a later key is never written without its parent."""
        protected = set(keep).union(keys)
        to_write: list[bytes] = []
        to_drop: list[bytes] = []
        held: list[bytes] = []
        for key in keys:
            self.stats.reserved += 1
            if key in self._stored or key in self._pending:
                self.stats.deduplicated += 1
                held.append(key)
                continue
            if len(self) >= self.capacity_blocks and not self._evict_one(protected, to_drop):
                break
            self._pending[key] = None
            to_write.append(key)
        self.touch(reversed(held))
        return to_write, to_drop

    def reserve_all(self, batches: Sequence[Sequence[bytes]], keep: Iterable[bytes] = ()
                    ) -> list[tuple[list[bytes], list[bytes]]]:
        """`reserve` of each batch in order, with the same `keep`; their answers."""
        keep = list(keep)
        return [self.reserve(keys, keep=keep) for keys in batches]

    def adopt(self, keys: Sequence[bytes]) -> int:
        """Count keys a store already holds (found on disk at start, oldest use first) as stored,
        the newest that fit; return how many were taken."""
        room = self.capacity_blocks - len(self)
        taken = [k for k in keys if k not in self._stored and k not in self._pending]
        taken = taken[max(len(taken) - room, 0):] if room > 0 else []
        for key in taken:
            self._stored[key] = None
        return len(taken)

    def confirm(self, keys: Iterable[bytes]) -> None:
        """The store holds these keys now (pending -> stored, children before parents in the
        use order; unknown keys are ignored)."""
        done = set(keys)
        for key in reversed([k for k in self._pending if k in done]):
            del self._pending[key]
            self._stored[key] = None
            self.stats.confirmed += 1

    def forget(self, keys: Iterable[bytes]) -> None:
        """The store failed to write or to serve these keys: they no longer match."""
        for key in keys:
            if key in self._pending or key in self._stored:
                self._pending.pop(key, None)
                self._stored.pop(key, None)
                self.stats.forgotten += 1

    def _evict_one(self, protected: set[bytes], to_drop: list[bytes]) -> bool:
        for key in self._stored:
            if key not in protected:
                del self._stored[key]
                to_drop.append(key)
                self.stats.evicted += 1
                return True
        return False
