"""RayLink's posts (commits, reports): held, once the caller says it schedules each step, until
the next call, which takes them along in the same actor call; sent alone at a flush."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tpkv.errors import BadRequestError, ControllerError, PlanOrderError
from tpkv.launch.link import RayLink
from tpkv.launch.sent import SentCalls


class _Answer:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class FakeClient:
    """The actor client's surface RayLink uses, recording each actor call's methods."""

    log: list[list[str]] = []
    lock = threading.Lock()
    threads: list[str] = []

    def __init__(self, handle: Any = None, timeout_s: float = 5.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def send_many(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]
                  ) -> list[Any]:
        out: list[Any] = []
        for method, args, _ in calls:
            if method == "bad":  # arguments that cannot go on the wire: not sent
                out.append(BadRequestError("controller has no method 'bad'"))
            elif args and args[0] == "refuse":  # the controller's typed error
                out.append(_Answer(PlanOrderError(f"{method} refused")))
            else:
                out.append(_Answer(method))
        with self.lock:
            self.threads.append(threading.current_thread().name)
            sent = [m for m, *_ in calls if m != "bad"]
            if sent:
                self.log.append(sent)
        return out


def _link() -> RayLink:
    FakeClient.log, FakeClient.threads = [], []
    return RayLink(FakeClient())


def _sent(link: RayLink) -> list[list[str]]:
    if link._sender is not None:  # what the sending thread has taken
        link._sender.submit(lambda: None).result(timeout=5)
    return list(FakeClient.log)


def test_posts_go_at_once_unless_held() -> None:
    link = _link()
    assert link.post("commit", []).result(timeout=5) == "commit"
    assert _sent(link) == [["commit"]]
    link.close()


def test_held_posts_ride_with_the_next_call_ahead_of_it_in_order() -> None:
    link = _link()
    link.hold_posts = True
    a = link.post("commit", [])
    b = link.post("report_attention", [])
    assert _sent(link) == [] and not a.done()
    reply = link.send("schedule", [])
    assert reply.result(timeout=5) == "schedule"
    assert _sent(link) == [["commit", "report_attention", "schedule"]]  # one actor call
    assert a.result(timeout=5) == "commit" and b.result(timeout=5) == "report_attention"
    link.post("commit", [])
    assert link.send("snapshot").result() == "snapshot"  # any call takes them along
    assert _sent(link)[-1] == ["commit", "snapshot"]
    link.close()


def test_a_flush_or_a_wait_on_a_held_post_sends_it_alone() -> None:
    link = _link()
    link.hold_posts = True
    link.post("commit", [])
    link.post("commit", [])
    link.flush()
    assert _sent(link) == [["commit", "commit"]]
    c = link.post("commit", [])
    assert c.result(timeout=5) == "commit"  # waiting sends it: no wait on a held post hangs
    assert _sent(link)[-1] == ["commit"]
    link.flush()  # nothing held: no actor call
    link.post("commit", [])
    link.close()  # nothing held is lost at close
    assert _sent(link) == [["commit", "commit"], ["commit"], ["commit"]]


def test_an_error_is_its_own_calls_alone() -> None:
    link = _link()
    link.hold_posts = True
    refused = link.post("commit", "refuse")
    unsendable = link.post("bad")
    fine = link.post("report_prefill", [])
    reply = link.send("schedule", [])
    assert reply.result(timeout=5) == "schedule"
    with pytest.raises(PlanOrderError, match="commit refused"):
        refused.result(timeout=5)
    with pytest.raises(BadRequestError, match="'bad'"):
        unsendable.result(timeout=5)
    assert fine.result(timeout=5) == "report_prefill"
    assert _sent(link) == [["commit", "report_prefill", "schedule"]]
    with pytest.raises(BadRequestError):  # a call that cannot be sent raises at send
        link.send("bad")
    link.close()


def test_sends_go_from_one_thread_in_order_and_a_schedule_returns_at_once() -> None:
    link = _link()
    gate = threading.Event()
    real = FakeClient.send_many

    def slow(self: FakeClient, calls: list[Any]) -> list[Any]:
        if calls[-1][0] == "schedule":
            gate.wait(timeout=5)
        return real(self, calls)

    FakeClient.send_many = slow  # type: ignore[method-assign]
    try:
        reply = link.send("schedule", [])  # its encoding is held at the gate
        assert not reply.done()
        gate.set()
        assert link.send("snapshot").result() == "snapshot"  # goes after the schedule
        assert reply.result(timeout=5) == "schedule"
    finally:
        FakeClient.send_many = real  # type: ignore[method-assign]
    assert FakeClient.log == [["schedule"], ["snapshot"]]
    assert len(FakeClient.threads) == 2
    assert all(t.startswith("tpkv-send") for t in FakeClient.threads)
    link.close()


class _Link:
    """A link whose posts answer at once, each with the next of `answers`."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers

    def post(self, method: str, *args: Any, **kwargs: Any) -> _Answer:
        return _Answer(self.answers.pop(0))


def test_a_commit_the_controller_failed_on_is_a_refusal_once() -> None:
    """A commit whose answer is a controller bug (ControllerError) is not committed: the
    runtime resyncs, once; the look goes on past it (on 96ca0ae it raised at every look)."""
    class Outcome:
        committed = True

    sent = SentCalls(timeout_s=5.0)
    link = _Link([Outcome(), ControllerError("controller.commit raised KeyError: 3"),
                  Outcome()])
    for _ in range(3):
        sent.commit(link, [])
    assert sent.take_refusal() and sent.num_refusals == 1
    assert sent.commits == [] and not sent.take_refusal()

