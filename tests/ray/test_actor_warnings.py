"""The controller actor's start logs no RayDeprecationWarning (tpkv's own Ray calls)."""

from __future__ import annotations

import glob
import os
import time

import pytest

from tests.ray.test_controller_actor import config
from tpkv.controller.actor import ControllerClient, get_or_create


@pytest.mark.timeout(90)
def test_controller_actor_start_logs_no_deprecation_warning(ray_cluster, tmp_path) -> None:
    import ray

    handle = get_or_create(config(tmp_path))
    try:
        assert ControllerClient(handle).snapshot()["tick"] == 0  # __init__ ran
        pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
        logs = ray._private.worker._global_node.get_logs_dir_path()
        deadline = time.monotonic() + 10  # Ray writes an actor's stderr to its .err file
        text = ""
        while time.monotonic() < deadline:
            files = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
            text = "".join(open(f).read() for f in files)
            if files and "ControllerActor" in text:
                break
            time.sleep(0.2)
        assert "ControllerActor" in text, f"no log of the actor (pid {pid}) in {logs}"
        assert "DeprecationWarning" not in text, text
    finally:
        ray.kill(handle)
