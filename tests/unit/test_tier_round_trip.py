"""L1 -> L2 -> L3 -> L2 -> L1 on CPU through the copy engine and the SSD store: bit-exact."""

import pytest

from tests.pool_cases import check_tier_round_trip, make_engine
from tpkv.config import KvGeometry, SsdConfig
from tpkv.ssd.store import SsdStore


@pytest.mark.parametrize("geometry", [
    KvGeometry(num_layers=4, num_kv_heads=8, head_dim=16, dtype="bfloat16", tp_size=2),
    KvGeometry(num_layers=3, num_kv_heads=2, head_dim=6, dtype="float32", block_tokens=5),
], ids=["aligned", "unaligned"])
def test_round_trip_through_all_tiers(tmp_path, geometry):
    engine = make_engine(geometry, l1_slots=40, l2_slots=30, device="cpu", arena_blocks=7)
    store = SsdStore(SsdConfig(root=str(tmp_path)), geometry, "model-a", rank=0)
    if geometry.tp_size > 1:  # the manifest needs every rank: play rank 1 with the same blocks
        other = SsdStore(SsdConfig(root=str(tmp_path)), geometry, "model-a", rank=1)
        store = _BothRanks(store, other)
    for seed in range(2):
        check_tier_round_trip(engine, store, seed, session=f"s-{seed}")
    engine.host.close()


class _BothRanks:
    """Writes every block through two ranks' stores, reads through the first."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def write_blocks(self, session, logical, blocks):
        self.second.write_blocks(session, logical, blocks)
        return self.first.write_blocks(session, logical, blocks)

    def commit_manifest(self, session):
        return self.first.commit_manifest(session)

    def read_blocks(self, session, logical, out):
        return self.first.read_blocks(session, logical, out)
