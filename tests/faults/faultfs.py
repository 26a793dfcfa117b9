"""A test-only file layer under the L3 store that remembers what is synced and can fake a crash."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tpkv.ssd import backend, files, fsutil, manifest, session_io, store

_SECTOR = 512
# Calls that need no model update but must fail once the "machine" is down.
_READ_ONLY = {"lstat", "stat", "fstat", "scandir", "pread", "preadv", "read", "listdir"}
# The store's modules whose `os` calls go through the fault layer (not reclaim's, not segment's).
STORE_MODULES = (backend, files, fsutil, manifest, session_io, store)


class SimulatedCrash(BaseException):
    """The power went: no store code may catch it (it is not an Exception)."""


class FaultOs:
    """Stands in for the `os` module of the STORE_MODULES (see `installed`).

    Every call goes to the real `os`; those that change files are also recorded in a model:
    per file, the bytes as of its last fsync and the writes since; per directory, its entries as
    of its last fsync and now. Real fsyncs are left out: the model decides what a crash keeps.
    Call number `crash_at` (counting the calls that change something)
    does not happen and raises SimulatedCrash, as does every later call. `crash_tree` then writes
    a state the disk may hold after such a crash.
    """

    def __init__(self, root: str | Path, crash_at: int | None = None,
                 self_check: bool = False) -> None:
        self.root = os.path.realpath(root)  # the store's paths are below its realpath'd root
        self.self_check = self_check  # at each fsync, compare the model with the real file
        self.crash_at = crash_at
        self.calls = 0  # changing calls made (the crash point counts these)
        self.crashed = False
        self.torn: tuple[int, int, bytes] | None = None  # the write cut by the crash
        self._next_fid = 0
        self.synced: dict[int, bytes] = {}  # fid -> bytes as of its last fsync
        self.pending: dict[int, list[tuple[int, bytes | None]]] = {}  # (offset, data | truncate)
        self.names: dict[str, dict[str, int | None]] = {}  # dir -> entry -> fid (None: a dir)
        self.durable: dict[str, dict[str, int | None]] = {}
        self._fds: dict[int, list[Any]] = {}  # fd -> [fid, position] or [None, dir path]
        self._scan(self.root)

    def _scan(self, path: str) -> None:
        entries: dict[str, int | None] = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False):
                entries[entry.name] = None
                self._scan(entry.path)
            else:
                entries[entry.name] = fid = self._new_fid()
                self.synced[fid] = Path(entry.path).read_bytes()
        self.names[path] = entries
        self.durable[path] = dict(entries)

    def _new_fid(self) -> int:
        self._next_fid += 1
        self.pending[self._next_fid] = []
        self.synced[self._next_fid] = b""
        return self._next_fid

    def _step(self) -> None:
        if self.crashed:
            raise SimulatedCrash("the machine is down")
        self.calls += 1
        if self.calls == self.crash_at:
            self.crashed = True
            raise SimulatedCrash(f"crash at changing call {self.calls}")

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in _READ_ONLY:
            return real

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.crashed:
                raise SimulatedCrash("the machine is down")
            return real(*args, **kwargs)
        return guarded

    # ---- the calls the store makes ---------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT:
            self._step()
        elif self.crashed:
            raise SimulatedCrash("the machine is down")
        fd = os.open(path, flags, mode)
        if flags & getattr(os, "O_DIRECTORY", 0):
            self._fds[fd] = [None, path]
            return fd
        parent, name = os.path.split(path)
        fid = self.names[parent].get(name)
        if fid is None:
            fid = self.names[parent][name] = self._new_fid()
        elif flags & os.O_TRUNC:
            self.pending[fid].append((0, None))
        self._fds[fd] = [fid, 0]
        return fd

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        os.close(fd)  # even after the crash: the test process must not leak descriptors

    def pwritev(self, fd: int, bufs: list, offset: int) -> int:
        data = b"".join(bytes(b) for b in bufs)
        self._write_step(fd, offset, data)
        done = os.pwritev(fd, bufs, offset)
        self.pending[self._fds[fd][0]].append((offset, data[:done]))
        return done

    def write(self, fd: int, data: Any) -> int:
        handle = self._fds[fd]
        self._write_step(fd, handle[1], bytes(data))
        done = os.write(fd, data)
        self.pending[handle[0]].append((handle[1], bytes(data)[:done]))
        handle[1] += done
        return done

    def _write_step(self, fd: int, offset: int, data: bytes) -> None:
        try:
            self._step()
        except SimulatedCrash:
            if self.torn is None and fd in self._fds:  # cut mid-way: part may reach the disk
                self.torn = (self._fds[fd][0], offset, data)
            raise

    def ftruncate(self, fd: int, size: int) -> None:
        self._step()
        os.ftruncate(fd, size)
        self.pending[self._fds[fd][0]].append((size, None))

    def fsync(self, fd: int) -> None:
        self._step()  # the model is the disk here: no real fsync (the tests stay fast)
        fid, where = self._fds[fd]
        if fid is None:
            self.durable[where] = dict(self.names[where])
            return
        content = self.content(fid, lambda op: op)
        if self.self_check:
            actual = Path(f"/proc/self/fd/{fd}").read_bytes()  # the fd may be write-only
            assert actual == content, f"fault layer lost track of a file ({len(actual)} bytes)"
        self.synced[fid], self.pending[fid] = content, []

    def replace(self, src: str, dst: str) -> None:
        self._step()
        os.replace(src, dst)
        (sp, sn), (dp, dn) = (os.path.split(p) for p in (src, dst))
        self.names[dp][dn] = self.names[sp].pop(sn)

    def unlink(self, path: str) -> None:
        self._step()
        os.unlink(path)
        parent, name = os.path.split(path)
        self.names[parent].pop(name)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._step()
        os.mkdir(path, mode)
        parent, name = os.path.split(path)
        self.names[parent][name] = None
        self.names[path] = {}
        self.durable[path] = {}

    # ---- after the crash --------------------------------------------------------------------

    def content(self, fid: int, choose: Callable[[tuple[int, bytes | None]],
                                                 tuple[int, bytes | None] | None]) -> bytes:
        """The synced bytes with each later write (or truncate) as `choose` returns it."""
        out = bytearray(self.synced[fid])
        ops = list(self.pending[fid])
        if self.torn is not None and self.torn[0] == fid:
            ops.append(self.torn[1:])
        for raw in ops:
            op = choose(raw)
            if op is None:
                continue
            offset, data = op
            if data is None:
                del out[offset:]
                continue
            if len(out) < offset:
                out.extend(bytes(offset - len(out)))
            out[offset:offset + len(data)] = data
        return bytes(out)

    def crash_tree(self, dest: str | Path, names: str, data: str,
                   rng: np.random.Generator) -> None:
        """Write to `dest` what the root may hold after the crash.

        names: "durable" keeps only directory entries as of each directory's last fsync (files
        created or renamed since vanish, unlinked ones come back); "current" keeps them all.
        data: "drop" loses every write not followed by its file's fsync; "keep" keeps them all
        (and completes the cut write); "garble" keeps, drops, tears (a prefix of whole
        sectors) or garbles (random bytes over some sectors) each of them at random.
        """
        pick = {"drop": lambda op: None, "keep": lambda op: op,
                "garble": lambda op: _garble(op, rng)}[data]
        table = self.durable if names == "durable" else self.names
        self._write_dir(self.root, Path(dest), table, pick)

    def _write_dir(self, src: str, dest: Path, table: dict, pick: Callable) -> None:
        dest.mkdir(exist_ok=True)
        for name, fid in table.get(src, {}).items():
            if fid is None:
                self._write_dir(os.path.join(src, name), dest / name, table, pick)
            else:
                (dest / name).write_bytes(self.content(fid, pick))


def _garble(op: tuple[int, bytes | None], rng: np.random.Generator
            ) -> tuple[int, bytes | None] | None:
    """One unsynced write's fate: kept, lost, torn (first sectors only) or partly garbled."""
    offset, data = op
    fate = int(rng.integers(4))
    if fate == 0:
        return op
    if fate == 1 or data is None:
        return None
    if fate == 2:
        return offset, data[:_SECTOR * int(rng.integers(0, len(data) // _SECTOR + 1))]
    junk = bytearray(data)
    start = _SECTOR * int(rng.integers(0, max(1, len(data) // _SECTOR)))
    stop = min(len(data), start + _SECTOR * int(rng.integers(1, 4)))
    junk[start:stop] = rng.integers(0, 256, stop - start, dtype=np.uint8).tobytes()
    return offset, bytes(junk)


@contextlib.contextmanager
def installed(fault_os: FaultOs) -> Iterator[FaultOs]:
    """The store modules see `fault_os` as their `os` while inside; the real `os` is untouched.
    Records by address (vector_io's system calls, which no `os` sees) are off meanwhile: an L2
    pool's blocks go through os.pwritev/os.preadv, the same calls on the same bytes."""
    saved = [module.os for module in STORE_MODULES]
    by_address = backend.PosixFile.by_address
    for module in STORE_MODULES:
        module.os = fault_os  # type: ignore[assignment]
    backend.PosixFile.by_address = lambda self: False  # type: ignore[method-assign]
    try:
        yield fault_os
    finally:
        for module, real in zip(STORE_MODULES, saved):
            module.os = real
        backend.PosixFile.by_address = by_address  # type: ignore[method-assign]
