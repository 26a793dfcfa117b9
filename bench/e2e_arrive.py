"""bench/e2e.py's arrival process: sessions arrive as a Poisson process and think between turns."""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from bench.e2e_run import Rounds
from tpkv.errors import TpkvError


def schedule(sizes: Any, sessions: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded arrival times (s, the first at 0: exponential gaps of mean 1 / arrival_per_s) and
    think times [sessions, rounds - 1] (exponential, mean think_s) before each returning turn."""
    rng = np.random.default_rng([sizes.seed, 7])
    gaps = rng.exponential(1.0 / sizes.arrival_per_s, sessions)
    arrive = np.cumsum(gaps) - gaps[0]
    think = rng.exponential(sizes.think_s, (sessions, max(sizes.rounds - 1, 0)))
    return arrive, think


class Arrivals(Rounds):
    """The same sessions and turns as the rounds (a first turn that reads the context, then
    rounds - 1 returning turns of user_tokens prompt and gen_tokens answer), in time: session i
    arrives at arrive[i], each next turn comes think[i, turn - 1] seconds after the answer to
    the last. At most `admit` turns (0: the engine's max_batch) are in the engine at once (added
    and not finished); turns due beyond that wait in a FIFO queue here, and their TTFT from the
    arrival counts that wait (queued_ms). The clock is the wall clock, except that while the
    engine has nothing to do it jumps to the next arrival (idle time costs nothing and is left
    out of the measured time)."""

    def run(self) -> dict[str, Any]:
        sizes, n = self.sizes, len(self.contexts)
        names = [f"s{i}" for i in range(n)]
        arrive, think = schedule(sizes, n)
        due: list[tuple[float, int, int]] = [(float(arrive[i]), i, 0) for i in range(n)]
        heapq.heapify(due)  # (time, session index, turn)
        queue: deque[tuple[float, int, int]] = deque()
        admit = sizes.admit or self.engine.max_batch
        in_flight: dict[str, tuple[int, int]] = {}
        gen_tokens, skipped, idle_jumps = 0, 0.0, 0
        self.open_window()
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0 + skipped

        while due or queue or in_flight:
            t = now()
            while due and due[0][0] <= t:
                queue.append(heapq.heappop(due))
            while queue and len(in_flight) < admit:
                at, i, turn = queue.popleft()
                rng = np.random.default_rng([sizes.seed, 8, i, turn])
                size = self.contexts[i] if turn == 0 else sizes.user_tokens
                self.add_turn(names[i], rng.integers(0, self.vocab, size).tolist(),
                              sizes.gen_tokens if turn else 1, returning=turn > 0,
                              queued_s=max(0.0, t - at), turn=turn)
                in_flight[names[i]] = (i, turn)
            if not in_flight:  # idle until the next arrival: jump there
                skipped += max(0.0, due[0][0] - t)
                idle_jumps += 1
                continue
            try:
                _, finished = self.one_step()
            except (TpkvError, torch.OutOfMemoryError) as exc:
                self.failures.append(f"at {now():.1f} s: {type(exc).__name__}: {exc}"[:300])
                break
            for f in finished:
                i, turn = in_flight.pop(f.session)
                gen_tokens += len(f.token_ids) if turn else 0
                if turn + 1 < sizes.rounds:
                    heapq.heappush(due, (now() + float(think[i, turn]), i, turn + 1))
        busy = time.perf_counter() - t0
        print(f"  arrivals: {busy:.1f} s busy, {skipped:.1f} s idle skipped", flush=True)
        self.held_after_fill = self._held(names)  # here: held at the end of the run
        out = self._report(gen_tokens, busy)
        out["arrivals"] = {"arrival_per_s": sizes.arrival_per_s, "think_s": sizes.think_s,
                           "admit": admit, "busy_s": round(busy, 3),
                           "idle_skipped_s": round(skipped, 3), "idle_jumps": idle_jumps,
                           "last_arrival_s": round(float(arrive[-1]), 3) if n else 0.0,
                           "sessions_held_is": "at the end of the run"}
        return out
