"""ExecOutcome: what one plan did on one rank; blocked() and wait_handle(): its bounded waits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tpkv.errors import WaitTimeoutError
from tpkv.workers.copy_engine import CopyHandle

_POLL_S = 0.0001
_POLL_FINE_S = 0.05


@dataclass
class ExecOutcome:
    """What one plan did on this rank: moves done (mask over the plan), L3 read misses, bytes."""

    done: np.ndarray
    misses: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_ssd_read: int = 0
    bytes_ssd_write: int = 0
    error: str = ""  # the first failure, if a group of moves could not be carried out
    host_ns: int = 0  # host time of the plan (SSD I/O included)
    # of it, waiting for spills to end: spills that read the L2 slots its copies fill, or
    # write the records its loads read
    spill_wait_ns: int = 0
    # of it, blocked on other work (spills and earlier copies the plan's moves must follow):
    # not the plan's own transfer time, so not in what the controller's rate meter sees
    blocked_ns: int = 0
    h2d_issued_ns: int = 0  # perf_counter_ns once its first L2 -> L1 copy was issued (0: none)
    # (direction, start, stop) of each copy batch on its stream (GPU only)
    timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    # the first `ahead_spans` of `timing`: copies issued during the plan before's reads (Chain),
    # apart from each other in time: their device time is their sum, not their span
    ahead_spans: int = 0
    num_ahead: int = 0  # moves issued so
    # SpillTracker.progress once the plan ran: spills written below this epoch, disk rate
    spills_written_below: int = 0
    spill_write_bytes_per_s: int = 0
    # its L3 reads were waited for only at a later step (PlanExecutor.run_reads_later): its
    # time is not that of its transfers
    unmeasured: bool = False

    def elapsed_ns(self) -> int:
        """Host time, or the GPU time of its copies if longer; 0 (not measured: the rate meter
        takes no sample) while a copy still runs, or when `unmeasured`. A step's plans issued
        once its forward is launched are reported at the next step, often before their copies
        (which follow the forward) are done: their host time alone read as 400-500 GB/s of H2D
        on the H200."""
        if self.unmeasured or not all(b.query() for _, _, b in self.timing):
            return 0
        done = [a.elapsed_time(b) for _, a, b in self.timing]
        gpu_ms = max([sum(done[:self.ahead_spans]), *done[self.ahead_spans:]], default=0.0)
        return max(self.host_ns - self.blocked_ns, int(gpu_ms * 1e6))


@contextmanager
def blocked(out: ExecOutcome) -> Iterator[None]:
    """Count the time inside as the plan's time blocked on other work (ExecOutcome.blocked_ns)."""
    started = time.perf_counter_ns()
    try:
        yield
    finally:
        out.blocked_ns += time.perf_counter_ns() - started


@contextmanager
def spill_waits(out: ExecOutcome) -> Iterator[None]:
    """Count the time inside as blocked and, of it, waiting for spills (spill_wait_ns)."""
    before = out.blocked_ns
    try:
        with blocked(out):
            yield
    finally:
        out.spill_wait_ns += out.blocked_ns - before


def wait_handle(handle: CopyHandle | None, deadline: float, what: str) -> None:
    """Block the host until a copy batch is done, or raise WaitTimeoutError at the deadline.
    Polls every _POLL_S for the first _POLL_FINE_S (a resume waits a few ms for its copies, and
    a doubling back-off made those waits end up to 5 ms late: on the H200 resume waits
    clustered at 3.5, 6.8, 11.8 and 17 ms), then backs off to 5 ms."""
    delay, fine_until = _POLL_S, time.monotonic() + _POLL_FINE_S
    while handle is not None and not handle.done():
        now = time.monotonic()
        if now > deadline:
            raise WaitTimeoutError(f"{what}: {handle.direction} copy of {handle.num_blocks} "
                                   f"blocks ({handle.num_bytes} bytes) not done by its deadline")
        time.sleep(delay)
        if now > fine_until:
            delay = min(delay * 2, 0.005)

