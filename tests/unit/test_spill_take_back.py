"""A spill's L2 slots taken back before its write is done (SpillViews.take_back), in the
tiered engine: with a disk that writes late, copies into the slots of queued spills go on
without waiting for them, and the tokens and the maps are those of a run that waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.unit.test_chained_loads import engine_run  # noqa: E402


def _late_disk(take_back: bool) -> Callable[[Any], None]:
    def prepare(rt: Any) -> None:
        rt.worker.executor.take_back_slots = take_back
        store = rt.worker.store
        real = store.write_blocks

        def late(*args: Any) -> Any:  # a disk that takes its time with every spill
            time.sleep(0.05)
            return real(*args)
        store.write_blocks = late
    return prepare


def test_the_engine_gives_the_same_tokens_when_spill_slots_are_taken_back(tmp_path: Path
                                                                          ) -> None:
    waited, ex_wait = engine_run(tmp_path / "wait", _late_disk(False))
    taken, ex_take = engine_run(tmp_path / "take", _late_disk(True))
    assert ex_wait.num_taken_back == 0 and ex_take.num_taken_back > 0
    assert ex_wait.num_failed_spills == ex_take.num_failed_spills == 0
    assert taken == waited and sum(len(t) for t in taken.values()) > 0
