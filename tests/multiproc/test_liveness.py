"""A dead or hung rank makes the others fail within the bound, naming it; never a hang."""

from __future__ import annotations

import pytest

from tests.multiproc.harness import run_ranks
from tests.multiproc.rank_fns import liveness_rank

pytestmark = pytest.mark.timeout(120)
BOUND_S = 4.0


@pytest.mark.parametrize("tp,victim,mode", [(4, 2, "kill"), (2, 0, "kill"), (2, 1, "hang")])
def test_others_fail_within_the_bound_naming_the_rank(tp, victim, mode, tmp_path):
    out = run_ranks(liveness_rank, tp, victim, mode, 15, str(tmp_path), BOUND_S,
                    expect=tp - 1, timeout_s=90)
    survivors = [r for r in range(tp) if r != victim]
    assert sorted(out) == survivors, f"reports from {sorted(out)}"
    for rank in survivors:
        o = out[rank]
        assert o["ok"] and o["error"] == "RankTimeoutError", o
        assert victim in o["ranks"], o["message"]
        assert f"rank {victim}" in o["message"]
        assert o["waited_s"] <= BOUND_S + 1.0, o
