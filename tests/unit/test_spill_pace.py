"""Spill pacing: L2 slots a spill still reads handed out last (SlotStack cooling), the ranks'
reports of spills written and of the disk's rate (SpillPacer), and spills ahead of need."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tpkv.config import PolicyConfig
from tpkv.controller import Controller, SlotMapReplica
from tpkv.controller.slotstack import SlotStack
from tpkv.controller.spillpace import SpillPacer
from tpkv.errors import ConfigError
from tpkv.protocol.messages import StepResult
from tpkv.protocol.plan import Tier


@pytest.mark.parametrize("reuse", ["newest", "oldest"])
def test_slot_stack_hands_out_spilled_slots_last_and_the_oldest_spills_first(reuse: str
                                                                             ) -> None:
    """The stack against a list model (free slots, bottom first, cooling ones lowest: the
    newest spill's at the very bottom) through pops, pushes, spills, reports and grows."""
    rng = np.random.default_rng(7)
    s = SlotStack(24, "L2", reuse=reuse)
    model = list(range(23, -1, -1))
    spills: list[list[int]] = []  # [epoch, its slots still free], oldest first
    flights: list[tuple[int, int]] = []  # (epoch, blocks) of every spill not reported written
    used: list[int] = []
    epoch = 0
    for _ in range(3000):
        op = int(rng.integers(0, 12))
        cool = sum(n for _, n in spills)
        if op < 4 and model:
            n = int(rng.integers(1, len(model) + 1))
            assert s.pop(n).tolist() == model[len(model) - n:][::-1]
            used += model[len(model) - n:]
            del model[len(model) - n:]
            over = cool - len(model)  # handed out past the clean ones: the oldest spills'
            for sp in spills:
                k = min(max(over, 0), sp[1])
                sp[1] -= k
                over -= k
        elif op < 7 and used:
            back = [used.pop(int(rng.integers(0, len(used))))
                    for _ in range(int(rng.integers(1, len(used) + 1)))]
            s.push(np.array(back, dtype=np.int32))
            group = sorted(back, reverse=True)
            if not model:
                spills = []
                model = group
            elif reuse == "oldest":  # under the free slots, above the cooling ones
                model = model[:cool] + group + model[cool:]
            else:
                model = model + group
        elif op < 10 and used:
            epoch += 1
            back = [used.pop(int(rng.integers(0, len(used))))
                    for _ in range(int(rng.integers(1, len(used) + 1)))]
            s.push_cooling(np.array(back, dtype=np.int32), epoch)
            model = sorted(back, reverse=True) + model
            spills.append([epoch, len(back)])
            flights.append((epoch, len(back)))
        elif op == 10 and spills:
            below = int(rng.integers(spills[0][0], epoch + 2))
            s.cooled_below(below)
            spills = [sp for sp in spills if sp[0] >= below]
            flights = [f for f in flights if f[0] >= below]
        elif op == 11 and s.size < 200:
            old = s.size
            s.grow(old + int(rng.integers(1, 6)))
            model = model[:cool] + list(range(s.size - 1, old - 1, -1)) + model[cool:]
        cool = sum(n for _, n in spills)
        assert s.top == len(model) and s.stack[:s.top].tolist() == model
        assert s.cool == cool and s.clean == len(model) - cool
        assert s.in_flight() == sum(n for _, n in flights)



def test_slot_stack_forgets_spent_spills_past_max_cooling(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Ranks that never report spills written: past MAX_COOLING entries the oldest spills
    whose slots were all handed out are forgotten, and in_flight() no longer counts them;
    spills with free slots left stay, and slots are still handed out oldest spill first."""
    monkeypatch.setattr("tpkv.controller.slotstack.MAX_COOLING", 3)
    s = SlotStack(40, "L2")
    s.pop(40)
    for e in range(4):  # 4 spills of 5 slots: 20 free, all cooling
        s.push_cooling(np.arange(5 * e, 5 * e + 5, dtype=np.int32), epoch=e)
    assert s.in_flight() == 20 and s.cool == 20 and len(s.cooling) == 4
    s.pop(12)  # the newest spills' slots lie lowest: the oldest spill's go first
    assert [c[1] for c in s.cooling] == [0, 0, 3, 5] and s.cool == 8
    s.push_cooling(np.arange(20, 26, dtype=np.int32), epoch=4)  # 5 entries: the 2 spent go
    assert [c[0] for c in s.cooling] == [2, 3, 4] and s.in_flight() == 16 and s.cool == 14
    s.pop(10)  # spill 2's 3 slots, spill 3's 5, then 2 of spill 4's
    assert [c[1] for c in s.cooling] == [0, 0, 4] and s.cool == 4 and s.clean == 0
    s.cooled_below(4)
    assert s.in_flight() == 6 and s.cool == 4 and len(s.cooling) == 1


def _pacer(**policy: Any) -> tuple[SpillPacer, SlotStack]:
    pol = PolicyConfig(ssd_write_bytes_per_s=100 * 4096, spill_queue_s=0.5, **policy)
    return SpillPacer(pol, 4096), SlotStack(64, "L2")  # the disk: 100 blocks/s


def test_the_pacer_keeps_room_for_the_largest_intake_and_the_steps_a_spill_takes() -> None:
    p, stack = _pacer()
    for intake in (4, 10, 4, 6):
        p.stepped(intake)
    # never pressed: an L2 that holds what it gets spills nothing ahead
    assert p.ahead(stack, 8, 3, 0, pressed=False) == 0
    # pressed: keep free the largest intake (10) plus the mean (6) over a spill's lag (1
    # step): 16 after this step's intake of 3, with 8 free -> 11 more
    assert p.ahead(stack, 8, 3, 0, pressed=True) == 11
    assert p.ahead(stack, 8, 3, 2, pressed=False) == 9  # (2 spilled at need already)
    assert p.ahead(stack, 30, 3, 0, pressed=False) == 0  # room enough
    # spills in flight are capped at what the disk writes in spill_queue_s: 50 blocks
    stack.pop(48)
    stack.push_cooling(np.arange(45, dtype=np.int32), epoch=7, step=p.step)
    assert stack.in_flight() == 45 and stack.clean == 16 and stack.cool == 45
    assert p.ahead(stack, 8, 3, 0, pressed=True) == 5
    # the ranks report epoch 7's spills written 3 steps later, and the disk at 200 blocks/s
    for _ in range(3):
        p.stepped(4)
    p.written(stack, 8, 200 * 4096)
    assert stack.cool == 0 and stack.in_flight() == 0 and stack.clean == 61
    assert p.lag == 3.0 and p.rate == 200 * 4096 and p.samples == 1
    # want: 10 + mean 36 / 7 x 3 steps = 26; cap 100 blocks
    assert p.ahead(stack, 8, 3, 0, pressed=True) == 10 + 16 - 5
    p.written(stack, 0, 0)  # a confirmation that reports nothing changes nothing
    assert p.lag == 3.0 and p.samples == 1


def test_an_unpaced_pacer_spills_nothing_ahead() -> None:
    p, stack = _pacer(spill_pacing=False)
    p.stepped(40)
    assert p.ahead(stack, 0, 40, 0, pressed=True) == 0
    assert SpillPacer().enabled is False  # (a table's until the controller configures it)


def test_pacing_knobs_are_checked() -> None:
    with pytest.raises(ConfigError, match="spill_queue_s"):
        PolicyConfig(spill_queue_s=-1.0)
    with pytest.raises(ConfigError, match="ssd_write_bytes_per_s"):
        PolicyConfig(ssd_write_bytes_per_s=0.0)
    with pytest.raises(ConfigError, match="spill_pacing"):
        PolicyConfig(spill_pacing="yes")  # type: ignore[arg-type]


def test_a_spills_l2_slots_are_handed_out_last_until_the_ranks_report_it_written(
        make_config: Any, fake_clock: Any) -> None:
    """A controller with a small L2: the slots a spill read lie under every other free L2
    slot, so the next demotions take the others; once a confirmation reports the spill
    written, they are clean again."""
    c = Controller(make_config(l1=8, l2=16, l3=64), fake_clock, check_invariants=True)
    reps = [SlotMapReplica(r, 8, 16, 4) for r in range(2)]
    stack = c.table.free[Tier.DRAM]
    spilled: np.ndarray | None = None
    for n in "abcdefghij":
        c.open_session(n, 16)  # 4 blocks each
        res = c.schedule([n], [0])
        outs = [rep.apply_step(res) for rep in reps]
        for i, plan in enumerate(res.plans):
            results = [o[i] for o in outs]
            if spilled is None and plan.mask(Tier.DRAM, Tier.SSD).any():
                spilled = plan.src_slot[plan.mask(Tier.DRAM, Tier.SSD)]
                epoch = plan.epoch
            assert c.commit(results).committed  # the replicas report nothing: still cooling
        if spilled is not None:
            break
    assert spilled is not None and stack.cool == len(spilled)
    assert set(stack.stack[:stack.cool].tolist()) == set(spilled.tolist())
    # a session in L2 closes: its slots are free, and clean (no spill reads them)
    S, T = c.sessions, c.table
    in_l2 = [n for n in S.index if (T.tier[S.rows(S.lookup(n))] == Tier.DRAM).any()]
    c.close_session(in_l2[0])
    clean = stack.stack[stack.cool:stack.top].tolist()
    assert clean and stack.cool == len(spilled), (clean, stack.cool)
    # the next demotion into L2 takes the clean slots first
    c.open_session("g", 16)
    res = c.schedule(["g"], [0])
    into = np.concatenate([p.dst_slot[p.mask(Tier.HBM, Tier.DRAM)] for p in res.plans])
    assert len(into), res.plans
    assert np.isin(into, spilled).sum() == max(0, len(into) - len(clean)), (into, spilled, clean)
    # a confirmation that reports the spill written (and the disk's rate) makes them clean
    outs = [rep.apply_step(res) for rep in reps]
    for i in range(len(res.plans)):
        results = [dataclasses.replace(o[i], spills_written_below=epoch + 1,
                                       spill_write_bytes_per_s=5_000_000) for o in outs]
        assert c.commit(results).committed
    assert stack.cool == 0 and c.table.pace.rate == 5e6 and c.table.pace.samples > 0
    pace = c.snapshot()["spill_pace"]  # (the dashboard's view of it)
    assert pace["write_bytes_per_s"] == 5e6 and pace["samples"] == c.table.pace.samples
    c.check_integrity()


def test_a_watermark_drain_queues_no_more_spills_than_the_disk_writes_in_the_queue_time(
        make_config: Any, fake_clock: Any) -> None:
    """L2 past its high mark drains to its low mark by spilling to L3; paced, a step spills
    beyond its need only what the queue has room for (the disk's spill_queue_s, or the
    largest recent intake), so a later copy into L2 that finds no clean slot waits for a
    short queue. Here one session's 4 blocks a step, where before (b2ac436) a drain queued
    12 blocks at once every third step, whatever was still in flight."""
    # L2 of 64 blocks (high 0.85: 54, low 0.70: 44); the disk writes 4 blocks in the queue
    # time; the replicas never report a spill written, so every spill stays in flight
    bb = make_config(l1=8, l2=64, l3=256).geometry.block_bytes
    cfg = make_config(l1=8, l2=64, l3=256, spill="always", spill_queue_s=1.0,
                      ssd_write_bytes_per_s=4 * bb // 2)  # (per rank: TP 2 halves a block)
    c = Controller(cfg, fake_clock, check_invariants=True)
    reps = [SlotMapReplica(r, 8, 64, 4) for r in range(2)]
    spills = []
    for i in range(30):
        n = f"s{i}"
        c.open_session(n, 16)  # 4 blocks each: one session demoted into L2 a step
        res = c.schedule([n], [0])
        spills.append(sum(int(p.mask(Tier.DRAM, Tier.SSD).sum()) for p in res.plans))
        outs = [rep.apply_step(res) for rep in reps]
        for k in range(len(res.plans)):
            assert c.commit([o[k] for o in outs]).committed
    assert sum(spills) >= 40  # L2 overflowed: it spills what it takes in
    assert max(spills) == 4, spills
    assert max(c.table.pace.recent) == 4
    c.check_integrity()


@pytest.mark.parametrize("spill", ["cost", "always"])
def test_a_copy_into_l2_never_waits_for_a_spill_while_spills_pay(make_config: Any,
                                                                 fake_clock: Any,
                                                                 spill: str) -> None:
    """spill="cost" while a load from L3 beats a recompute (L2 spills): while the ranks
    report spills written, L2 overflows into L3 and nothing is dropped; once the disk falls
    behind (no spill reported written), a demotion into L2 whose clean slots are too few
    drops the coldest L2 sessions for clean slots instead of taking slots a spill still
    reads (it would wait for the disk). spill="always" takes them and waits. Before, "cost"
    waited too: on the H200 (bench/e2e.py --full, c2) steps were blocked 32 s of a 56 s
    run, up to 2.1 s each."""
    bb = make_config(l1=8, l2=64, l3=512).geometry.block_bytes
    cfg = make_config(l1=8, l2=64, l3=512, spill=spill, spill_queue_s=1.0,
                      ssd_write_bytes_per_s=16 * bb // 2)  # (per rank: TP 2 halves a block)
    c = Controller(cfg, fake_clock, check_invariants=True)
    c.rates.ssd_read_bytes_per_s = 1e15  # any load beats a recompute: L2 spills
    reps = [SlotMapReplica(r, 8, 64, 4) for r in range(2)]
    stack = c.table.free[Tier.DRAM]

    def step(n: str, written: bool) -> int:
        c.open_session(n, 16)  # 4 blocks: one session demoted into L2 a step
        cooling = set(stack.stack[:stack.cool].tolist())
        res = c.schedule([n], [0])
        into = np.concatenate([np.zeros(0, np.int32)]
                              + [p.dst_slot[p.mask(Tier.HBM, Tier.DRAM)] for p in res.plans])
        outs = [rep.apply_step(res) for rep in reps]
        for k, plan in enumerate(res.plans):
            results = [o[k] for o in outs]
            if written:  # every spill so far is on disk
                results = [dataclasses.replace(r, spills_written_below=plan.epoch + 1,
                                               spill_write_bytes_per_s=8 * bb)
                           for r in results]
            assert c.commit(results).committed
        return len(cooling & set(into.tolist()))

    waited = sum(step(f"a{i}", True) for i in range(40))
    assert waited == 0
    assert c.snapshot()["event_counts"].get("drop_l2", 0) == 0
    held = c.table.used(Tier.SSD)
    assert held >= 4 * 40 - 64 - 8, held  # what L1 and L2 do not hold is in L3
    waited = sum(step(f"b{i}", False) for i in range(24))
    dropped = c.snapshot()["event_counts"].get("drop_l2", 0)
    if spill == "cost":
        assert waited == 0 and dropped > 0
    else:
        assert waited > 0 and dropped == 0
    c.check_integrity()


def test_intake_room_counts_clean_slots_kept_copies_and_the_queue_left() -> None:
    p, stack = _pacer()  # the disk writes 50 blocks in the queue time
    assert p.intake_room(stack, 0) == 64 + 50
    stack.pop(48)
    stack.push_cooling(np.arange(45, dtype=np.int32), epoch=3, step=p.step)
    assert stack.clean == 16 and stack.in_flight() == 45
    assert p.intake_room(stack, 7) == 16 + 7 + 5
    stack.push_cooling(np.arange(45, 48, dtype=np.int32), epoch=4, step=p.step)
    assert p.intake_room(stack, 0) == 16 + 2  # two more before the queue is full
    full = SlotStack(64, "L2")
    full.pop(60)
    full.push_cooling(np.arange(52, dtype=np.int32), epoch=5, step=p.step)
    assert p.intake_room(full, 0) == 4  # the queue is past full: clean slots only
    # nothing is ever left unwritten: no limit
    assert _pacer(spill="always")[0].intake_room(stack, 0) == -1
    assert _pacer(spill_pacing=False)[0].intake_room(stack, 0) == -1
    assert SpillPacer(PolicyConfig(), 4096, l3=False).intake_room(stack, 0) == -1


def test_a_step_that_fits_the_last_l2_room_leaves_nothing_unwritten(make_config: Any,
                                                                    fake_clock: Any) -> None:
    """StepResult.l2_room is what the next step may copy into L2 before the controller
    leaves L2 blocks unwritten: with the disk behind (no spill reported written), steps
    whose intake fits it drop nothing, and a drop comes only in a step whose intake passed
    it. The room is carried over the wire."""
    bb = make_config(l1=8, l2=64, l3=512).geometry.block_bytes
    cfg = make_config(l1=8, l2=64, l3=512, spill_queue_s=1.0,
                      ssd_write_bytes_per_s=16 * bb // 2)  # (per rank: TP 2 halves a block)
    c = Controller(cfg, fake_clock, check_invariants=True)
    c.rates.ssd_read_bytes_per_s = 1e15  # any load beats a recompute: L2 spills
    reps = [SlotMapReplica(r, 8, 64, 4) for r in range(2)]
    room, fits, passed = -1, 0, 0
    for i in range(60):
        c.open_session(f"s{i}", 16 if i % 3 else 32)  # 4 or 8 blocks demoted into L2
        before = c.snapshot()["event_counts"].get("drop_l2", 0)
        res = c.schedule([f"s{i}"], [0])
        intake = sum(int(p.mask(Tier.HBM, Tier.DRAM).sum() + p.mask(Tier.SSD, Tier.DRAM).sum())
                     for p in res.plans)
        dropped = c.snapshot()["event_counts"].get("drop_l2", 0) > before
        if 0 <= intake <= room:
            assert not dropped, (i, intake, room)
            fits += 1
        elif dropped:
            passed += 1
        assert StepResult.from_dict(res.to_dict()).l2_room == res.l2_room
        room = res.l2_room
        assert room >= 0
        outs = [rep.apply_step(res) for rep in reps]
        for k in range(len(res.plans)):  # nothing reported written: the disk falls behind
            assert c.commit([o[k] for o in outs]).committed
    assert fits > 10 and passed > 0, (fits, passed)
    c.check_integrity()
    no_l3 = Controller(make_config(l1=8, l2=64, l3=0), fake_clock)
    no_l3.open_session("a", 16)
    assert no_l3.schedule(["a"], [0]).l2_room == -1


def test_a_drain_ahead_of_need_takes_clean_l2_slots_and_never_drops(make_config: Any,
                                                                     fake_clock: Any) -> None:
    """An L1 past its high watermark drains into L2 ahead of need. With the disk behind (no
    spill reported written) the drain takes only the clean L2 slots and stops there: nothing
    is dropped for it. Only a step whose own blocks find no room in L1 may leave L2 blocks
    unwritten. Before, the drain's copies counted as needed, and whole L2 sessions were
    dropped to make clean slots for blocks nobody asked to move (bench/e2e.py --full, c2:
    22-30 of 96 sessions lost in the fill round)."""
    bb = make_config(l1=64, l2=16, l3=512).geometry.block_bytes
    cfg = make_config(l1=64, l2=16, l3=512, l1_marks=(0.3, 0.2), spill_queue_s=1.0,
                      ssd_write_bytes_per_s=4 * bb // 2)  # (per rank: TP 2 halves a block)
    c = Controller(cfg, fake_clock, check_invariants=True)
    c.rates.ssd_read_bytes_per_s = 1e15  # any load beats a recompute: L2 spills
    reps = [SlotMapReplica(r, 64, 16, 4) for r in range(2)]
    stack = c.table.free[Tier.DRAM]
    demoted = waited = 0
    for i in range(12):  # 48 blocks: L1 never runs out of room
        c.open_session(f"s{i}", 16)
        cooling = set(stack.stack[:stack.cool].tolist())
        res = c.schedule([f"s{i}"], [0])
        into = np.concatenate([np.zeros(0, np.int32)]
                              + [p.dst_slot[p.mask(Tier.HBM, Tier.DRAM)] for p in res.plans])
        demoted += len(into)
        waited += len(cooling & set(into.tolist()))
        outs = [rep.apply_step(res) for rep in reps]
        for k in range(len(res.plans)):  # nothing reported written: the disk falls behind
            assert c.commit([o[k] for o in outs]).committed
    assert c.snapshot()["event_counts"].get("drop_l2", 0) == 0
    assert demoted >= 16 and waited == 0, (demoted, waited)  # L2 took what was clean
    assert c.table.used(Tier.HBM) > 0.3 * 64  # the drain stopped short of the low mark
    c.check_integrity()
