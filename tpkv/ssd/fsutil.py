"""Small files under an L3 root: checked whole reads, atomic writes, durable directory entries.

Commit records and manifests: plain buffered I/O on every backend.
"""

from __future__ import annotations

import os

from tpkv.errors import SsdFormatError

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read_small_file(path: str, limit_bytes: int) -> bytes:
    """Read a whole file that must not be a symlink nor larger than `limit_bytes`."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes > limit_bytes:
            raise SsdFormatError(f"{os.path.basename(path)} is {size_bytes} bytes, above the "
                                 f"{limit_bytes}-byte limit")
        chunks = []
        while size_bytes > 0:
            chunk = os.read(fd, size_bytes)
            if not chunk:
                break
            chunks.append(chunk)
            size_bytes -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def unlink_missing_ok(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(path: str) -> None:
    """Make the directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, tmp_path: str) -> None:
    """temp + fsync + rename + directory fsync: readers see the old file or the new one, whole."""
    try:
        fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | _O_NOFOLLOW,
                     0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except BaseException:
        try:
            unlink_missing_ok(tmp_path)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path))
