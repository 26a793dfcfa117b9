"""All-gather confirmation of plans over the TP group; bounded collectives that name culprits."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tpkv.errors import RankMismatchError, RankTimeoutError
from tpkv.workers.liveness import Liveness

ROW = 4  # [epoch, moves_applied, slot_map_digest, status]
STATUS_OK = 0
STATUS_MISSES = 1  # some L3 reads missed (the map is as planned; the controller drops them)
STATUS_DIVERGED = 2  # moves were refused: they did not start where this rank's map says
STATUS_FAILED = 4  # a group of moves failed (SSD error, L3 disabled)
_BROADCAST_HEAD = 4096  # bytes sent in the first broadcast; longer payloads take a second one


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """out[r * n:(r + 1) * n] <- inp of rank r: all_gather_single where torch has it, else
    all_gather_into_tensor, else all_gather into views of `out`."""
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)
    if hasattr(dist, "all_gather_into_tensor"):
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    views = list(out.view(-1, inp.numel()).unbind(0))
    return dist.all_gather(views, inp, group=group, async_op=async_op)


class BoundedGroup:
    """A process group whose every collective ends within `timeout_s`: a failure or timeout
    raises RankTimeoutError naming the ranks that did not answer (from their heartbeats).

    Collectives are issued async and waited with a deadline that leaves time to diagnose, so
    error included, a call returns within the bound.
    """

    def __init__(self, group: Any, rank: int, world_size: int, timeout_s: float,
                 liveness: Liveness | None, channel: str, device: torch.device | None = None
                 ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.liveness = liveness
        self.channel = channel
        self.device = device or torch.device("cpu")
        self.broken: RankTimeoutError | None = None

    @property
    def wait_budget_s(self) -> float:
        """The wait of a collective leaves time to diagnose, so the whole call fits the bound."""
        probe_s = self.liveness.probe_s if self.liveness else 0.0
        return max(self.timeout_s - probe_s, 0.05 * self.timeout_s)

    def enter(self) -> tuple[int, float]:
        """(sequence number, deadline) of the next collective."""
        if self.broken is not None:
            raise self.broken
        seq = self.liveness.enter(self.channel) if self.liveness else 0
        return seq, time.monotonic() + self.wait_budget_s

    def wait(self, work: Any, seq: int, deadline: float, what: str) -> None:
        """Wait for an async collective until the deadline; any failure becomes a named error."""
        started = deadline - self.wait_budget_s
        try:
            left = max(deadline - time.monotonic(), 0.001)
            if work.wait(timeout=timedelta(seconds=left)) is False:
                raise RuntimeError(f"no answer within {left:.2f} s")
        except RuntimeError as exc:
            raise self.failure(what, seq, started, exc) from exc

    def failure(self, what: str, seq: int, started: float, cause: BaseException
                ) -> RankTimeoutError:
        blame, notes = self.liveness.diagnose(self.channel, seq) if self.liveness else ((), "")
        who = (f"rank{'s' if len(blame) > 1 else ''} {', '.join(map(str, blame))} did not "
               f"answer: {notes}") if blame else "no rank could be named (" + (
            notes or ("every rank beats and reached this point" if self.liveness else
                      "no rendezvous store for heartbeats")) + ")"
        cause_text = str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__
        err = RankTimeoutError(
            f"rank {self.rank}: {what} on the TP group of {self.world_size} failed after "
            f"{time.monotonic() - started:.1f} s (bound {self.timeout_s:g} s): {who} "
            f"[{cause_text}]", blame)
        if self.liveness is not None:
            self.liveness.fail(f"gave up on {what}", follower=True)
        self.broken = err
        return err

    # ---- collectives on CPU tensors (gloo) ---------------------------------------------------
    def all_gather(self, inp: torch.Tensor, what: str) -> tuple[Any, torch.Tensor, int, float]:
        """Start an all-gather of a flat tensor; (work, out [world * n], seq, deadline)."""
        seq, deadline = self.enter()
        out = torch.empty(self.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
        try:
            work = all_gather_flat(out, inp, self.group, async_op=True)
        except RuntimeError as exc:
            raise self.failure(what, seq, deadline - self.wait_budget_s, exc) from exc
        return work, out, seq, deadline

    def broadcast_bytes(self, payload: bytes | None, src: int = 0, what: str = "broadcast"
                        ) -> bytes:
        """Every rank gets `payload` of rank `src` (one collective up to 4 KiB, two above)."""
        seq, deadline = self.enter()
        head = torch.zeros(8 + _BROADCAST_HEAD, dtype=torch.uint8)
        if self.rank == src:
            assert payload is not None
            head[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            first = payload[:_BROADCAST_HEAD]
            head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._run(lambda: dist.broadcast(head, src, group=self.group, async_op=True), seq,
                  deadline, what)
        size = int(head[:8].view(torch.int64)[0])
        if size <= _BROADCAST_HEAD:
            return bytes(head[8:8 + size].numpy())
        rest = torch.empty(size - _BROADCAST_HEAD, dtype=torch.uint8)
        if self.rank == src:
            assert payload is not None
            rest.copy_(torch.frombuffer(bytearray(payload[_BROADCAST_HEAD:]), dtype=torch.uint8))
        self._run(lambda: dist.broadcast(rest, src, group=self.group, async_op=True), seq,
                  deadline, what)
        return bytes(head[8:].numpy()) + bytes(rest.numpy())

    def gather_bytes(self, payload: bytes, what: str = "gather") -> list[bytes]:
        """Every rank gets every rank's payload (two collectives: lengths, then bytes)."""
        work, sizes, seq, deadline = self.all_gather(torch.tensor([len(payload)]), what)
        self.wait(work, seq, deadline, what)
        width = max(int(sizes.max()), 1)
        mine = torch.zeros(width, dtype=torch.uint8)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = torch.empty(self.world_size * width, dtype=torch.uint8)
        self._run(lambda: all_gather_flat(out, mine, self.group, async_op=True), seq, deadline,
                  what)
        rows = out.view(self.world_size, width).numpy()
        return [bytes(rows[r, :int(sizes[r])]) for r in range(self.world_size)]

    def barrier(self, what: str = "barrier") -> None:
        work, _, seq, deadline = self.all_gather(torch.zeros(1, dtype=torch.int64), what)
        self.wait(work, seq, deadline, what)

    def _run(self, issue: Any, seq: int, deadline: float, what: str) -> None:
        try:
            work = issue()
        except RuntimeError as exc:
            raise self.failure(what, seq, deadline - self.wait_budget_s, exc) from exc
        self.wait(work, seq, deadline, what)


