"""Ctrl-C and SIGTERM end a `tpkv` command with "stopping" and an exit code, not a traceback.

`install()` makes SIGTERM (and SIGINT) raise `Stop` on the main thread, so the command's
`finally` blocks run (the demo kills its controller and shuts down the Ray cluster it started)
and `tpkv` exits with 128 + the signal's number: 143 for SIGTERM, 130 for Ctrl-C, as a shell
reports a command that a signal ended. A second signal while stopping is ignored. ray.init puts
its own SIGTERM handler in place (sys.exit), so a command calls install() again after it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGTERM = int(signal.SIGTERM)


class Stop(BaseException):
    """A signal asked the command to stop (BaseException: `except Exception` lets it pass)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_stopping = False
_signum = 0


def _handler(signum: int, frame: FrameType | None) -> None:
    global _stopping
    name = signal.Signals(signum).name
    if _stopping:  # cleanup is under way: let it finish
        os.write(2, f"tpkv: {name} again, still stopping\n".encode())
        return
    _stopping, _signum = True, signum
    # os.write, not print: a handler may run in the middle of another print
    os.write(2, f"tpkv: {name}, stopping\n".encode())
    if not _deferring:
        raise Stop(signum)


def install() -> None:
    """SIGTERM and SIGINT raise Stop on the main thread (no-op on other threads)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)


_deferring = False


@contextmanager
def deferred() -> Iterator[None]:
    """Around a wait in native code (ray.wait), which mishandles an exception raised by a
    signal handler: a signal only records the request, and Stop is raised on the way out."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():  # signals go to main only
        yield
        return
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
    check()


def check() -> None:
    """Raise Stop if a signal asked to stop (a no-op until one did)."""
    if _signum:
        raise Stop(_signum)
