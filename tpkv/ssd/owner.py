"""Ownership of an L3 root per rank: an exclusive flock on `<root>/owner.r<rank>.lock`."""

from __future__ import annotations

import fcntl
import os
import socket

from tpkv.errors import SsdIoError, SsdRootInUseError

_INFO_MAX_BYTES = 4096


def lock_path(root: str, rank: int) -> str:
    return os.path.join(root, f"owner.r{rank}.lock")


class RootLock:
    """Held from construction until release(): no other store, in this process or another, can
    own the same (root, rank) meanwhile. The kernel drops the lock when its holder dies, so a
    restarted node takes it again and finds its records. The file stays (removing it would let
    two processes lock two different files of one name); it holds the owner's pid, host and
    model for the error a second owner gets."""

    def __init__(self, root: str, rank: int, model_fingerprint: str) -> None:
        self.path = lock_path(root, rank)
        self._fd: int | None = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise SsdIoError(f"L3 rank {rank}: cannot open the owner lock {self.path!r}: {exc}",
                             exc.errno) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_info(fd)
            os.close(fd)
            raise SsdRootInUseError(
                f"L3 root {root!r} rank {rank} is owned by another live store ({holder}); "
                f"give each server its own SsdConfig.root, or close the other store first"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise SsdIoError(f"L3 rank {rank}: cannot lock {self.path!r}: {exc}",
                             exc.errno) from exc
        self._fd = fd
        info = (f"pid {os.getpid()} on host {socket.gethostname()}, model "
                f"{model_fingerprint[:200]!r}\n").encode("utf-8", "replace")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
        except OSError:
            pass  # the lock is what counts; the text only names the holder in errors

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __del__(self) -> None:  # a store dropped without close() frees its root when collected
        self.release()


def _read_info(fd: int) -> str:
    try:
        text = os.pread(fd, _INFO_MAX_BYTES, 0).decode("utf-8", "replace").strip()
    except OSError as exc:
        return f"holder unknown: {exc}"
    return text or "holder unknown: it has not written its pid yet"
