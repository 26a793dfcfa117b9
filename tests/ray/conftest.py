"""A local Ray cluster per test module (2 CPUs, no dashboard), always shut down."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False,
             namespace=f"tpkv-test-{uuid.uuid4().hex[:8]}", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
