"""The vLLM connector's layer-wise loads into a KV cache on a GPU: the copy stream, its events,
and its order after the forward's stream (GPU machine only)."""

from __future__ import annotations

import pytest
import torch

from tests.layer_load_cases import LOADED, NAMES, GatedViews, loaded, stored_setup
from tpkv.integrations.vllm.layer_load import LayerCopier

pytestmark = pytest.mark.gpu


def test_a_layer_is_waited_for_alone_on_the_gpu() -> None:
    caches, copier, _, plan = stored_setup("cuda")
    gated = GatedViews(copier._views, gated=2)
    copier.layers = LayerCopier(gated, copier.rank)
    copier.load(plan.loads, NAMES)
    copier.wait_layer(NAMES[0])
    copier.wait_layer(NAMES[1])
    # read on the forward's stream, which now waits for layers 0 and 1's events
    assert loaded(caches, NAMES[0]) and loaded(caches, NAMES[1])
    assert not loaded(caches, NAMES[2])
    gated.gate.set()
    for name in NAMES[2:]:
        copier.wait_layer(name)
    assert copier.finish_layer_loads()
    assert all(loaded(caches, name) for name in NAMES)
    assert copier.take_failed_block_ids() == set()
    copier.close()


def test_the_copies_come_after_what_the_forward_stream_wrote_before() -> None:
    caches, copier, _, plan = stored_setup("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the forward's stream, then
    for t in caches.values():  # a write to the blocks the load fills (vLLM zeroing them)
        t[LOADED[:3]] = 0
    copier.load(plan.loads, NAMES)
    for name in NAMES:
        copier.wait_layer(name)
    assert copier.finish_layer_loads()
    assert all(loaded(caches, name) for name in NAMES)  # the zeros came first
    copier.close()


def test_a_background_load_comes_after_what_the_forward_stream_wrote_before() -> None:
    """vLLM zeroes freshly allocated blocks on its stream before start_load_kv: a background
    load's copies on the loader's stream must land after that write. Before, its stream did
    not wait for vLLM's, so a zeroing still queued behind other work could land last."""
    import dataclasses
    import time

    caches, copier, _, plan = stored_setup("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the forward's stream, then
    for t in caches.values():  # a write to the blocks the load fills (vLLM zeroing them)
        t[LOADED[:3]] = 0
    copier.load([dataclasses.replace(s, background=True) for s in plan.loads])
    deadline = time.monotonic() + 30
    done: set[str] = set()
    while "r" not in done and time.monotonic() < deadline:
        done |= copier.take_finished()
        time.sleep(0.01)
    assert "r" in done and copier.take_failed_block_ids() == set()
    torch.cuda.synchronize()
    assert all(loaded(caches, name) for name in NAMES)  # the zeros came first
    copier.close()
