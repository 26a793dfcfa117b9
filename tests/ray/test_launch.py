"""`tpkv.launch`: a placement group of TP ranks as Ray actors runs an app end to end on CPU."""

from __future__ import annotations

import time

import pytest

import tpkv
from tests.e2e.app import main as app_main
from tpkv.errors import LaunchError

pytestmark = pytest.mark.timeout(180)


def test_launch_runs_the_app_on_every_rank(ray_cluster, tmp_path):
    import ray

    results = tpkv.launch_ray("tests.e2e.app:main", tp=2, args=(25,),
                          env={"TPKV_TEST_SSD_DIR": str(tmp_path)}, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert results[0]["plans"] == results[1]["plans"] > 0
    assert results[0]["l1"] > 0
    # the actors and the placement group are gone; the controller died with rank 0's actor
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_launch_takes_a_callable(ray_cluster, tmp_path):
    results = tpkv.launch_ray(app_main, tp=2, args=(10,), env={"TPKV_TEST_SSD_DIR": str(tmp_path)},
                          timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]


def test_a_failing_rank_fails_the_launch_naming_it(ray_cluster):
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        tpkv.launch_ray("tests.e2e.failing_app:main", tp=2, args=(1, 5, 6.0), timeout_s=60)
    message = str(info.value)
    assert "rank 1: " in message and "boom on rank 1" in message
    # rank 0 gave up within its bound, naming rank 1
    assert "rank 0: RankTimeoutError" in message and "rank 1 did not answer" in message
    assert time.monotonic() - started < 60
