"""RayLink's posts (commits, reports): held until the next flush or send once the caller says
it flushes each step, so the sending thread runs while a forward does."""

from __future__ import annotations

import threading
from typing import Any

from tpkv.launch.link import RayLink


class _Answer:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class FakeClient:
    """The actor client's surface RayLink uses, recording what reaches the 'actor'."""

    log: list[str] = []
    lock = threading.Lock()

    def __init__(self, handle: Any = None, timeout_s: float = 5.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def send(self, method: str, *args: Any, **kwargs: Any) -> _Answer:
        with self.lock:
            self.log.append(method)
        return _Answer(method)


def _link() -> RayLink:
    FakeClient.log = []
    return RayLink(FakeClient())


def _sent(link: RayLink) -> list[str]:
    if link._poster is not None:  # what the posting thread has taken
        link._poster.submit(lambda: None).result(timeout=5)
    return list(FakeClient.log)


def test_posts_go_at_once_unless_held() -> None:
    link = _link()
    link.post("commit", [])
    assert _sent(link) == ["commit"]
    link.close()


def test_held_posts_wait_for_the_flush_and_go_in_order() -> None:
    link = _link()
    link.hold_posts = True
    a = link.post("commit", [])
    b = link.post("report_attention", [])
    assert _sent(link) == [] and not a.done()
    link.flush()
    assert _sent(link) == ["commit", "report_attention"]
    assert a.result(timeout=5) == "commit" and b.result(timeout=5) == "report_attention"
    link.close()


def test_a_send_or_a_wait_on_a_held_post_flushes_it_first() -> None:
    link = _link()
    link.hold_posts = True
    link.post("commit", [])
    link.send("snapshot")  # (through another client: no order between the two)
    assert sorted(_sent(link)) == ["commit", "snapshot"]
    c = link.post("commit", [])
    assert c.result(timeout=5) == "commit"  # waiting sends it: no wait on a held post hangs
    assert sorted(_sent(link)) == ["commit", "commit", "snapshot"]
    link.post("commit", [])
    link.close()  # nothing held is lost at close
    assert sorted(FakeClient.log) == ["commit", "commit", "commit", "snapshot"]


def test_sends_go_from_one_thread_in_order_and_a_schedule_returns_at_once() -> None:
    link = _link()
    gate = threading.Event()
    threads: list[str] = []
    real_send = FakeClient.send

    def slow(self: FakeClient, method: str, *args: Any, **kwargs: Any) -> _Answer:
        threads.append(threading.current_thread().name)
        if method == "schedule":
            gate.wait(timeout=5)
        return real_send(self, method, *args, **kwargs)

    FakeClient.send = slow  # type: ignore[method-assign]
    try:
        reply = link.send("schedule", [])  # its encoding is held at the gate
        assert not reply.done()
        gate.set()
        assert link.send("snapshot").result() == "snapshot"  # goes after the schedule
        assert reply.result(timeout=5) == "schedule"
    finally:
        FakeClient.send = real_send  # type: ignore[method-assign]
    assert FakeClient.log == ["schedule", "snapshot"]
    assert len(threads) == 2 and all(t.startswith("tpkv-send") for t in threads)
    link.close()
