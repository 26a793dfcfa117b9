"""TpkvCache on CUDA at TP 1 (issue #5): a tiny seeded Llama (transformers, from a config) with
L1 on the GPU, L2 pinned and L3 on disk gives DynamicCache's greedy tokens and K/V, with
sessions resumed from L2 and from L3, in fp32 and bf16; an L3 miss feeds the lost tokens again.

The same run and checks as tests/unit/test_hf_cache.py (tests/hf_cases.py), on the GPU: the
attention kernels, the pinned DMA path and the pool writes are CUDA's there. Needs no conftest
(`python -m pytest -q -m gpu -p no:cacheprovider --noconftest tests/gpu`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_cases import (
    L1_BLOCKS,
    L2_BLOCKS,
    check_l3_miss_refed,
    check_through_l2_and_l3,
    one_process,
    run_tiered,
    tiny_llama,
)

pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
               miss: bool) -> tuple[dict[str, Any], int]:
    """run_tiered on DEVICE; L1 must be there, and L2 pinned whenever CUDA is present (the DMA
    path needs it). Returns the run and the model's layer count."""
    one_process(monkeypatch)
    model = tiny_llama(dtype=dtype, device=DEVICE)
    out = run_tiered(model, L1_BLOCKS, L2_BLOCKS, str(tmp_path / "l3"), miss=miss)
    assert out["l1_device"].startswith(DEVICE), out["l1_device"]
    assert out["l2_pinned"] == torch.cuda.is_available()
    if out["l2_pinned"]:  # every L2 block registered, and the pool counts it
        assert out["l2_pinned_bytes"] >= out["l2_bytes"] > 0, out
    else:
        assert out["l2_pinned_bytes"] == 0
    return out, model.config.num_hidden_layers


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_cache_gives_dynamic_cache_tokens_and_kv_through_l2_and_l3(tmp_path, monkeypatch,
                                                                        dtype):
    out, layers = run_on_gpu(tmp_path, monkeypatch, dtype, miss=False)
    check_through_l2_and_l3(out, layers)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_cache_feeds_the_tokens_an_l3_miss_lost_again(tmp_path, monkeypatch, dtype):
    out, layers = run_on_gpu(tmp_path, monkeypatch, dtype, miss=True)
    check_l3_miss_refed(out, layers)
