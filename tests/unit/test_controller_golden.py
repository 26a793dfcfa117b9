"""Golden outputs: seeded operation sequences must give the recorded step results, bit for bit.

Guards the controller's speed work: an optimisation may change how a step is computed, never
what it returns (block tables, fresh slots, plans, drops, errors, final slot map). The digests
in data/controller_golden.json were recorded before the schedule() fast paths, and again
after two intended changes: freed slots handed back in ascending order (for runs), and a
session whose last L3 block moved up listed in ssd_dropped_sessions (its records freed; with
that list blanked, the new digests equalled the old ones in every case); and again when
spill pacing became the default (PolicyConfig.spill_pacing: spilled L2 slots handed out last,
spills ahead of need; with it off, the digests before it pass in every case); and again
when a prefetch into L2 took only clean slots (none a spill still reads: 2 of 30 cases
changed); and again when L3 stages took a session in parts up to a step's room instead of
whole sessions only (busy/heat/0 and 1 changed); and again when L1 and L2 slots given back
were handed out after every slot free before them (PolicyConfig.l1_reuse/l2_reuse "oldest",
then the only behaviour: all 30 changed; with "newest" put back in BlockTable, the digests
before it passed in every case). To re-record after an intended change of
behaviour, run this file with TPKV_GOLDEN_WRITE=1.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fakes import FakeClock
from tests.unit.test_controller_properties import World, program
from tpkv.controller import Controller
from tpkv.errors import TpkvError
from tpkv.protocol.digest import canonical, plan_digest
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import MoveResult, Tier
from tpkv.protocol.wire import encode

GOLDEN = Path(__file__).parent / "data" / "controller_golden.json"
WRITE = os.environ.get("TPKV_GOLDEN_WRITE") == "1"
# Each case runs the default policy with the tier sizes and policy kind given; their digests are
# those recorded for that configuration when it became the default (each of L2 copies of
# promoted blocks, refills in the plan that empties the slots, L3 copies of loaded blocks).
SMALL = {"a": dict(l1=12, l2=10, l3=24), "b": dict(l1=8, l2=6, l3=0),
         "c": dict(l1=16, l2=12, l3=10, kind="lru"),
         "d": dict(l1=10, l2=16, l3=40, kind="lruk", max_moves_per_step=3)}
BUSY = {"heat": dict(l1=1536, l2=1200, l3=6000, max_moves_per_step=96, prefetch_max_blocks=64),
        "lru": dict(l1=1024, l2=900, l3=0, kind="lru", max_moves_per_step=512),
        "lruk": dict(l1=1280, l2=1600, l3=3000, kind="lruk", max_moves_per_step=40)}


def digest_step(h: Any, res: StepResult) -> None:
    # The plans, drops and tables; not l2_room, the engine's admission advice
    # (test_spill_pace.py checks it)
    d = res.to_dict()
    del d["l2_room"]
    h.update(encode(canonical(d)))


def run_small(name: str, seed: int, make_config: Any) -> str:
    w = World(SMALL[name], make_config, FakeClock())
    for o in program(seed, 120):
        w.apply(o)
    h = hashlib.sha256()
    for item in w.trace:  # msgpack of each StepResult, or an error's name
        h.update(item)
    h.update(str(w.c.slot_map()["digest"]).encode())
    return h.hexdigest()


def run_busy(name: str, seed: int, make_config: Any, steps: int = 160) -> str:
    """Many sessions, a batch that changes a few sessions a step (some announced a step ahead),
    prompts, closes, attention, pins, misses on L3 reads, late commits, the clock moving. Seed
    0 also checks every invariant each step (the patched batch table against the block table)."""
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    c = Controller(make_config(**BUSY[name]), clock, check_invariants=seed == 0)
    h = hashlib.sha256()
    names = [f"u{i}" for i in range(240)]
    for n in names:
        c.open_session(n, int(rng.integers(1, 60)))
    batch, nxt = names[:48], names[48:51]
    unconfirmed: list[StepResult] = []
    serial = len(names)
    for t in range(steps):
        clock.advance(float(rng.random() * 4))
        use_handles = t % 3 == 0
        ids: Any = (np.array([c.sessions.handle(c.sessions.lookup(n)) for n in batch])
                    if use_handles else list(batch))
        add = rng.integers(0, 3, len(batch)) if t % 5 else rng.integers(0, 40, len(batch))
        try:
            res = c.schedule(ids, add, {n: int(rng.integers(0, 3)) for n in nxt})
        except TpkvError as exc:
            h.update(type(exc).__name__.encode())
            res = None
        if res is not None:
            digest_step(h, res)
            unconfirmed.append(res)
        lag = int(rng.integers(0, 3))
        while len(unconfirmed) > lag:
            for plan in unconfirmed.pop(0).plans:
                reads = plan.block_ids[plan.src_tier == Tier.SSD]
                miss = reads[:1] if len(reads) and rng.random() < 0.2 else reads[:0]
                out = c.commit([MoveResult(plan.epoch, r, plan.num_moves,
                                           plan_digest(plan, miss), miss_block_ids=miss)
                                for r in range(2)])
                h.update(f"{out.num_misses}".encode())
        others = [n for n in names if n not in batch and n not in nxt]
        for i in rng.choice(len(batch), len(nxt), replace=False).tolist():
            batch[i], nxt = nxt[0], nxt[1:] + [batch[i]]
        nxt = [n for n in nxt if n not in batch][:2] + [str(x) for x in rng.choice(others, 2)]
        nxt = list(dict.fromkeys(nxt))
        r = rng.random()
        victim = str(rng.choice([n for n in names if n not in batch and n not in nxt]))
        if r < 0.08:  # a session ends, another starts
            c.close_session(victim)
            names.remove(victim)
            names.append(f"u{serial}")
            c.open_session(f"u{serial}", int(rng.integers(1, 200)))
            serial += 1
        elif r < 0.3:
            s = c.sessions.lookup(victim)
            if c.sessions.nblocks(s):
                c.report_attention(victim, rng.random(c.sessions.nblocks(s)) * 2)
        elif r < 0.36:
            c.pin(victim, 0, int(rng.integers(0, 4)))
        elif r < 0.4:
            c.unpin(victim)
        elif r < 0.5:
            c.extend_session(victim, int(rng.integers(1, 30)))
    h.update(str(c.slot_map()["digest"]).encode())
    c.check_integrity()
    return h.hexdigest()


CASES = ([("small", n, s) for n in SMALL for s in range(6)]
         + [("busy", n, s) for n in BUSY for s in range(2)])


def _record(case: tuple[str, str, int], value: str) -> None:
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    data["/".join(map(str, case))] = value
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("case", CASES, ids=["/".join(map(str, c)) for c in CASES])
def test_step_results_match_the_recorded_ones(make_config, case):
    kind, name, seed = case
    value = (run_small if kind == "small" else run_busy)(name, seed, make_config)
    if WRITE:
        _record(case, value)
    expected = json.loads(GOLDEN.read_text())["/".join(map(str, case))]
    assert value == expected, f"{case}: step results differ from the recorded ones"
