"""The planner on a prefix index in another process, without Ray: an in-process IndexService
behind a transport that can be dead or slow (fault injection)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tpkv.errors import ConfigError, IndexOwnerError, IndexUnavailableError, WireFormatError
from tpkv.integrations.disk_blocks import DiskBlockStore
from tpkv.integrations.disk_format import DiskLayout, record_bytes
from tpkv.integrations.index_service import IndexService, IndexSpec
from tpkv.integrations.prefix_index import chain_seed, extend_chain
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.options import ConnectorOptions, instance_id
from tpkv.integrations.vllm.plan import StepPlan
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.remote_index import RemoteIndex
from tpkv.protocol.wire import decode, encode

BT = 4
NUM_BLOCKS = 16
SEED = chain_seed("test-model", BT)
PROMPT = list(range(100, 111))  # 11 tokens: 2 full blocks


class FakeTransport:
    """An IndexService in this process. `dead`: every call fails, and no service can be found;
    `delay_s`: answers come that late (the service applies the call at once all the same, as
    a slow actor does); `restart()`: a new service, its index rebuilt from the disk tier."""

    def __init__(self, spec: IndexSpec) -> None:
        self.spec = spec
        self.service = IndexService(spec.to_bytes())
        self.dead = False
        self.delay_s = 0.0
        self.garbage: bytes | None = None  # answered instead of the service's answer
        self.calls = 0
        self.sent_at = 0.0
        self.closed = False

    def restart(self) -> None:
        self.service = IndexService(self.spec.to_bytes())

    def send(self, payload: bytes) -> Any:
        self.calls += 1
        if self.dead:
            return None
        return time.monotonic(), self.service.call(payload)

    def ready(self, handle: Any) -> bool:
        return handle is not None and time.monotonic() >= handle[0] + self.delay_s

    def result(self, handle: Any, timeout_s: float) -> bytes:
        if handle is None:
            raise IndexUnavailableError("actor died")
        wait = handle[0] + self.delay_s - time.monotonic()
        if wait > timeout_s:
            time.sleep(timeout_s)
            raise IndexUnavailableError(f"no answer within {timeout_s} s")
        time.sleep(max(wait, 0))
        return self.garbage if self.garbage is not None else bytes(handle[1])

    def reconnect(self) -> None:
        if self.dead:
            raise IndexUnavailableError("no actor")

    def close(self) -> None:
        self.closed = True


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens))


def setup(spec: IndexSpec | None = None, timeout_s: float = 1.0, retry_s: float = 0.0
          ) -> tuple[Planner, FakeTransport, BlockCopier, dict[str, torch.Tensor]]:
    spec = spec or IndexSpec(64, BT, SEED)
    transport = FakeTransport(spec)
    index = RemoteIndex(transport, spec.capacity_blocks, timeout_s, retry_s=retry_s)
    planner = Planner(BT, SEED, spec.capacity_blocks, index=index)
    g = torch.Generator().manual_seed(0)
    caches = {f"layer{i}": torch.randn(NUM_BLOCKS, 2, BT, 8, generator=g) for i in range(2)}
    copier = BlockCopier(capacity_bytes=1 << 20)
    copier.register(caches, NUM_BLOCKS)
    return planner, transport, copier, caches


def step(planner: Planner, copier: BlockCopier, scheduled: list[tuple[str, int]],
         blocks: dict[str, list[int]]) -> StepPlan:
    plan = planner.plan(scheduled, lambda r: blocks[r])
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    if report is not None:
        planner.report(report)
    return plan


def serve_first(planner: Planner, copier: BlockCopier) -> None:
    """r1 computes PROMPT and stores its 2 full blocks (vLLM blocks 3 and 7)."""
    assert planner.matched_tokens(request("r1", PROMPT), 0) == 0
    plan = step(planner, copier, [("r1", 11)], {"r1": [3, 7, 9]})
    assert len(plan.saves) == 2
    planner.finished("r1")


def test_remote_index_serves_as_the_local_one_in_one_call_a_step() -> None:
    planner, transport, copier, caches = setup()
    calls = transport.calls  # the start's sync
    serve_first(planner, copier)
    assert transport.calls == calls + 1  # the step's reserves; the confirms wait in the queue
    assert planner.index.num_stored == 2  # the mirror confirmed them at the report
    second = request("r2", PROMPT)
    assert planner.matched_tokens(second, 0) == 8  # from the mirror, no call
    assert transport.calls == calls + 1
    planner.after_alloc(second, [10, 11, 12], 8)
    plan = step(planner, copier, [("r2", 11)], {"r2": [10, 11, 12]})
    assert transport.calls == calls + 2 and not plan.saves
    for layer in caches.values():
        assert torch.equal(layer[10], layer[3]) and torch.equal(layer[11], layer[7])
    assert copier.take_failed_block_ids() == set()
    # the service applied the queued confirms before the reserves: it holds what the mirror does
    stored, pending = transport.service.index.state()
    assert set(stored) == set(extend_chain([], PROMPT, BT, SEED)) and pending == []
    assert planner.index.stats.confirmed == 2 and planner.index.stats.deduplicated == 2
    # a step with nothing to store makes no call
    planner.plan([("r2", 11)], lambda r: [10, 11, 12])
    assert transport.calls == calls + 2


def test_dead_actor_means_no_match_no_save_one_warning_and_loads_already_planned_run(
        caplog: pytest.LogCaptureFixture) -> None:
    planner, transport, copier, caches = setup(retry_s=3600)
    serve_first(planner, copier)
    held = request("r2", PROMPT)
    assert planner.matched_tokens(held, 0) == 8
    planner.after_alloc(held, [10, 11, 12], 8)
    transport.dead = True
    with caplog.at_level(logging.WARNING):
        plan = step(planner, copier, [("r2", 11), ("r3", 0)], {"r2": [10, 11, 12]})
        # the load vLLM was promised still runs (the ranks hold its blocks), bit exact
        assert [s.keys for s in plan.loads] == [extend_chain([], PROMPT, BT, SEED)]
        assert copier.take_failed_block_ids() == set()
        assert torch.equal(caches["layer0"][10], caches["layer0"][3])
        for i in range(3):
            other = request(f"n{i}", PROMPT + [5] * 8)
            assert planner.matched_tokens(other, 0) == 0  # vLLM computes the prompt
            plan = step(planner, copier, [(f"n{i}", 19)], {f"n{i}": [1, 2, 4, 5, 6]})
            assert plan.saves == [] and plan.loads == []
            stats = planner.finished(f"n{i}")
            assert stats["written_blocks"] == stats["deduplicated_blocks"] == 0
    warnings = [r for r in caplog.records if "prefix index unavailable" in r.getMessage()]
    assert len(warnings) == 1 and planner.index.down
    assert planner.index.num_stored == 0


def test_slow_actor_costs_one_bounded_wait_then_none() -> None:
    planner, transport, copier, _ = setup(timeout_s=0.2, retry_s=0.0)
    serve_first(planner, copier)
    transport.delay_s = 30.0
    planner.matched_tokens(request("a", PROMPT + [9] * 8), 0)
    began = time.monotonic()
    plan = planner.plan([("a", 19)], lambda r: [1, 2, 4, 5, 6])
    first = time.monotonic() - began
    assert plan.saves == [] and planner.index.down
    assert 0.2 <= first < 1.0
    began = time.monotonic()
    for i in range(20):  # probes go out, none is waited on
        assert planner.matched_tokens(request(f"b{i}", PROMPT), 0) == 0
        planner.plan([(f"b{i}", 11)], lambda r: [1, 2, 4])
    assert time.monotonic() - began < 0.5
    transport.delay_s = 0.0  # it answers again: the probe's answer brings the index back
    time.sleep(0.01)
    assert planner.matched_tokens(request("c", PROMPT), 0) == 0  # rebuilt: no disk tier
    assert not planner.index.down
    # the slow service took reserves the scheduler never saw: asked to sync, it started over
    assert planner.index.num_pending == 0
    assert planner.matched_tokens(request("d", PROMPT), 0) == 0  # host blocks: never matched
    plan = step(planner, copier, [("d", 11)], {"d": [3, 7, 9]})
    assert len(plan.saves) == 2  # stored again from here
    assert planner.matched_tokens(request("e", PROMPT), 0) == 8


def disk_records(root: Path, tokens: list[int], seed: bytes = SEED) -> list[bytes]:
    """The full blocks of `tokens` (BT tokens each, chained from `seed`) written to a disk
    tier at `root`, as the connector's ranks write them; their keys."""
    shape = (2, 256)
    keys = extend_chain([], tokens, BT, seed)
    disk = DiskBlockStore(str(root), 10 * record_bytes(BT, shape[0] * shape[1]),
                          DiskLayout(seed, 0, BT, shape))
    rng = np.random.default_rng(0)
    for i, key in enumerate(keys):
        assert disk.put(key, keys[i - 1] if i else seed, tuple(tokens[i * BT:(i + 1) * BT]),
                        rng.integers(0, 256, shape, dtype=np.uint8))
    disk.close()
    return keys


