"""Fixtures of the fault tests: a scratch directory in memory where the machine has one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def mem_path(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm (else tmp_path): for tests of the store's logic, not the disk's,
    that write and remove many small trees or fsync often."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="tpkv-faults-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
