"""The controller as a named Ray actor: one round trip per step, typed errors, kill and restart."""

from __future__ import annotations

import time

import pytest

from tpkv.config import HbmConfig, HostConfig, KvGeometry, SsdConfig, TpkvConfig
from tpkv.controller import SlotMapReplica
from tpkv.controller.actor import NAME, NAMESPACE, ControllerClient, get_existing, get_or_create
from tpkv.errors import (
    ArgumentError,
    ArgumentTypeError,
    BadRequestError,
    ControllerRecoveringError,
    PlanOrderError,
    UnknownSessionError,
)
from tpkv.protocol.plan import MoveResult

pytestmark = pytest.mark.timeout(90)


def config(tmp_path) -> TpkvConfig:
    g = KvGeometry(num_layers=1, num_kv_heads=4, head_dim=8, dtype="float16", block_tokens=4,
                   tp_size=2)
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=8),
                      l2=HostConfig(budget_bytes=8 * 2 * g.block_bytes, arena_bytes=1 << 20),
                      l3=SsdConfig(root=str(tmp_path / "ssd"),
                                   budget_bytes=SsdConfig.budget_for(64, g)))


def drive(client: ControllerClient, reps: list[SlotMapReplica], batch: list[str],
          tokens: list[int], upcoming: object = None) -> None:
    res = client.schedule(batch, tokens, upcoming)  # type: ignore[arg-type]
    reports = [r.apply_step(res) for r in reps]
    for i in range(len(res.plans)):
        assert client.commit([rep[i] for rep in reports]).committed


def wait_for_restart(client: ControllerClient, deadline_s: float = 60.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        try:
            snap = client.snapshot()
            if snap["restarts"] >= 1:
                return snap
        except Exception:
            if time.monotonic() > end:
                raise
        time.sleep(0.2)


def test_actor_steps_kill_restart_rebuild(ray_cluster, tmp_path):
    import ray

    handle = get_or_create(config(tmp_path))
    assert ray.get_actor(NAME, namespace=NAMESPACE)._actor_id == handle._actor_id
    assert get_existing(timeout_s=5)._actor_id == handle._actor_id
    assert get_or_create(config(tmp_path))._actor_id == handle._actor_id  # by name, once
    assert ray.available_resources().get("CPU", 0) == 2  # num_cpus=0: it holds no CPU

    client = ControllerClient(handle)
    g = config(tmp_path).geometry
    for rank in range(2):
        client.register_rank(rank=rank, geometry=g.__dict__, host="test")
    reps = [SlotMapReplica(r, 8, 8) for r in range(2)]
    for n in "abcde":
        client.open_session(session_id=n, num_tokens=16)
    for n in "abcde":
        drive(client, reps, [n], [1])
    for upcoming in (["a", "b"], {"a": 1}):  # names soonest first, or names to steps ahead
        drive(client, reps, ["e"], [0], upcoming)
    with pytest.raises(UnknownSessionError, match="'zz'"):
        client.schedule(["zz"], [1])
    with pytest.raises(PlanOrderError, match="no plan awaits confirmation"):
        client.commit([MoveResult(epoch=10_000, rank=r, moves_applied=0, slot_map_digest=0)
                       for r in range(2)])
    snap = client.snapshot()
    assert snap["restarts"] == 0 and snap["tiers"]["L3"]["used"] > 0
    assert snap["plan_latency_us"]["count"] == 7  # the refused step is not timed
    # Bad arguments come back as typed errors across the actor, and change nothing (on 2bd07df
    # the extend was taken, and a missing or unknown argument came back as Ray's wrapped
    # TypeError/KeyError)
    with pytest.raises(ArgumentError, match="num_tokens got 9223372036854775807.*MAX_SESSION"):
        client.extend_session(session_id="a", num_tokens=2**63 - 1)
    with pytest.raises(ArgumentTypeError, match="open_session: missing"):
        client.call("open_session", num_tokens=1)
    with pytest.raises(ArgumentTypeError, match="schedule: unknown argument 'bogus'"):
        client.call("schedule", session_ids=["a"], num_new_tokens=[1], bogus=1)
    with pytest.raises(ArgumentTypeError, match="schedule: missing argument 'num_new_tokens'"):
        client.call("schedule", session_ids=["a"])
    with pytest.raises(ArgumentTypeError, match="updates must be a list"):
        client.call("report_attention", updates=[["a", 0]])
    attention = client.session_blocks(session_id="a")["attention"]
    with pytest.raises(ArgumentTypeError, match="start must be an integer"):
        client.report_attention([("a", 0, [0.5]), ("b", "x", [0.5])])  # neither is applied
    assert client.session_blocks(session_id="a")["attention"] == attention
    # calls sent together (a step's held commits and reports, then its schedule): one actor
    # call, run in order; an error is its own call's alone
    parts = client.send_many([("report_attention", ([("a", "x", [0.5])],), {}),
                              ("no_such_call", (), {}), ("schedule", (["b"], [1]), {})])
    assert isinstance(parts[1], BadRequestError) and "no_such_call" in str(parts[1])
    with pytest.raises(ArgumentTypeError, match="start must be an integer"):
        parts[0].result()
    res = parts[2].result()
    reports = [r.apply_step(res) for r in reps]
    parts = client.send_many([("commit", ([rep[i] for rep in reports],), {})
                              for i in range(len(res.plans))] + [("schedule", (["c"], [1]), {})])
    assert len(parts) == len(res.plans) + 1
    assert all(p.result().committed for p in parts[:-1])
    res = parts[-1].result()
    reports = [r.apply_step(res) for r in reps]
    for i in range(len(res.plans)):
        assert client.commit([rep[i] for rep in reports]).committed
    assert client.session_blocks(session_id="a")["attention"] == attention
    client.check_integrity()

    ray.kill(handle, no_restart=False)
    snap = wait_for_restart(client)
    assert snap["restarts"] == 1 and snap["awaiting_rebuild"]
    with pytest.raises(ControllerRecoveringError):
        client.schedule(["a"], [1])
    summary = client.rebuild(slot_maps=[r.export() for r in reps],
                             ssd_manifests=reps[0].manifests())
    assert summary["sessions"] == 5 and summary["ranks"] == [0, 1]
    snap = client.snapshot()
    assert not snap["awaiting_rebuild"] and snap["recovery"]["blocks"] == summary["blocks"]
    assert any(e["kind"] == "rebuilt" for e in snap["events"])
    drive(client, reps, ["a"], [1])  # it comes back from L3 through L2
    full = client.resync()
    assert full["digest"] == reps[0].digest() == reps[1].digest()
    assert client.check_integrity() is True
    ray.kill(handle, no_restart=True)