Rows = Callable[[], tuple[np.ndarray, np.ndarray]]
TRAILER = 2  # after a rank's rows: [bytes of its forgotten-sessions report, its settled mark]
NO_REPORT = (b"", 0)


class PendingConfirm:
    """One step's confirmation in flight. `build` makes this rank's rows [k, 4] and the rows
    every rank should have [k, 4] (digests included); the confirmation thread runs it, sets
    `rows`, `expected`, `result` (or `error`), then `done`. Plain attributes only.

    `report` (SpillLedger.report: the sessions this rank forgot after failed spills, and the
    epoch below which its spills are all finished) travels in the same all-gather, as a
    trailer after the rows; `forgotten` and `settled` are what every rank agrees on (the
    union of the names, fetched by one more collective only when some rank has any, and the
    lowest mark)."""

    __slots__ = ("build", "rows", "expected", "gathered", "result", "error", "done", "report",
                 "forgotten", "settled")

    def __init__(self, build: Rows, report: tuple[bytes, int] = NO_REPORT) -> None:
        self.build = build
        self.rows = self.expected = np.zeros((0, ROW), dtype=np.int64)
        self.gathered: np.ndarray | None = None  # [world, k, 4] once waited
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = False
        self.report = report
        self.forgotten: frozenset[str] = frozenset()
        self.settled = report[1]

    @classmethod
    def local(cls, build: Rows, report: tuple[bytes, int] = NO_REPORT) -> PendingConfirm:
        """A TP group of one: this rank's rows are all the rows."""
        pending = cls(build, report)
        pending.rows, pending.expected = build()
        pending.gathered, pending.done = pending.rows[None], True
        pending.forgotten = frozenset(decode_names(report[0]))
        return pending


def encode_names(names: list[str]) -> bytes:
    return "\n".join(names).encode()


def decode_names(data: bytes) -> list[str]:
    return [n for n in data.decode(errors="replace").split("\n") if n]