def test_restarted_actor_is_taken_back_with_the_disk_tier_index(tmp_path: Path) -> None:
    on_disk = disk_records(tmp_path, PROMPT)
    spec = IndexSpec(64, BT, SEED, 1, str(tmp_path), 8)
    planner, transport, copier, _ = setup(spec, retry_s=0.0)
    assert planner.matched_tokens(request("a", PROMPT), 0) == 8  # taken at start
    serve = request("x", list(range(300, 317)))  # 4 blocks, host memory only
    planner.matched_tokens(serve, 0)
    step(planner, copier, [("x", 17)], {"x": [1, 2, 4, 5, 6]})
    assert planner.matched_tokens(request("y", list(range(300, 317))), 0) == 16
    transport.dead = True
    assert planner.plan([("x", 17)], lambda r: [1, 2, 4, 5, 6]).saves == []  # no call: no-op
    planner.matched_tokens(request("z", list(range(200, 221))), 0)
    step(planner, copier, [("z", 21)], {"z": [8, 9, 10, 11, 12, 13]})  # the failing call
    assert planner.index.down
    assert planner.matched_tokens(request("a2", PROMPT), 0) == 0
    transport.dead = False
    transport.restart()
    planner.matched_tokens(request("a3", PROMPT), 0)  # finds it, asks for its index
    assert not planner.index.down
    assert planner.matched_tokens(request("a4", PROMPT), 0) == 8  # the disk tier's blocks
    assert planner.index.holds(on_disk[0]) and planner.index.num_stored == 2
    assert planner.matched_tokens(request("y2", list(range(300, 317))), 0) == 0  # memory's


