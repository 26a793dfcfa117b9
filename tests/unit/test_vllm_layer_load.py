"""The vLLM connector's layer-wise loads without vLLM: a step's loads copied layer by layer, each
layer waited for alone, every layer in by the step's end, failures recomputed."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.layer_load_cases import LOADED, NAMES, STORED, GatedViews, loaded, stored_setup
from tpkv.integrations.vllm.layer_load import LayerCopier, LayerHooks
from tpkv.integrations.vllm.plan import LoadSpec


def test_a_layer_is_waited_for_alone_and_every_layer_is_in_by_the_end() -> None:
    caches, copier, _, plan = stored_setup()
    gated = GatedViews(copier._views, gated=2)  # layer 2's copy held back
    copier.layers = LayerCopier(gated, copier.rank)
    copier.load(plan.loads, NAMES)
    copier.wait_layer(NAMES[0])
    copier.wait_layer(NAMES[1])
    # layers 0 and 1 are in, bit-exact, while layer 2's copy has not run
    assert loaded(caches, NAMES[0]) and loaded(caches, NAMES[1])
    job = copier._layer_job
    assert job is not None and not job.copied[2].is_set()
    assert not loaded(caches, NAMES[2]) and not loaded(caches, NAMES[3])
    gated.gate.set()
    for name in NAMES[2:]:
        copier.wait_layer(name)
    assert copier.finish_layer_loads()
    assert all(loaded(caches, name) for name in NAMES)
    assert copier.take_failed_block_ids() == set()
    assert copier.num_loaded_blocks == copier.num_layer_loaded_blocks == 3
    copier.close()


def test_layers_are_copied_in_the_order_the_forward_runs_them() -> None:
    caches, copier, _, plan = stored_setup()
    order = NAMES[::-1]
    gated = GatedViews(copier._views, gated=0)  # the last layer of this order held back
    copier.layers = LayerCopier(gated, copier.rank)
    copier.load(plan.loads, order)
    copier.wait_layer(order[0])
    assert loaded(caches, order[0]) and not loaded(caches, NAMES[0])
    gated.gate.set()
    for name in order:
        copier.wait_layer(name)
    assert copier.finish_layer_loads() and all(loaded(caches, n) for n in NAMES)
    copier.close()


def test_a_step_whose_forward_skipped_a_layer_recomputes_its_loaded_blocks() -> None:
    caches, copier, planner, plan = stored_setup()
    copier.load(plan.loads, NAMES)
    for name in NAMES[:-1]:  # the forward never waits for the last layer
        copier.wait_layer(name)
    copier.wait_layer("drafter.attn")  # not a layer of this KV cache: waits for every layer
    assert all(loaded(caches, name) for name in NAMES)
    assert not copier.finish_layer_loads()  # every layer is in, but the last one was not waited for
    assert copier.take_failed_block_ids() == set(LOADED[:3])
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and report.failed_load_reqs == {"r": 0}
    assert len(report.failed_loads) == 3 and copier.num_layer_misses == 1
    copier.close()


def test_the_step_end_waits_for_every_layer_when_no_layer_was_waited_for() -> None:
    caches, copier, _, plan = stored_setup()
    gated = GatedViews(copier._views, gated=3)
    copier.layers = LayerCopier(gated, copier.rank)
    copier.load(plan.loads, NAMES)
    timer = threading.Timer(0.05, gated.gate.set)  # the copy ends only after a while
    timer.start()
    copier.apply_after_forward(plan)  # wait_for_save: every layer in before anything else
    assert all(loaded(caches, name) for name in NAMES)
    assert copier.take_failed_block_ids() == set(LOADED[:3])  # never waited: recomputed
    copier.close()


def test_a_damaged_record_under_a_layer_wise_load_is_recomputed() -> None:
    caches, copier, planner, plan = stored_setup()
    keys = planner._reqs["r"].keys
    store = copier.store
    assert store is not None
    rec = store.record(keys[1])
    assert rec is not None
    rec.data[2, 7] ^= 0x01  # a byte of layer 2
    before = {name: t[LOADED[1]].clone() for name, t in caches.items()}
    copier.load(plan.loads, NAMES)
    for name in NAMES:
        copier.wait_layer(name)
    assert copier.finish_layer_loads()
    assert copier.take_failed_block_ids() == {LOADED[1]}
    for name, t in caches.items():
        assert torch.equal(t[LOADED[1]], before[name])  # no layer of it was written
        assert torch.equal(t[LOADED[0]], t[STORED[0]])
    copier.apply_after_forward(plan)
    report = copier.take_report()
    assert report is not None and report.failed_loads == {keys[1]}
    assert report.failed_load_reqs == {"r": 1}
    copier.close()


def test_a_copy_that_fails_is_a_failed_load_and_no_wait_hangs() -> None:
    _, copier, _, plan = stored_setup()
    copier.layers = LayerCopier(GatedViews(copier._views, gated=1, fail=True), copier.rank)
    copier.load(plan.loads, NAMES)
    for name in NAMES:
        copier.wait_layer(name)
    assert copier.finish_layer_loads()  # the forward waited; the copy failed
    assert copier.take_failed_block_ids() == set(LOADED[:3])
    assert copier.num_loaded_blocks == 0
    copier.close()


def test_loads_run_whole_until_a_forward_waited_for_every_layer() -> None:
    hooks = LayerHooks(NAMES)
    for name in NAMES[:2]:
        hooks.seen(name)
    hooks.step_done()
    assert hooks.order is None  # two layers of four: no order learned
    for name in ["model.layers.1.self_attn.attn", *NAMES[1:], "drafter.attn", NAMES[0]]:
        hooks.seen(name)
    hooks.step_done()
    assert hooks.order == [*NAMES[1:], NAMES[0]]  # the order of the first calls
    hooks.missed()
    for name in NAMES:
        hooks.seen(name)
    hooks.step_done()
    assert hooks.off and hooks.order is None  # off for good
    scheduler_side = LayerHooks(())
    scheduler_side.step_done()
    assert scheduler_side.order is None


@pytest.mark.parametrize("layer_order", [None, NAMES])
def test_a_background_load_is_left_to_the_loader(layer_order: list[str] | None) -> None:
    caches, copier, _, plan = stored_setup()
    spec = plan.loads[0]
    background = LoadSpec(spec.req_id, spec.first_block, spec.block_ids, spec.keys,
                          background=True, inline=True)
    copier.load([background], layer_order)
    assert copier._layer_job is None and copier.num_async_loads == 1
    assert copier.take_finished() == {"r"}
    assert all(loaded(caches, name) for name in NAMES)
    copier.close()
