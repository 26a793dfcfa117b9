"""A spill's L2 slots taken back before its write is done (SpillViews.take_back), in the
tiered engine: with a disk that writes late, copies into the slots of queued spills go on
without waiting for them, and the tokens and the maps are those of a run that waits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.unit.test_chained_loads import _placed  # noqa: E402


def _run(root: Path, take_back: bool) -> tuple[Any, int, int]:
    import tpkv
    from tests.multiproc.test_engine_tiered import BT, L1_BLOCKS, L2_BLOCKS, drive
    from tpkv.config import PolicyConfig
    from tpkv.models.llama import build_model
    from tpkv.models.tiered import TieredEngine, tiered_config

    model = build_model("tiny", seed=0, device="cpu")
    cfg = tiered_config(model, 1, block_tokens=BT, l1_blocks=L1_BLOCKS, l2_blocks=L2_BLOCKS,
                        ssd_root=str(root), policy=PolicyConfig(cooldown_s=0.0,
                                                                prefill_tokens_per_s=10.0))
    rt = tpkv.init(cfg, controller="local", device="cpu")
    try:
        store, ex = rt.worker.store, rt.worker.executor
        ex.take_back_slots = take_back
        real = store.write_blocks

        def late(*args: Any) -> Any:  # a disk that takes its time with every spill
            time.sleep(0.05)
            return real(*args)
        store.write_blocks = late  # type: ignore[method-assign]
        tiered = TieredEngine(rt, model, report_prefill=False)
        maps: list[tuple[Any, Any]] = []
        real_close = tiered.engine.close_session

        def close_session(name: str) -> None:
            if not maps:
                maps.append((_placed(rt.controller_slot_map()), _placed(rt.worker.slot_map())))
            real_close(name)
        tiered.engine.close_session = close_session  # type: ignore[method-assign]
        tokens = drive(tiered.engine)
        theirs, here = maps[0]
        assert len(theirs) > 0 and here == theirs
        assert rt.num_mismatches == 0 and tiered.stats.moves["l3_l2"] > 0
        return tokens, ex.num_taken_back, ex.num_failed_spills
    finally:
        rt.close()


def test_the_engine_gives_the_same_tokens_when_spill_slots_are_taken_back(tmp_path: Path
                                                                          ) -> None:
    waited, none, failed0 = _run(tmp_path / "wait", take_back=False)
    taken, blocks, failed1 = _run(tmp_path / "take", take_back=True)
    assert none == 0 and blocks > 0 and failed0 == failed1 == 0
    assert taken == waited
    assert np.sum([len(t) for t in taken.values()]) > 0
