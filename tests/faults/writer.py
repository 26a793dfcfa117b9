"""The killable spill writer of the SIGKILL test and the soak: a child that reports each op."""

from __future__ import annotations

import json
import multiprocessing
import signal
import time
import traceback
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from tests.faults.crashcheck import Model, Op, open_stores, run_op

# Children are forked from a fresh single-threaded server, never from the test process: a fork
# of a process with threads (pytest after Ray, torch or a browser test) may inherit held locks.
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.faults.writer"])
_STALL_S = 30.0  # a writer that sends nothing for this long is killed anyway (and reported)


def start_server() -> None:
    """Start the fork server now (it holds two descriptors of this process from then on)."""
    forkserver.ensure_running()


def _send(conn: Connection, message: list) -> None:
    data = json.dumps(message).encode()
    assert len(data) < 4000  # one write below PIPE_BUF is atomic: no torn message at a kill
    conn.send_bytes(data)


def writer_main(root: Path, model: Model, seed: int, conn: Connection) -> None:
    """The child: open the stores, then spill forever; report each op before and after it."""
    try:
        stores = open_stores(root)
        rng = np.random.default_rng(seed)
        while True:
            op = model.pick(rng)
            _send(conn, ["begin", op.to_list(), model.next_version])
            run_op(stores, op)
            _send(conn, ["ack"])  # only after the store returned: durable
    except BaseException:
        _send(conn, ["error", traceback.format_exc()[-3000:]])
        raise


def spawn_and_kill(root: Path, model: Model, seed: int, wait_messages: int,
                   delay_s: float) -> tuple[list, int]:
    """Start a writer; once it has sent `wait_messages` reports, wait `delay_s` more and SIGKILL
    it (progress-based, so the kill points do not depend on how loaded the machine is).
    Returns its reports and its exit code (-SIGKILL when the kill took it)."""
    recv, send = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=writer_main, args=(root, model, seed, send), daemon=True)
    proc.start()
    send.close()
    messages: list = []
    try:
        while len(messages) < wait_messages and recv.poll(_STALL_S):
            messages.append(json.loads(recv.recv_bytes()))
    except EOFError:
        pass  # the writer died by itself: its last report says why
    time.sleep(delay_s)
    proc.kill()
    proc.join()
    try:
        while recv.poll(0):
            messages.append(json.loads(recv.recv_bytes()))
    except EOFError:
        pass
    recv.close()
    return messages, proc.exitcode if proc.exitcode is not None else 0


def replay(messages: list, model: Model) -> int:
    """Apply a writer's reports to the model; return how many ops it acknowledged."""
    acked = 0
    for message in messages:
        if message[0] == "error":
            raise AssertionError(f"the writer failed on its own:\n{message[1]}")
        if message[0] == "begin":
            model.inflight = Op.from_list(message[1])
            model.next_version = message[2]
        else:
            assert model.inflight is not None
            model.ack(model.inflight)
            acked += 1
    return acked


KILLED = -signal.SIGKILL
