"""A controller in a realistic state, driven on a manual clock: for tests and the screenshot."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from tpkv.config import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, TpkvConfig
from tpkv.controller.controller import Controller
from tpkv.controller.dashboard.recorder import Recorder
from tpkv.controller.replica import SlotMapReplica
from tpkv.protocol.plan import MoveResult, Tier


class ManualClock:
    """A monotonic clock that moves only when told to (the demo's, and the tests')."""

    def __init__(self, start: float = 5000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, f"a monotonic clock cannot go back {-seconds} s"
        self.now += seconds


@dataclass
class DemoState:
    """The controller, the recorder fed like the actor feeds it, the clock, the fake ranks."""

    ctl: Controller
    recorder: Recorder
    clock: ManualClock
    replicas: list[SlotMapReplica] = field(default_factory=list)


def demo_config(ssd_root: str, tp: int = 2) -> TpkvConfig:
    """A 1B-class model's KV (16 layers, 8 KV heads of 64) in 16-token blocks, small tiers."""
    g = KvGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                   block_tokens=16, tp_size=tp)
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=512),
                      l2=HostConfig(budget_bytes=640 * tp * g.block_bytes, arena_bytes=1 << 20),
                      l3=SsdConfig(root=ssd_root, budget_bytes=SsdConfig.budget_for(3600, g)),
                      # every tier in use, and both cost-model choices, on the page
                      policy=PolicyConfig(spill="always"))


def commit_all(state: DemoState, results: list[MoveResult]) -> None:
    """Commit one epoch as the actor does (recorder fed); resync the ranks on a mismatch."""
    ctl = state.ctl
    plan = ctl.pending[0].plan if ctl.pending else None
    outcome = ctl.commit(results)
    state.recorder.on_commit(plan, results, outcome)
    if outcome.resync_needed:
        full = ctl.resync()
        state.recorder.on_resync(int(full["epoch"]), len(full["block_ids"]))
        for rep in state.replicas:
            rep.restore(full)


def step(state: DemoState, batch: list[str], tokens: list[int], upcoming: dict[str, int],
         rng: np.random.Generator, corrupt_rank: int | None = None) -> None:
    """One scheduled step, applied by every fake rank and committed plan by plan."""
    ctl = state.ctl
    res = ctl.schedule(batch, tokens, upcoming)
    reports = [rep.apply_step(res) for rep in state.replicas]
    for i in range(len(res.plans)):
        results = [rep[i] for rep in reports]
        results = [dataclasses.replace(r, elapsed_ns=2_000_000) for r in results]
        if corrupt_rank is not None:
            r = results[corrupt_rank]
            results[corrupt_rank] = dataclasses.replace(r, slot_map_digest=r.slot_map_digest ^ 1)
            corrupt_rank = None
        commit_all(state, results)
        if ctl.committed_epoch != res.plans[i].epoch:
            break  # resynced: later plans of this step are superseded
    for k, name in enumerate(res.session_ids):
        n = int(res.block_offsets[k + 1] - res.block_offsets[k])
        if n:
            ctl.report_attention(name, rng.gamma(0.6, 1.0, n) / n)


def build_demo(ssd_root: str, num_sessions: int = 36, num_steps: int = 150, tp: int = 2,
               seed: int = 7) -> DemoState:
    """Sessions of chat users arriving and returning: several in each tier, committed plans,
    one slot-map mismatch and its resync, a closed session."""
    rng = np.random.default_rng(seed)
    clock = ManualClock()
    cfg = demo_config(ssd_root, tp)
    ctl = Controller(cfg, clock)
    g = cfg.geometry
    recorder = Recorder(g.block_bytes * g.tp_size, ctl.now_s, window_s=180.0, interval_s=3.0)
    state = DemoState(ctl, recorder, clock)
    t = ctl.table
    state.replicas = [SlotMapReplica(r, t.slots(Tier.HBM), t.slots(Tier.DRAM)) for r in range(tp)]
    for r in range(tp):
        ctl.register_rank(r, g, host=f"gpu-node-0:rank{r}")
    kinds = ["chat", "agent", "rag", "code"]
    names = [f"{kinds[i % 4]}-{rng.integers(16**5):05x}" for i in range(num_sessions)]
    weights = 1.0 / np.arange(1, num_sessions + 1) ** 0.9
    weights /= weights.sum()
    tokens: dict[str, int] = {}
    recorder.sample(force=True)
    for i in range(num_steps):
        if i < num_sessions:  # a new user every step at first
            picks = [names[i]]
        else:
            picks = list(rng.choice(names, size=int(rng.integers(1, 4)), replace=False, p=weights))
        picks = [p for p in picks if p in names]
        for p in picks:
            if p not in tokens:
                tokens[p] = int(rng.integers(300, 1800))
                ctl.open_session(p, tokens[p])
            elif rng.random() < 0.3 and tokens[p] < 1800:  # the user's next turn
                extra = int(rng.integers(40, 300))
                tokens[p] += extra
                ctl.extend_session(p, extra)
        nxt = list(rng.choice(names, size=2, replace=False, p=weights))
        upcoming = {n: 1 for n in nxt if n in tokens and n not in picks}
        new = [int(rng.integers(8, 48)) if tokens[p] < 2000 else 1 for p in picks]
        for p, n in zip(picks, new):
            tokens[p] += n
        step(state, picks, new, upcoming, rng,
             corrupt_rank=1 if i == num_steps - 40 else None)
        if i == num_steps - 25:
            ctl.pin(names[0], 0, 8)  # a system prompt kept in L1
        if i == num_steps - 12 and names[-1] in tokens:
            ctl.close_session(names[-1])
            names.remove(names[-1])
            weights = weights[:-1] / weights[:-1].sum()
        clock.advance(float(rng.uniform(0.6, 1.4)))
        recorder.sample()
        if i % 10 == 0:
            ctl.report_prefill(4096, 4096 / 260_000.0)
    return state
