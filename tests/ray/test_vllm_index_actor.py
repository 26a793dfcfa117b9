"""The vLLM connector's prefix index as a named Ray actor: served, killed (restarted by Ray, and
for good), and taken back with the index it rebuilt from the disk tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_vllm_remote_index import BT, disk_records  # (BT: the records' block)
from tpkv.controller.actor import NAMESPACE
from tpkv.integrations.index_service import IndexSpec
from tpkv.integrations.prefix_index import chain_seed
from tpkv.integrations.vllm.copier import BlockCopier
from tpkv.integrations.vllm.planner import Planner
from tpkv.integrations.vllm.remote_index import RemoteIndex

pytestmark = pytest.mark.timeout(180)

SEED = chain_seed("ray-index-test", BT)
PROMPT = list(range(100, 111))  # 2 full blocks, on disk
OTHER = list(range(300, 317))  # 4 full blocks, host memory only


def matched(planner: Planner, tokens: list[int]) -> int:
    matched.n += 1  # type: ignore[attr-defined]
    req = SimpleNamespace(request_id=f"m{matched.n}",  # type: ignore[attr-defined]
                          all_token_ids=list(tokens))
    n = planner.matched_tokens(req, 0)
    planner.finished(req.request_id)
    return n


matched.n = 0  # type: ignore[attr-defined]


def until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> float:
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - began


def store(planner: Planner, copier: BlockCopier, tokens: list[int]) -> int:
    """One request of `tokens` computed and its full blocks stored; how many were saved."""
    store.n += 1  # type: ignore[attr-defined]
    name = f"s{store.n}"  # type: ignore[attr-defined]
    req = SimpleNamespace(request_id=name, all_token_ids=list(tokens))
    planner.matched_tokens(req, 0)
    plan = planner.plan([(name, len(tokens))], lambda r: [1, 2, 4, 5, 6])
    copier.load(plan.loads)
    copier.apply_after_forward(plan)
    report = copier.take_report()
    if report is not None:
        planner.report(report)
    planner.finished(name)
    return len(plan.saves)


store.n = 0  # type: ignore[attr-defined]


def fresh() -> list[int]:
    """A one-block prompt never seen before (each makes the step call the actor)."""
    return [2000 + store.n * BT + i for i in range(BT + 1)]  # type: ignore[attr-defined]


def test_index_actor_serves_is_killed_and_comes_back_from_the_disk_tier(
        ray_cluster: None, tmp_path: Path) -> None:
    import ray

    from tpkv.integrations.vllm.ray_index import RayTransport, actor_name

    disk_records(tmp_path, PROMPT, SEED)
    spec = IndexSpec(64, BT, SEED, 1, str(tmp_path), 8)
    transport = RayTransport(spec)
    assert not transport.joined  # the process was in a cluster already
    planner = Planner(BT, SEED, 64, index=RemoteIndex(transport, 64, 10.0, retry_s=0.2))
    index = planner.index
    assert isinstance(index, RemoteIndex) and not index.down
    assert ray.get_actor(actor_name(spec), namespace=NAMESPACE)._actor_id == \
        transport.handle._actor_id
    copier = BlockCopier(capacity_bytes=1 << 20)
    g = torch.Generator().manual_seed(0)
    copier.register({"l0": torch.randn(16, 2, BT, 8, generator=g)}, 16)

    assert matched(planner, PROMPT) == 8  # the actor built its index from the disk tier
    assert store(planner, copier, OTHER) == 4
    assert matched(planner, OTHER) == 16

    # killed, Ray restarts it: a later call finds the new one, which rebuilt from disk
    before = index.incarnation
    restarted = transport.handle._actor_id
    ray.kill(transport.handle, no_restart=False)
    took = until(lambda: store(planner, copier, fresh()) >= 0 and not index.down
                 and index.incarnation != before, "restarted actor taken back")
    assert transport.handle._actor_id == restarted  # the same actor, not a new one
    assert matched(planner, PROMPT) == 8
    assert matched(planner, OTHER) == 0  # held in memory only: the new index lacks it
    assert store(planner, copier, OTHER) == 4 and matched(planner, OTHER) == 16
    print(f"restarted actor taken back after {took:.2f} s")

    # killed for good: the scheduler goes on without it, then a new actor is made by name
    old = transport.handle._actor_id
    ray.kill(transport.handle, no_restart=True)
    until(lambda: store(planner, copier, fresh()) == 0 and index.down, "dead actor seen")
    assert matched(planner, PROMPT) == 0 and matched(planner, OTHER) == 0
    assert store(planner, copier, PROMPT) == 0  # nothing stored while down
    took = until(lambda: matched(planner, PROMPT) == 8, "new actor made and taken")
    assert transport.handle._actor_id != old and not index.down
    assert matched(planner, OTHER) == 0
    print(f"new actor made and taken after {took:.2f} s")
    ray.kill(transport.handle, no_restart=True)


def test_two_instances_on_one_disk_directory_each_have_their_own_index(
        ray_cluster: None, tmp_path: Path) -> None:
    """Two vLLM instances, one model and disk directory: an actor each, so neither matches the
    blocks only the other's memory holds; both match the disk tier's. Each actor ends when its
    instance closes its index."""
    from tpkv.integrations.vllm.ray_index import RayTransport, actor_name

    disk_records(tmp_path, PROMPT, SEED)
    spec_a = IndexSpec(64, BT, SEED, 1, str(tmp_path), 8, instance="engine-a")
    spec_b = replace(spec_a, instance="engine-b")
    assert actor_name(spec_a) != actor_name(spec_b)
    assert actor_name(spec_a) == actor_name(replace(spec_a))
    planners, copiers, transports = [], [], []
    for spec in (spec_a, spec_b):
        transports.append(RayTransport(spec))
        planners.append(Planner(BT, SEED, 64, index=RemoteIndex(transports[-1], 64, 10.0)))
        copiers.append(BlockCopier(capacity_bytes=1 << 20))
        copiers[-1].register({"l0": torch.zeros(16, 2, BT, 8)}, 16)
        if spec is spec_a:  # A stores before B starts: B's start takes its actor's index
            assert store(planners[0], copiers[0], OTHER) == 4
            store(planners[0], copiers[0], fresh())  # its call carries OTHER's confirms
    a, b = planners
    assert transports[0].handle._actor_id != transports[1].handle._actor_id
    assert matched(a, OTHER) == 16
    assert matched(b, OTHER) == 0  # only A's memory holds those blocks
    assert matched(a, PROMPT) == matched(b, PROMPT) == 8  # the disk tier, found by both
    assert store(b, copiers[1], OTHER) == 4 and matched(b, OTHER) == 16  # B stores its own

    for planner, spec in zip(planners, (spec_a, spec_b)):
        index = planner.index
        assert isinstance(index, RemoteIndex)
        index.close()
        name = actor_name(spec)
        until(lambda name=name: not named(name), f"actor of {spec.instance} gone at close")
        assert index.down and matched(planner, PROMPT) == 0 and store(
            planner, copiers[1], fresh()) == 0  # closed: no call, nothing stored


def named(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def test_an_instances_actor_ends_with_the_process_that_made_it(
        ray_cluster: None, tmp_path: Path) -> None:
    """A scheduler process that dies without closing its index leaves no actor behind: the
    actor is not detached, so Ray ends it with the process that made it."""
    import ray

    from tpkv.integrations.vllm.ray_index import actor_name

    spec = IndexSpec(64, BT, SEED, 1, str(tmp_path), 8, instance="engine-gone")
    script = (
        "import os, sys, ray\n"
        "from tpkv.integrations.index_service import IndexSpec\n"
        "from tpkv.integrations.vllm.ray_index import RayTransport\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, log_to_driver=False)\n"
        f"t = RayTransport(IndexSpec.from_bytes({spec.to_bytes()!r}))\n"
        "ray.get(t.handle.ping.remote(), timeout=60)\n"
        "print('made', flush=True)\n"
        "sys.stdin.readline()\n"
        "os._exit(0)\n")  # no shutdown, no close: as a killed scheduler process
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    with subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "made"
            assert named(actor_name(spec))  # alive while its process is
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    took = until(lambda: not named(actor_name(spec)), "dead instance's actor gone")
    print(f"dead instance's actor gone {took:.2f} s after its process")


def test_two_schedulers_given_one_engine_id_never_share_an_index(
        ray_cluster: None, tmp_path: Path) -> None:
    """Two live schedulers with one engine_id (one spec): the second makes an actor of its own
    and never matches the first's host blocks. The first's actor, restarted by Ray, knows its
    owner still; killed for good while a third takes the name, the first is refused by the
    third's actor and makes its own. close() never kills an actor another owns."""
    import ray

    from tpkv.errors import IndexOwnerError
    from tpkv.integrations.vllm.ray_index import RayTransport, actor_name
    from tpkv.protocol.wire import encode

    disk_records(tmp_path, PROMPT, SEED)
    spec = IndexSpec(64, BT, SEED, 1, str(tmp_path), 8, instance="engine-same")
    shared = actor_name(spec)

    def start(transport: RayTransport) -> tuple[Planner, RemoteIndex, BlockCopier]:
        planner = Planner(BT, SEED, 64, index=RemoteIndex(transport, 64, 10.0, retry_s=0.2))
        copier = BlockCopier(capacity_bytes=1 << 20)
        copier.register({"l0": torch.zeros(16, 2, BT, 8)}, 16)
        assert isinstance(planner.index, RemoteIndex) and not planner.index.down
        return planner, planner.index, copier

    ta = RayTransport(spec)
    a, index_a, copier_a = start(ta)
    assert ta.name == shared and ta.mine
    assert store(a, copier_a, OTHER) == 4
    store(a, copier_a, fresh())  # its call carries OTHER's confirms
    assert matched(a, OTHER) == 16

    tb = RayTransport(spec)  # same engine_id, A alive: B takes a name of its own
    b, index_b, copier_b = start(tb)
    assert tb.owner != ta.owner and tb.name == actor_name(spec, tb.owner) != shared
    assert tb.handle._actor_id != ta.handle._actor_id
    assert ray.get(ta.handle.owner.remote(), timeout=30) == ta.owner
    assert ray.get(tb.handle.owner.remote(), timeout=30) == tb.owner
    assert matched(b, OTHER) == 0  # only A's memory holds those blocks
    assert matched(a, PROMPT) == matched(b, PROMPT) == 8  # the disk tier, found by both
    with pytest.raises(IndexOwnerError, match="engine-same"):  # A's actor answers A only
        ray.get(ta.handle.call.remote(encode({"inc": None, "sync": True}), tb.owner),
                timeout=30)
    assert matched(a, OTHER) == 16

    # A's actor restarted by Ray: A's reconnect finds it, and it still answers A only
    old, before = ta.handle._actor_id, index_a.incarnation
    ray.kill(ta.handle, no_restart=False)
    until(lambda: store(a, copier_a, fresh()) >= 0 and not index_a.down
          and index_a.incarnation != before, "restarted actor taken back")
    assert ta.handle._actor_id == old and ta.name == shared and ta.mine
    assert ray.get(ta.handle.owner.remote(), timeout=30) == ta.owner
    ta.reconnect()
    assert ta.handle._actor_id == old and ta._ask_owner(30) == ta.owner
    assert store(a, copier_a, OTHER) == 4 and matched(a, OTHER) == 16
    assert matched(b, OTHER) == 0

    # A's actor killed for good, C takes the name: A is refused by C's and makes its own
    ray.kill(ta.handle, no_restart=True)
    until(lambda: not named(shared), "A's actor gone")
    tc = RayTransport(spec)
    c, index_c, copier_c = start(tc)
    assert tc.name == shared and tc.mine
    third = list(range(500, 517))  # 4 full blocks, in C's memory only
    assert store(c, copier_c, third) == 4
    store(c, copier_c, fresh())
    assert matched(c, third) == 16
    seen: list[int] = []
    until(lambda: store(a, copier_a, fresh()) >= 0 and seen.append(matched(a, third)) is None
          and not index_a.down and ta.name != shared, "A up on an actor of its own")
    assert set(seen) == {0}  # never C's blocks, while refused nor after
    assert ta.name == actor_name(spec, ta.owner) and ta.handle._actor_id != tc.handle._actor_id
    assert ray.get(ta.handle.owner.remote(), timeout=30) == ta.owner
    assert matched(a, PROMPT) == 8 and matched(a, OTHER) == 0  # rebuilt from the disk tier
    assert matched(c, third) == 16

    # a transport that holds another's actor (not yet known as such) does not kill it at close
    ta.name = shared
    ta.reconnect()
    assert ta.handle._actor_id == tc.handle._actor_id and ta.mine is None
    ta.close()
    assert named(shared) and matched(c, third) == 16
    for transport in (tb, tc):
        transport.close()
    until(lambda: not any(named(n) for n in (shared, tb.name, actor_name(spec, ta.owner))),
          "closed actors gone")  # A's own: its handle was let go above, so Ray ended it
