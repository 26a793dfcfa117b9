"""The content-addressed block keys (hash chain) and the prefix index that serves them."""

from __future__ import annotations

import pytest

from tpkv.errors import BadRequestError, ConfigError
from tpkv.integrations.prefix_index import PrefixIndex, block_key, chain_seed, extend_chain

BT = 4
SEED = chain_seed("model-a", BT)


def keys_of(tokens: list[int], seed: bytes = SEED, bt: int = BT) -> list[bytes]:
    return extend_chain([], tokens, bt, seed)


def test_shared_prefix_shares_leading_keys_only() -> None:
    a = keys_of(list(range(10)))  # two full blocks; tokens 8, 9 have no key
    b = keys_of(list(range(6)) + [99, 7, 8, 9, 10, 11])
    assert len(a) == 2 and len(b) == 3
    assert a[0] == b[0] and a[1] != b[1]
    assert len(set(a) | set(b)) == 4


def test_chain_is_incremental_and_parent_dependent() -> None:
    tokens = list(range(20))
    whole = keys_of(tokens)
    grown = extend_chain(keys_of(tokens[:9]), tokens, BT, SEED)
    assert grown == whole
    assert whole[1] == block_key(whole[0], tokens[4:8])
    # the same tokens under another parent are another block
    assert block_key(SEED, tokens[4:8]) != whole[1]
    with pytest.raises(BadRequestError, match="3 keys given for 8 tokens"):
        extend_chain(whole[:3], tokens[:8], BT, SEED)


def test_seed_separates_models_and_block_sizes() -> None:
    tokens = list(range(16))
    other_model = keys_of(tokens, chain_seed("model-b", BT))
    other_size = keys_of(tokens, chain_seed("model-a", 8), 8)
    assert not set(keys_of(tokens)) & (set(other_model) | set(other_size))
    with pytest.raises(BadRequestError):
        chain_seed("", BT)
    with pytest.raises(ConfigError):
        chain_seed("m", 0)


def test_only_confirmed_keys_match_and_a_prefix_stops_at_a_gap() -> None:
    keys = keys_of(list(range(16)))
    index = PrefixIndex(capacity_blocks=8)
    write, drop = index.reserve(keys)
    assert write == keys and drop == []
    assert index.match(keys) == 0  # pending: not written yet
    index.confirm(keys[:1] + keys[2:])
    assert index.match(keys) == 1  # key 1 still pending: the prefix ends there
    index.forget(keys[1:2])  # its save failed
    assert index.match(keys) == 1 and index.num_pending == 0
    assert index.stats.confirmed == 3 and index.stats.forgotten == 1


def test_reserve_writes_a_shared_prefix_once() -> None:
    index = PrefixIndex(capacity_blocks=16)
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    b = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    wa, _ = index.reserve(a)
    wb, _ = index.reserve(b)  # same step: a's keys are pending
    assert wa == a and wb == b[2:]
    index.confirm(wa + wb)
    wa2, _ = index.reserve(a)
    assert wa2 == [] and len(index) == 4 and index.stats.deduplicated == 5


def test_eviction_is_lru_spares_kept_keys_and_stops_without_room() -> None:
    index = PrefixIndex(capacity_blocks=3)
    old = keys_of(list(range(12)))  # 3 blocks fill the index
    index.confirm(index.reserve(old)[0])
    index.touch([old[0]])  # old[1] is now the least recently used
    new = keys_of([50] * 8)
    write, drop = index.reserve(new, keep=[old[1]])
    assert write == new and drop == [old[2], old[0]]
    assert index.num_stored == 1 and index.num_pending == 2
    # nothing left to evict (pending keys and kept keys stay): later keys are not written
    write, drop = index.reserve(keys_of([60] * 8), keep=[old[1]])
    assert write == [] and drop == []
    assert len(index) == 3 and index.stats.evicted == 2


def test_clear_returns_stored_and_pending_keys() -> None:
    index = PrefixIndex(capacity_blocks=8)
    keys = keys_of(list(range(12)))
    index.reserve(keys)
    index.confirm(keys[:2])
    assert sorted(index.clear()) == sorted(keys)
    index.confirm(keys)  # a late confirmation of a cleared key
    assert len(index) == 0 and index.match(keys) == 0


def test_a_chain_is_evicted_deepest_block_first() -> None:
    index = PrefixIndex(capacity_blocks=4)
    chain = keys_of(list(range(12)))  # 3 blocks
    index.confirm(index.reserve(chain)[0])
    _, drop = index.reserve(keys_of([70] * 8))  # room for 2 more: 1 evicted
    assert drop == [chain[2]]
    assert index.match(chain) == 2
    # a match served from the index touches the chain deepest first: its root stays longest
    other = keys_of([70] * 8)
    index.confirm(other)
    index.touch(reversed(chain[:2]))
    _, drop = index.reserve(keys_of([80] * 12))
    assert drop == [other[1], other[0], chain[1]]
