"""The tiered engine on CUDA: L1 on the GPU, L2 pinned, L3 on disk; tokens equal an all-L1 run."""

from __future__ import annotations

import pytest

from tests.multiproc.test_engine_tiered import check, tiered_rank

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["load", "recompute", "miss"])
def test_tp1_tiered_engine_on_cuda_gives_the_tokens_of_a_large_l1(tmp_path, monkeypatch, mode):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tiered_rank(0, 1, str(tmp_path / "l3"), mode, "cuda")
    check(out, mode)
    # each step's trace keeps the copies it was scheduled with and adds those of the plans
    # applied once its forward was launched
    watched = out["watched"]
    assert watched["lost_spans"] == 0, watched
    assert watched["later_spans"] > 0 or mode == "recompute", watched
