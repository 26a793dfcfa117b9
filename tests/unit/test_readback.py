"""HostReadback off the GPU: the plain .cpu() path, for every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpkv.models.readback import HostReadback


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.int8])
def test_cpu_readback_equals_tolist(dtype):
    rb = HostReadback("cpu")
    t = torch.arange(-6, 6).reshape(3, 4).to(dtype)
    assert rb.tolist(t) == t.tolist()
    if dtype != torch.bfloat16:  # numpy has no bfloat16
        assert np.array_equal(rb.numpy(t), t.numpy())
    assert rb.num_mapped == 0 and not rb.can_map
