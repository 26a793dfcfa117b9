"""A tpkv app that shows the tiers at work: four chats take turns on tiers too small for all of
them, so between its turns a chat's blocks move L1 -> L2 -> L3 and back. Each turn prints what
moved; the end prints how full each tier is. No model: `forward` stands in for the decode step.

    python examples/app.py                       # TP 1, controller on Ray: prints the dashboard
    python examples/app.py --no-ray              # TP 1, in-process controller: no Ray, no dashboard
    torchrun --nproc-per-node 2 examples/app.py  # TP 2 (gloo on CPU, NCCL on GPUs)
    tpkv launch --tp 2 examples.app:main         # the same through Ray actors

`--pause 2` waits 2 s between turns: time to watch the dashboard. L3 lives in TPKV_SSD_DIR
(default: a directory under /tmp); put it on an NVMe disk for real use.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter

import tpkv
from tpkv import HbmConfig, HostConfig, KvGeometry, PolicyConfig, SsdConfig, Tier, TpkvConfig
from tpkv.protocol.messages import StepResult

NAMES = {Tier.HBM: "L1", Tier.DRAM: "L2", Tier.SSD: "L3"}
CHATS, TURNS, PROMPT, REPLY = 4, 4, 100, 20  # tokens: a chat ends with 8 blocks of 16


def make_config(tp: int) -> TpkvConfig:
    """Small tiers: L1 holds 12 blocks a rank, L2 16; the four chats grow to about 40."""
    g = KvGeometry(num_layers=4, num_kv_heads=8, head_dim=64, dtype="float16", tp_size=tp)
    root = os.path.join(tempfile.gettempdir(), f"tpkv-example-{os.getuid()}")
    return TpkvConfig(geometry=g, l1=HbmConfig(num_blocks=12),
                      l2=HostConfig(budget_bytes=16 * tp * g.block_bytes,  # of the node
                                    arena_bytes=16 * g.block_bytes),
                      l3=SsdConfig(root=root, o_direct=False),
                      # move at once (no cooldown); a slow prefill makes loading beat recomputing
                      policy=PolicyConfig(cooldown_s=0.0, spill="always",
                                          prefill_tokens_per_s=10.0))


def main(controller: str = "ray", pause_s: float = 0.0) -> dict[str, int]:
    """Every rank runs this; rank 0 prints. Returns the moves by direction."""
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    with tpkv.init(make_config(tp), controller=controller) as rt:
        def say(text: str) -> None:
            if rt.rank == 0:
                print(text, flush=True)

        if controller == "local":
            say("controller='local': no dashboard (the default, 'ray', serves one and prints "
                "its URL)")
        say(f"TP {tp}, L3 in {rt.config.l3.root}")
        moved: Counter[str] = Counter()
        step_moves: Counter[str] = Counter()  # this turn's

        def forward(step: StepResult) -> None:  # your model's forward pass
            for plan in step.plans:  # the moves the step's plans made
                for src, dst in zip(plan.src_tier, plan.dst_tier):
                    step_moves[f"{NAMES[Tier(src)]}->{NAMES[Tier(dst)]}"] += 1
            for layer in range(rt.config.geometry.num_layers):
                rt.worker.wait_layer(layer)  # the layer's blocks are in L1
            # ... here: attention over step.block_table (L1 slots), MLP, sampling

        for turn in range(TURNS):
            for c in range(CHATS):
                chat = f"chat-{c}"
                if turn == 0:
                    rt.open_session(chat)
                step_moves.clear()
                rt.run_step([chat], [PROMPT if turn == 0 else REPLY], forward)  # prefill
                for _ in range(3):
                    rt.run_step([chat], [1], forward)  # a few decode steps
                moved.update(step_moves)
                say(f"turn {turn} {chat}: {_moves(step_moves)}")
                time.sleep(pause_s)
        if rt.rank == 0:
            used = Counter(t for c in range(CHATS)  # the controller's view of each block
                           for t in rt.controller.session_blocks(session_id=f"chat-{c}")["tier"])
            say(f"blocks moved: {_moves(moved)}")
            say("where the blocks are now: " + ", ".join(f"{k} {used.get(k, 0)}"
                                                      for k in ("L1", "L2", "L3", "none")))
        for c in range(CHATS):
            rt.close_session(f"chat-{c}")  # frees its blocks on every tier (and its L3 files)
    return dict(moved)


def _moves(counts: Counter[str]) -> str:
    """Loads first (a resume), then demotions."""
    order = ("L3->L2", "L2->L1", "L1->L2", "L2->L3")
    return ", ".join(f"{k} {counts[k]}" for k in order if counts[k]) or "nothing moved"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-ray", action="store_true", help="in-process controller: no Ray")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between turns")
    a = ap.parse_args()
    main("local" if a.no_ray else "ray", a.pause)