class Confirmer:
    """One all-gather of the fixed-shape int64 rows of a step's plans with moves (and each
    rank's two-number spill report after them: PendingConfirm.report), on a side thread: the
    step loop hands the rows over (a queue put) and later reads the answer (an attribute,
    when it is there), so the collective (gloo on the CPU, or NCCL on a side stream) runs
    beside compute; waiting happens only if compute was shorter than it. A second all-gather
    follows only when some rank reports forgotten sessions (their names). Jobs run in the
    order started, so every rank makes the same collectives in the same order."""

    def __init__(self, group: BoundedGroup) -> None:
        self.group = group
        self.on_gpu = group.device.type == "cuda"
        self._stream = torch.cuda.Stream(group.device) if self.on_gpu else None
        self._jobs: queue.SimpleQueue[PendingConfirm | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tpkv-confirm-r{group.rank}")
        self._thread.start()

    def start(self, build: Rows, report: tuple[bytes, int] = NO_REPORT) -> PendingConfirm:
        pending = PendingConfirm(build, report)
        self._jobs.put(pending)
        return pending

    def wait(self, pending: PendingConfirm) -> np.ndarray:
        """[world, k, 4] rows of every rank (bounded; RankTimeoutError names missing ranks)."""
        if pending.gathered is None:
            if not pending.done:  # the job is bounded by the group's deadline; this is a backstop
                with self._cond:
                    if not self._cond.wait_for(lambda: pending.done, 2 * self.group.timeout_s):
                        raise RankTimeoutError(
                            f"rank {self.group.rank}: confirmation thread did not answer in "
                            f"{2 * self.group.timeout_s:g} s")
            if pending.error is not None:
                raise pending.error
            assert pending.result is not None
            pending.gathered = pending.result
        return pending.gathered

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.rows, job.expected = job.build()
                job.result = self._confirm(job)
            except BaseException as exc:  # handed to the step loop, which raises it
                job.error = exc
            with self._cond:
                job.done = True
                self._cond.notify_all()

    def _confirm(self, job: PendingConfirm) -> np.ndarray:
        """All-gather the job's rows and trailer; [world, k, 4] rows. Sets the job's agreed
        `forgotten` (a second collective, only when some rank forgot sessions) and `settled`."""
        rows = np.ascontiguousarray(job.rows, dtype=np.int64).reshape(-1)
        names, mark = job.report
        k = len(job.rows)
        what = (f"confirmation of epochs {rows[0]}..{rows[-ROW]}" if k
                else "agreement on spilled sessions")
        flat = np.concatenate([rows, np.array([len(names), mark], dtype=np.int64)])
        out = self._gather(flat, what).reshape(self.group.world_size, k * ROW + TRAILER)
        sizes, marks = out[:, -2], out[:, -1]
        job.settled = int(marks.min())
        if sizes.any():  # some rank forgot sessions: every rank sees it, every rank fetches them
            width = -(-int(sizes.max()) // 8)
            mine = np.zeros(width * 8, dtype=np.uint8)
            mine[:len(names)] = np.frombuffer(names, dtype=np.uint8)
            every = self._gather(mine.view(np.int64), "exchange of forgotten sessions")
            every = every.reshape(self.group.world_size, width).view(np.uint8)
            job.forgotten = frozenset(n for r in range(self.group.world_size)
                                      for n in decode_names(bytes(every[r, :int(sizes[r])])))
        return out[:, :k * ROW].reshape(self.group.world_size, k, ROW)

    def _gather(self, flat: np.ndarray, what: str) -> np.ndarray:
        inp = torch.from_numpy(flat)
        if not self.on_gpu:
            work, out, seq, deadline = self.group.all_gather(inp, what)
            self.group.wait(work, seq, deadline, what)
            return out.numpy()
        with torch.cuda.stream(self._stream):
            work, out, seq, deadline = self.group.all_gather(
                inp.to(self.group.device, non_blocking=True), what)
            work.wait()  # the side stream waits, not the host
            host = torch.empty(out.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        while not event.query():
            if time.monotonic() > deadline:
                raise self.group.failure(what, seq, deadline - self.group.wait_budget_s,
                                         TimeoutError("NCCL all-gather not done"))
            time.sleep(0.0002)
        return host.numpy()


def disagreements(gathered: np.ndarray, expected: np.ndarray) -> list[tuple[int, tuple[int, ...]]]:
    """[(epoch, ranks)] for each plan where some rank's row is not the expected one: same epoch,
    every move applied, the plan's digest, and no status but misses."""
    out = []
    for j in range(expected.shape[0]):
        rows = gathered[:, j, :]
        ok = (rows[:, :3] == expected[j, :3]).all(axis=1) & ((rows[:, 3] & ~STATUS_MISSES) == 0)
        if not ok.all():
            out.append((int(expected[j, 0]), tuple(int(r) for r in np.flatnonzero(~ok))))
    return out


def mismatch_error(gathered: np.ndarray, expected: np.ndarray,
                   found: list[tuple[int, tuple[int, ...]]]) -> RankMismatchError:
    epoch, ranks = found[0]
    j = int(np.flatnonzero(expected[:, 0] == epoch)[0])
    detail = "; ".join(f"rank {r}: moves {gathered[r, j, 1]} digest {gathered[r, j, 2]:#x} "
                       f"status {gathered[r, j, 3]}" for r in ranks)
    later = f" (and {len(found) - 1} later plans)" if len(found) > 1 else ""
    return RankMismatchError(
        f"plan {epoch} applied differently on rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}{later}: expected moves {expected[j, 1]} digest "
        f"{expected[j, 2]:#x}; {detail}", epoch, ranks)