def test_restart_between_calls_is_seen_at_the_next_call() -> None:
    planner, transport, copier, _ = setup()
    serve_first(planner, copier)
    transport.restart()  # killed and restarted by Ray with no call in between
    assert planner.matched_tokens(request("a", PROMPT), 0) == 8  # the mirror: ranks hold them
    planner.matched_tokens(request("b", PROMPT + [7] * 8), 0)
    plan = planner.plan([("b", 19)], lambda r: [1, 2, 4, 5, 6])
    assert plan.saves == []  # the answer was the new service's index, not these reserves
    assert planner.matched_tokens(request("c", PROMPT), 0) == 0  # its index: no memory blocks
    plan = planner.plan([("c", 11)], lambda r: [1, 2, 4])
    assert len(plan.saves) == 2


@pytest.mark.parametrize("garbage", [b"\xc1", encode([1]), encode({"inc": 5}),
                                     encode({"inc": "x", "reserved": [[["k"], []]]}),
                                     encode({"inc": "x", "reserved": [], "stats": [1]}),
                                     encode({"inc": "x", "stored": [1], "pending": []})])
def test_a_malformed_answer_is_an_unavailable_index(garbage: bytes) -> None:
    planner, transport, copier, _ = setup(retry_s=3600)
    serve_first(planner, copier)
    transport.garbage = garbage
    planner.matched_tokens(request("a", PROMPT + [9] * 8), 0)
    assert planner.plan([("a", 19)], lambda r: [1, 2, 4, 5, 6]).saves == []
    assert planner.index.down and planner.matched_tokens(request("b", PROMPT), 0) == 0


def test_index_service_checks_requests_before_applying_any() -> None:
    service = IndexService(IndexSpec(8, BT, SEED))
    key = extend_chain([], PROMPT, BT, SEED)[0]
    inc = decode(service.call(encode({"inc": None, "sync": True})))["inc"]
    for bad in ({"inc": inc, "ops": [["reserve", [key]], ["drop", [key]]]},
                {"inc": inc, "ops": [["reserve", [key]], ["confirm", [b"short"]]]},
                {"inc": inc, "keep": "x"}, [1, 2]):
        with pytest.raises(WireFormatError):
            service.call(encode(bad))
    assert service.index.state() == ([], [])
    stale = decode(service.call(encode({"inc": "other", "ops": [["reserve", [key]]]})))
    assert stale["stored"] == [] and "reserved" not in stale and len(service.index) == 0
    with pytest.raises(WireFormatError):
        IndexSpec.from_bytes(encode({"capacity_blocks": 1}))


