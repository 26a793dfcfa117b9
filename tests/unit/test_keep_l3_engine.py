"""A session recomputed keeps its L3 records; spilled again, it writes only what changed; loaded
from those records later, its tokens are those of an engine without tiers (tiny Llama, CPU)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_returns import PROMPTS, _open

torch = pytest.importorskip("torch")


def _script(engine: Any, hook: Any = None) -> dict[str, list[tuple[int, ...]]]:
    """Six sessions take a turn each (s0 ends in L3); s0 returns (phase 1); the others return
    (s0 goes back to L3, phase 2); s0 returns again (phase 3). `hook(phase)` runs before
    each phase."""
    got: dict[str, list[tuple[int, ...]]] = {}

    def finish(done: list[Any]) -> None:
        for f in done:
            got.setdefault(f.session, []).append(f.token_ids)

    def turn(name: str, ids: list[int], new: int) -> None:
        engine.add_turn(name, ids, new)
        finish(engine.run())

    for name, prompt in PROMPTS.items():
        turn(name, prompt, 2)
    hook and hook(1)
    turn("s0", [2, 7, 1], 4)
    hook and hook(2)
    for name in list(PROMPTS)[1:]:
        turn(name, [5, 3], 2)
    hook and hook(3)
    turn("s0", [9, 9], 3)
    return got


def test_a_recomputed_session_keeps_its_records_and_is_served_them_bit_exact(
        tmp_path: Any) -> None:
    """s0 is recomputed at its first return (the GPU is estimated far faster than the disk):
    its segment stays. When it leaves L2 again, its unchanged blocks are kept spills (fewer
    records written than blocks it has in L3). At its second return (the disk now estimated
    faster) it is read back from L3, most of it from the records of its first spill: the
    tokens equal those of a paged engine that holds everything in L1."""
    from tpkv.models.engine import PagedEngine
    from tpkv.models.tiered import TieredEngine
    from tpkv.protocol.plan import Tier

    rt, model = _open(str(tmp_path), spill="always")
    try:
        big = torch.zeros(256, *rt.worker.hbm.tensor.shape[1:])
        want = _script(PagedEngine(model, big))
        tiered = TieredEngine(rt, model, report_prefill=False)
        returns, store, mirror = tiered.returns, rt.worker.store, rt.worker.mirror
        seen: dict[int, tuple[int, int, int]] = {}

        def hook(phase: int) -> None:
            on3 = len(mirror.session_logical("s0", int(Tier.SSD)))
            seen[phase] = (on3, store.session_records("s0"), returns.num_recomputed)
            # the return of phase 1 is recomputed; that of phase 3 read from L3
            returns.prefill_tokens_per_s = 1e9 if phase == 1 else 1e-3

        got = _script(tiered.engine, hook)
        (on3_1, records_1, _), (on3_2, records_2, recomputed), (on3_3, records_3, _) = (
            seen[1], seen[2], seen[3])
        assert on3_1 > 0 and records_1 == on3_1  # s0's first spill: every block written
        assert recomputed >= 1 and on3_2 == 0 and records_2 == records_1  # kept through it
        written = records_3 - records_2
        assert on3_3 > 0 and written < on3_3, (seen, written)  # kept spills wrote nothing
        assert tiered.stats.kept_spills >= on3_3 - written
        assert returns.num_read_ahead >= 1
        assert got == want
    finally:
        rt.close()
