"""Returns: turns of sessions with KV on L3 wait outside the batch while it is read ahead."""

from __future__ import annotations

import time
from collections.abc import Callable, KeysView, Sequence
from typing import Any

from tpkv.launch.runtime import TpkvRuntime
from tpkv.protocol.plan import Tier


class Returns:
    """The paged engine's admit hook on the tiers (TieredEngine).

    A turn whose session has blocks on L3 waits outside the batch while every rank reads them
    ahead into memory (ReturningReads); the batch goes on without it, and it queues for the
    batch once rank 0's read ahead is done (a slower rank's step reads what it lacks from the
    disk: slower, never wrong). Its step then loads it (schedule's `resume`: the cost model
    priced a disk read). Read aheads start in the order turns arrived, as the budget
    (SsdConfig.read_ahead_bytes) allows; a session whose blocks never fit it, or a step on a
    rank without L3, goes straight in (its step loads or recomputes it as the cost model says).

    The disk and the GPU work at once: a session whose blocks off L1 the GPU recomputes sooner
    than the disk would read them, with the read aheads queued before it (at the speeds
    measured, the recompute weighed by the sessions it delays), goes straight in and is
    recomputed. Rank 0 decides; every rank starts the same reads and admits the same turns.

    With `room` (TieredEngine: PagedEngine.room) the turns ready to go in queue for the batch
    only as it has places for them, and those read ahead take them first: a finished read
    ahead holds its buffers (the budget) until its turn's step, so behind turns that need no
    read (straight, or sent in to be recomputed) it would keep the next reads from starting
    while the disk idles. Within each class the turns go in arrival order; a straight turn
    passed over `max_passed` times (a later turn let in before it) goes in with the first
    class, so none waits without bound. The memory read ahead stays bounded by the budget.
    """

    def __init__(self, rt: TpkvRuntime) -> None:
        self.rt = rt
        self.reading: set[str] = set()  # sessions read ahead (or waiting to be), every rank
        # Rank 0: sessions sent in to be recomputed -> their tokens to recompute, until they ran
        self._recompute_tokens: dict[str, int] = {}
        self.num_read_ahead = 0  # read aheads started (a turn waited outside the batch)
        self.num_recomputed = 0  # turns sent in to recompute instead
        # With nothing else to run, rank 0 waits this long at most for a read ahead before it
        # answers the other ranks (they wait for its answer within wait_timeout_s); the engine
        # then asks again
        self.wait_s = min(1.0, rt.config.wait_timeout_s / 4)
        pol = rt.config.policy
        self.prefill_tokens_per_s = pol.prefill_tokens_per_s  # measured from prefills
        self._start_read_rate = pol.ssd_read_bytes_per_s
        # turns decoding beside the ones admitted (TieredEngine sets it to the engine's)
        self.num_running: Callable[[], int] = lambda: 0
        # Rank 0: the turns outside the batch that were ready when the last step's forward was
        # launched (sample()): the next step lets in those (as the step planned ahead for it
        # expects), not those ready since.
        self._sample: set[str] | None = None
        # Rank 0: turns outside the batch that need no read ahead (any more, or are sent in to
        # be recomputed): sampled next
        self._straight: set[str] = set()
        # places in the batch for turns outside it (None: no limit): TieredEngine sets it to
        # PagedEngine.room (during a step: the next step's)
        self.room: Callable[[], int | None] = lambda: None
        # Rank 0: a straight turn let in after this many later turns went in before it goes
        # in with those read ahead (about a budget's worth of finished read aheads, ~5, and a
        # batch or two more)
        self.max_passed = 8
        self._passed: dict[str, int] = {}  # rank 0: straight turn -> times passed over
        # Rank 0: turns that chose the disk and wait for room in the read-ahead budget -> the
        # bytes they will read, in the order they queued: the disk's queue beyond the reads
        # started (store.ahead.pending_bytes)
        self._line: dict[str, int] = {}
        # Rank 0: blocks the next step may copy into L2 before the controller leaves L2 blocks
        # unwritten because the disk is behind (StepResult.l2_room of the last step; -1: no
        # limit). TieredEngine sets it after each schedule; `new_session_tokens` (the
        # engine's): the prompt tokens of a turn whose session holds no K/V yet (0 for others).
        self.l2_room = -1
        self.new_session_tokens: Callable[[str], int] = lambda name: 0
        self.num_held = 0  # times a turn was kept outside for the disk (samples and admits)
        self.max_held = 64  # a turn kept outside this many times goes in anyway
        self._held: dict[str, int] = {}  # rank 0: turn -> times kept outside for the disk
        self.spill_wait_s = 0.0  # rank 0: time spent waiting for spills before a fresh turn
        # Rank 0: the GPU's decode work ahead of a turn deciding between the disk and a
        # recompute: decode tokens the turns in the batch and queued for it have left
        # (decode_ahead), tokens a turn decodes (turn_tokens), and the seconds a decoded token
        # takes (measured: decoded(); 0 until then). TieredEngine sets the hooks.
        self.decode_ahead: Callable[[], int] = lambda: 0
        self.turn_tokens: Callable[[Sequence[str]], int] = lambda names: 0
        self.decode_token_s = 0.0

    @property
    def recompute(self) -> KeysView[str]:
        """Rank 0: the sessions sent in to be recomputed that have not run yet."""
        return self._recompute_tokens.keys()

    def admit(self, arrived: Sequence[str], returning: Sequence[str], idle: bool) -> list[str]:
        answer = self.rt.from_rank0(lambda: self._decide(arrived, returning, idle),
                                    "turns admitted to the batch")
        worker = self.rt.worker
        for name in answer["read"]:
            if self.rt.rank != 0:  # (rank 0 started them in _decide)
                worker.returning.start(name)
            self.reading.add(name)
        self.num_read_ahead += len(answer["read"])
        return list(answer["go"])

    def sample(self, returning: Sequence[Any]) -> list[str]:
        """Rank 0, once a step's forward is launched: the sessions of these turns outside the
        batch (Seqs) that the next step lets in: their read ahead is done now, or they need
        none (nothing of theirs is on L3 any more), as many as the next step has room for
        (`_pick`)."""
        if self.rt.rank != 0:
            return []
        ready = self._fit_l2(self._pick([s.session for s in returning
                                         if self.ready(s.session)], self.room()))
        self._sample = set(ready)
        return ready

    def ready(self, name: str) -> bool:
        """Rank 0: whether the turn of `name`, outside the batch, may go in: it needs no read
        ahead (any more, or it is sent in to be recomputed), or its read ahead is done. (Only
        the turns whose read ahead started are asked the rank's map: those that wait for room
        in the budget cost nothing a step however long the queue.)"""
        worker = self.rt.worker
        return (name in self._straight or worker.returning.done(name)
                or (name in self.reading and not worker.returning.needed(name)))

    def _pick(self, ready: Sequence[str], room: int | None) -> list[str]:
        """Rank 0: of the turns ready to go in (arrival order), those `room` places take (all
        without a limit): first those read ahead and the straight ones passed over
        max_passed times, then the other straight ones, each in arrival order. A straight
        turn left out while a later one is taken is passed over once more."""
        if room is None or len(ready) <= room:
            return list(ready)
        late = [n in self._straight and self._passed.get(n, 0) < self.max_passed
                for n in ready]
        take = set(sorted(range(len(ready)), key=lambda i: (late[i], i))[:room])
        last = max(take, default=-1)
        for i, name in enumerate(ready):
            if i not in take and i < last and name in self._straight:
                self._passed[name] = self._passed.get(name, 0) + 1
        return [n for i, n in enumerate(ready) if i in take]

    def _fit_l2(self, names: list[str], idle: bool = False,
                taken: Sequence[str] = ()) -> list[str]:
        """Rank 0: of the turns picked to go in, those whose fresh K/V (a new session's
        prompt: what its step pushes down into L2) fits `l2_room` less what the turns before
        them take. The others wait outside while the batch decodes and the disk writes the
        spills that make room, instead of the controller dropping L2 blocks (whose sessions
        would be recomputed). With nothing else to run, the first goes in anyway once this
        rank's spills are written (at most `wait_s`); one kept out `max_held` times goes in
        anyway. `taken`: turns going in already (their K/V counts first)."""
        if self.l2_room < 0 or not names:
            return names
        room = self.l2_room - sum(self._fresh_blocks(n) for n in taken)
        out: list[str] = []
        for name in names:
            need = self._fresh_blocks(name)
            if need <= room or self._held.get(name, 0) >= self.max_held:
                room -= need
            elif idle and not out:
                self._drain_spills()
            else:
                self._held[name] = self._held.get(name, 0) + 1
                self.num_held += 1
                continue
            out.append(name)
            self._held.pop(name, None)
        return out

    def _fresh_blocks(self, name: str) -> int:
        """Blocks of the prompt of a turn that starts a session; 0 for a turn of a session
        that holds K/V. Only new sessions wait for L2 room: a returning turn adds a few blocks,
        and one sent in to be recomputed was sent because the disk is busy; holding either
        for the disk idled the GPU (docs/decisions.md)."""
        return -(-self.new_session_tokens(name) // self.rt.config.geometry.block_tokens)

    def _drain_spills(self) -> None:
        """Rank 0, nothing to run: wait (at most `wait_s`) for this rank's spills, so that the
        next step's report tells the controller their L2 slots are clean."""
        t0 = time.monotonic()
        self.rt.worker.executor.spills.wait_written(self.wait_s)
        self.spill_wait_s += time.monotonic() - t0

    def hints(self, session_ids: Sequence[str]) -> dict[str, str] | None:
        """Schedule's `resume` for a batch: "load" for sessions read ahead, "recompute" for
        those sent in to be recomputed."""
        if not (self.reading or self.recompute):
            return None
        out = {n: "load" for n in session_ids if n in self.reading}
        out.update((n, "recompute") for n in session_ids if n in self.recompute)
        return out or None

    def _decide(self, arrived: Sequence[str], returning: Sequence[str],
                idle: bool) -> dict[str, Any]:
        """Rank 0: which sessions start a read ahead now, and which turns go in: those the
        last sample named, then of the others ready the ones the batch has room for."""
        worker = self.rt.worker
        go: list[str] = []
        read: list[str] = []
        ready: list[str] = []  # ready to go in now, as the batch has room (arrival order)
        sample, self._sample = self._sample, None
        if idle and not sample:  # nothing runs: no step was planned ahead for a batch (one
            sample = None  # the sample names was, for them, though the batch ended meanwhile)
        back = set(returning)
        full = False  # the budget took no more: later turns outside wait their turn for it
        order = [*returning, *arrived]
        gpu_ahead: dict[str, int] | None = None  # (_gpu_ahead, once a turn needs it)
        for name in order:
            if sample is not None and name in sample:  # the step planned ahead expects it
                go.append(name)
                continue
            # one outside the batch the sample did not name waits for the next sample
            waits = sample is not None and name in back
            if worker.returning.done(name):
                if not waits:
                    ready.append(name)
                continue
            if name not in back and worker.returning.on_l3(name):
                if gpu_ahead is None:
                    gpu_ahead = self._gpu_ahead(order, back)
                if self._sooner_recomputed(name, gpu_tokens=gpu_ahead[name]):
                    self._send_to_gpu(name)
                    ready.append(name)
                    continue
            if name in self.recompute:  # sent in to be recomputed: waits for a place
                if not waits:
                    ready.append(name)
                continue
            if full and name in back and name not in self.reading | self._straight:
                continue
            status = worker.returning.start(name)
            if status != "full":
                self._line.pop(name, None)
            if status == "started":  # (again, if a change to its records discarded it)
                read.append(name)
                self._straight.discard(name)
            elif status == "full":
                full = True
                self._straight.discard(name)  # (on L3 again: it waits in line for a read)
                if name not in self._line:
                    self._line[name] = self._l3_bytes(name)
            elif status in ("none", "too_big"):
                self._straight.add(name)  # (one outside the batch goes in once sampled)
                if not waits:
                    ready.append(name)
        if self._line:
            ready += self._unqueue(sample, gpu_ahead or self._gpu_ahead(order, back))
        room = self.room()
        go += self._fit_l2(self._pick(ready, None if room is None else max(0, room - len(go))),
                           idle=idle and not go, taken=go)
        if idle and not go:  # nothing else runs: wait for the first read ahead to end
            self._start_busy([*returning, *arrived], read)
            waiting = [n for n in [*returning, *arrived] if n in self.reading or n in read]
            if waiting and worker.store is not None:
                worker.store.ahead.wait_any(waiting, self.wait_s)
                go = self._pick([n for n in waiting if worker.returning.done(n)], room)
        self._straight.difference_update(go)
        for name in go:
            self._passed.pop(name, None)
        return {"go": go, "read": read}

    def _start_busy(self, names: Sequence[str], read: list[str]) -> None:
        """Rank 0, with nothing else to run: the read aheads that wait for spills of their
        sessions to finish (ReturningReads.start's "busy") start once they have."""
        worker = self.rt.worker
        for name in names:
            if name in read or not worker.executor.spills.busy(name):
                continue
            worker.executor.wait_spills(time.monotonic() + self.rt.config.wait_timeout_s / 2,
                                        names={name})
            if worker.returning.start(name) == "started":
                read.append(name)

    def _send_to_gpu(self, name: str) -> None:
        self._line.pop(name, None)
        self._recompute_tokens[name] = self._off_tokens(name)
        self.num_recomputed += 1
        self._straight.add(name)

    def _gpu_ahead(self, order: Sequence[str], back: set[str]) -> dict[str, int]:
        """Rank 0: for each turn outside the batch (`order`: arrival order; `back`: those
        outside since an earlier step), the decode tokens the GPU has ahead of it: the
        batch's and its queue's (decode_ahead), those of every turn outside that is ready (it
        goes in first), and those of each turn before it that is not (its read not done, or
        just arrived). The batch takes turns in arrival order, so while the disk reads a turn
        faster than the GPU decodes one, a read in line ends before the GPU would reach it,
        and a recompute only adds to the GPU's work (on the H200, c2-em14 recomputed 45 of
        112 returns with the GPU the bound)."""
        ready = {name for name in order if name in back and self.ready(name)}
        total = self.decode_ahead() + (self.turn_tokens(list(ready)) if ready else 0)
        out: dict[str, int] = {}
        for name in order:
            out[name] = total
            if name not in ready:
                total += self.turn_tokens([name])
        return out

    def _unqueue(self, sample: set[str] | None, gpu_ahead: dict[str, int],
                 most: int = 4) -> list[str]:
        """Rank 0: the last turns in the disk's line go to the GPU instead while recomputing
        them ends sooner than their reads would, behind the reads queued before them and the
        GPU's work ahead of them (`gpu_ahead`, _gpu_ahead): at most `most` a step, the last
        first. Those the sample did not name wait for the next sample."""
        moved: list[str] = []
        everyone = max(gpu_ahead.values(), default=0)
        while self._line and len(moved) < most:
            name = next(reversed(self._line))
            if not self._sooner_recomputed(name, queued_bytes=sum(self._line.values())
                                           - self._line[name],
                                           gpu_tokens=gpu_ahead.get(name, everyone)):
                break
            self._send_to_gpu(name)
            if sample is None or name in sample:
                moved.append(name)
        return moved

    def _l3_bytes(self, name: str) -> int:
        worker = self.rt.worker
        if worker.store is None:
            return 0
        return len(worker.mirror.session_logical(name, int(Tier.SSD))) * worker.store.block_bytes

    def _sooner_recomputed(self, name: str, queued_bytes: int | None = None,
                           gpu_tokens: int = 0) -> bool:
        """Rank 0: the session has blocks on L3, and recomputing its blocks off L1 after the
        GPU's work ahead of it (`gpu_tokens` to decode, at the measured time a decoded
        token takes) and the recomputes sent in before it (weighed by the turns decoding,
        whom they delay) ends sooner than reading its L3 blocks after the read aheads queued,
        those started and those waiting in line for the budget (`queued_bytes`: all of the
        line when not given): each queue counts, so a round of returns is split between the
        GPU and the disk, and a read that ends before the GPU would reach the turn anyway is
        never traded for a recompute (which would add to the GPU's work)."""
        store = self.rt.worker.store
        own = self._l3_bytes(name)
        if store is None or not own:
            return False
        weight = 1.0 + self.rt.config.policy.gpu_share_weight * self.num_running()
        queued = sum(self._recompute_tokens.values())
        off = self._off_tokens(name, own // store.block_bytes)
        recompute_s = (gpu_tokens * self.decode_token_s
                       + (queued + off) / self.prefill_tokens_per_s * weight)
        ahead = store.ahead
        # (the measured rate once a job is done: the busy time counts from the first start)
        rate = (ahead.read_bytes / ahead.read_s if ahead.read_bytes and ahead.read_s > 0
                else self._start_read_rate)
        if queued_bytes is None:
            queued_bytes = sum(self._line.values())
        read_s = (ahead.pending_bytes() + queued_bytes + own) / rate
        return recompute_s < read_s

    def _off_tokens(self, name: str, l3_blocks: int | None = None) -> int:
        """Tokens of the session's blocks off L1 (in L2 and L3): what a recompute computes.
        `l3_blocks`: its blocks on L3, where the caller counted them already."""
        mirror = self.rt.worker.mirror
        if l3_blocks is None:
            l3_blocks = len(mirror.session_logical(name, int(Tier.SSD)))
        off = l3_blocks + len(mirror.session_logical(name, int(Tier.DRAM)))
        return off * self.rt.config.geometry.block_tokens

    def decoded(self, batch: int, seconds: float) -> None:
        """A decode step's speed (seconds a decoded token takes), averaged into the estimate."""
        if batch > 0 and seconds > 0:
            sample = seconds / batch
            self.decode_token_s = (sample if self.decode_token_s == 0
                                   else 0.8 * self.decode_token_s + 0.2 * sample)

    def prefilled(self, num_tokens: int, seconds: float) -> None:
        """A prefill's speed (tokens a second), averaged into the estimate."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = (0.8 * self.prefill_tokens_per_s
                                         + 0.2 * num_tokens / seconds)

    def loaded(self, session_ids: Sequence[str]) -> None:
        """The sessions ran a step (their loads are planned) or closed: what was read ahead of
        them goes back."""
        if not (self.reading or self.recompute or self._line or self._held):
            return
        for name in session_ids:
            self._held.pop(name, None)
            self._recompute_tokens.pop(name, None)
            self._line.pop(name, None)
            if name in self.reading:
                self.reading.discard(name)
                self.rt.worker.returning.drop(name)
