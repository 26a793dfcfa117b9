"""L1 (CUDA) -> L2 (pinned) -> L3 -> L2 -> L1 through each copy method and each SSD backend."""

import importlib.util

import pytest

from tests.pool_cases import check_tier_round_trip, make_engine
from tpkv.config import KvGeometry, SsdConfig
from tpkv.ssd.store import SsdStore

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["posix", "kvikio"])
@pytest.mark.parametrize("method", ["dma", "kernel"])
def test_round_trip_cuda_all_tiers(tmp_path, backend, method):
    if backend == "kvikio" and importlib.util.find_spec("kvikio") is None:
        pytest.fail("kvikio is not importable on the GPU machine (source .devkit/bootstrap.sh)")
    # One KV head per rank, as at TP 8 of a Llama-3-8B (256 KiB blocks), on a single rank here so
    # that rank 0's segment completes the manifest.
    g = KvGeometry(num_layers=32, num_kv_heads=1, head_dim=128, dtype="bfloat16")
    engine = make_engine(g, l1_slots=48, l2_slots=40, device="cuda", method=method,
                         arena_blocks=16)
    store = SsdStore(SsdConfig(root=str(tmp_path), backend=backend), g, "m", rank=0)
    assert store.backend_name.startswith(backend)
    check_tier_round_trip(engine, store, seed=3, session="gpu-session")
    engine.host.close()
