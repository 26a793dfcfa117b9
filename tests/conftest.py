"""Fixtures of every test directory: one local Ray cluster per test module (2 CPUs, no
dashboard, always shut down), and `transport`, which runs a test on both controller links:
in process ("local") and through the Ray actor ("ray", on that module's cluster)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tests.transport import TRANSPORTS, kill_actor


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    init = getattr(ray.init, "real_init", ray.init)  # tests/unit forbids any other ray.init
    init(address="local", num_cpus=2, include_dashboard=False,
         namespace=f"tpkv-test-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """The `controller` to give tpkv.init / tpkv.attach. "ray" starts the module's cluster on
    first use (Ray is then already up, so the runtime leaves it up when it closes) and kills
    the named controller actor after the test: the next one creates its own."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    try:
        yield request.param
    finally:
        if request.param == "ray":
            kill_actor()