def test_an_owned_index_service_answers_its_owner_only() -> None:
    """Made with an owner token, the service refuses every other caller before reading the
    request, so no other scheduler ever gets its blocks or changes its index."""
    spec = IndexSpec(8, BT, SEED, instance="engine-a")
    service = IndexService(spec.to_bytes(), "a" * 32)
    key = extend_chain([], PROMPT, BT, SEED)[0]
    inc = decode(service.call(encode({"inc": None, "sync": True}), "a" * 32))["inc"]
    assert service.owner() == "a" * 32
    for caller in ("b" * 32, ""):
        with pytest.raises(IndexOwnerError, match="engine-a.*own engine_id") as err:
            service.call(encode({"inc": inc, "ops": [["reserve", [key]]]}), caller)
        assert isinstance(err.value, IndexUnavailableError)  # the scheduler goes on without
    assert service.index.state() == ([], [])
    answer = decode(service.call(encode({"inc": inc, "ops": [["reserve", [key]]]}), "a" * 32))
    assert answer["reserved"] == [[[key], []]]
    anyone = IndexService(spec)  # no owner (in process): any caller
    assert anyone.owner() == "" and "stored" in decode(anyone.call(encode({"inc": None}), "x"))
    with pytest.raises(WireFormatError, match="owner"):
        IndexService(spec, owner=7)  # type: ignore[arg-type]


def test_controller_options_are_checked() -> None:
    assert ConnectorOptions.from_extra({}).controller == "local"
    opts = ConnectorOptions.from_extra({"controller": "ray", "controller_timeout_s": 0.5})
    assert (opts.controller, opts.controller_timeout_s) == ("ray", 0.5)
    for bad in ({"controller": "etcd"}, {"controller": None},
                {"controller": "ray", "controller_timeout_s": 0},
                {"controller": "ray", "controller_timeout_s": "2"},
                {"controller": "ray", "controller_timeout_s": float("nan")},
                {"controller": "ray", "controller_timeout_s": True},
                {"controller_timeout_s": 1.0}):
        with pytest.raises(ConfigError, match="controller"):
            ConnectorOptions.from_extra(bad)


def test_each_instance_has_an_index_of_its_own() -> None:
    """Two vLLM instances on one model and disk directory: two actor names (engine_id decides),
    one name for one instance however often it is asked (a restart, a reconnect)."""
    from tpkv.integrations.vllm.ray_index import actor_name

    spec = IndexSpec(64, BT, SEED, 1, "/tmp/tier", 8, instance=instance_id("engine-a"))
    other = IndexSpec(64, BT, SEED, 1, "/tmp/tier", 8, instance=instance_id("engine-a_dp1"))
    assert spec.instance == "engine-a"
    assert actor_name(spec) != actor_name(other)
    assert actor_name(spec) == actor_name(IndexSpec.from_bytes(spec.to_bytes()))
    assert actor_name(spec) != actor_name(IndexSpec(64, BT, SEED, 1, "/tmp/other", 8,
                                                    instance="engine-a"))
    own = actor_name(spec, "a" * 32)  # a scheduler's own, when its engine_id's name is taken
    assert own.startswith("tpkv-vllm-index-") and own not in (
        actor_name(spec), actor_name(spec, "b" * 32))
    made = {instance_id(None), instance_id(""), instance_id(None)}
    assert len(made) == 3 and all(m.startswith("tpkv-") for m in made)  # unset: one each
    with pytest.raises(WireFormatError, match="instance"):
        IndexSpec(64, BT, SEED, instance=7)  # type: ignore[arg-type]


def test_a_closed_index_ends_its_service_and_calls_it_no_more() -> None:
    planner, transport, copier, _ = setup()
    serve_first(planner, copier)
    index = planner.index
    assert isinstance(index, RemoteIndex)
    index.close()
    calls = transport.calls
    assert transport.closed and index.down
    assert planner.matched_tokens(request("a", PROMPT), 0) == 0
    planner.matched_tokens(request("b", PROMPT + [9] * 8), 0)
    assert planner.plan([("b", 19)], lambda r: [1, 2, 4, 5, 6]).saves == []
    assert transport.calls == calls
