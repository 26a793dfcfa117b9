"""The tiered engine through the controller actor: the same tokens as a large L1, the same
checks as in process (tests/multiproc/test_engine_tiered.py), with steps planned ahead."""

from __future__ import annotations

import pytest

from tests.multiproc.test_engine_tiered import check, tiered_rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["load", "miss", "stagger"])
def test_tiered_engine_through_the_actor_gives_the_tokens_of_a_large_l1(
        ray_cluster, tmp_path, monkeypatch, mode):
    import ray

    from tpkv.controller.actor import NAME, NAMESPACE

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        out = tiered_rank(0, 1, str(tmp_path / "l3"), mode, "cpu", controller="ray")
    finally:  # the next test starts from a controller of its own
        try:
            ray.kill(ray.get_actor(NAME, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass
    check(out, mode)
    used, unused = out["ahead"]
    assert used > out["steps"] // 2, out["ahead"]
