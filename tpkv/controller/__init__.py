"""The controller: block table, policy, planner, cost model (no Ray or torch here but actor.py).

How workers follow a step (`Controller.schedule` -> `StepResult`):
  1. forget `released_block_ids` (closed sessions; delete L3 files of `closed_sessions`);
  2. for each plan i, in epoch order: forget the copies of `drops[i]` (they become Tier.NONE),
     then apply plan i; its moves may run in any order or in parallel, since no slot is both
     vacated and filled by one plan; finish its copies before the next plan starts;
  3. forget `drops[-1]`, delete the L3 files of `ssd_dropped_sessions`;
  4. record `fresh_*` (new blocks and recomputed ones, in L1 slots with no copy yet): the engine
     writes their KV during the step, prefilling `recompute_*` ranges again;
  5. run the step with `block_table` (L1 slots, `block_offsets` per session).
A block on L3 that a step needs comes up in two plans of the same step (L3 -> L2, then
L2 -> L1, consecutive epochs). After each plan every rank reports a MoveResult whose digest is
`plan_digest(plan, its misses)`; `Controller.commit` takes all of them for the oldest epoch.
`SlotMapReplica` is a reference worker-side copy of the slot map that checks these rules.
"""

from typing import TYPE_CHECKING

from tpkv.controller.replica import SlotMapReplica

if TYPE_CHECKING:
    from tpkv.controller.controller import Controller

__all__ = ["Controller", "SlotMapReplica"]


def __getattr__(name: str) -> object:
    """Controller on first use: it imports numba (its kernels), which a process that only needs
    SlotMapReplica need not load (about 0.5 s a process)."""
    if name == "Controller":
        from tpkv.controller.controller import Controller
        return Controller
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
