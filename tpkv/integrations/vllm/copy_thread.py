"""CopyThread: a rank's daemon thread that runs copy jobs into vLLM's KV cache one after the
other, on a CUDA stream of its own when the cache is on a GPU, each job's copies after what the
submitting thread's stream held when it was queued."""

from __future__ import annotations

import queue
import threading
from typing import Any, Generic, TypeVar

import torch

J = TypeVar("J")
CLOSE_TIMEOUT_S = 30.0


class CopyThread(Generic[J]):
    """Subclasses set their own fields, then call `_start`; they put jobs on `_jobs` with the
    event of `_caller_event` for their copies to wait for, and `_run_job(job, stream)` runs
    each on the thread (stream None off a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._jobs: queue.Queue[J | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _caller_event(self) -> Any:
        """An event recorded now on the caller's stream, for a job's copies to wait for (None
        off a GPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish the queued jobs and stop; False when the thread is still busy."""
        self._jobs.put(None)
        assert self._thread is not None
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        stream: Any = None
        if self.device.type == "cuda":  # a new thread's current device is the first one
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run_job(job, stream)

    def _run_job(self, job: J, stream: Any) -> None:
        raise NotImplementedError
