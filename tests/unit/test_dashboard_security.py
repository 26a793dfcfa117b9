"""Dashboard rules: GET/HEAD only (405), Host names the bound address (403), bearer token (401)."""

from __future__ import annotations

import http.client
import re
import socket
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest

from tpkv.controller.dashboard import DashboardServer, Guard, ServerThread
from tpkv.controller.dashboard.guard import split_host

pytestmark = pytest.mark.timeout(30)
TOKEN = "s3cret-token"
SNAPSHOT = {"tick": 1, "sessions": [{"session": "only-in-the-api"}], "ranks": {}}


def request(port: int, method: str, path: str, host: str | None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly this Host header (None: none at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def serve(token: str | None) -> ServerThread:
    return ServerThread(DashboardServer(lambda: SNAPSHOT, port=0, token=token,
                                        sample_interval_s=None))


@pytest.fixture(scope="module")
def open_port() -> Iterator[int]:
    with serve(None) as t:
        yield t.server.port


@pytest.fixture(scope="module")
def token_port() -> Iterator[int]:
    with serve(TOKEN) as t:
        yield t.server.port


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1:{port}", 200), ("127.0.0.1", 200), ("localhost", 200), ("localhost:{port}", 200),
    ("LocalHost:{port}", 200), ("evil.example", 403), ("evil.example:{port}", 403),
    ("127.0.0.1:1", 403), ("localhost:80", 403), ("127.0.0.1.evil.example:{port}", 403),
    ("[::1]:{port}", 403), ("127.0.0.1:{port}:1", 403), ("127.0.0.1:x", 403), ("", 403),
    (None, 403)])
def test_host_header_must_name_the_bound_address(open_port: int, host: str | None,
                                                 status: int) -> None:
    header = None if host is None else host.format(port=open_port)
    for path in ("/", "/api/snapshot", "/metrics", "/nowhere"):
        got, headers, _ = request(open_port, "GET", path, header)
        if header is None:  # aiohttp itself refuses an HTTP/1.1 request without Host
            assert got in (400, 403)
            continue
        assert got == (404 if status == 200 and path == "/nowhere" else status), (path, header)
        assert headers["content-security-policy"].startswith("default-src 'none'")


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_only_get_and_head(open_port: int, method: str) -> None:
    for path in ("/", "/api/snapshot", "/metrics", "/nowhere"):
        status, headers, _ = request(open_port, method, path, f"127.0.0.1:{open_port}")
        assert status == 405 and headers["allow"] == "GET, HEAD", (method, path)
    status, _, _ = request(open_port, "HEAD", "/metrics", f"127.0.0.1:{open_port}")
    assert status == 200


def test_bearer_token(token_port: int) -> None:
    host = f"127.0.0.1:{token_port}"
    for path in ("/api/snapshot", "/metrics"):
        status, headers, body = request(token_port, "GET", path, host)
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert b"only-in-the-api" not in body
        for auth in ("Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", "Bearer "):
            assert request(token_port, "GET", path, host, {"Authorization": auth})[0] == 401
        for auth in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):
            assert request(token_port, "GET", path, host, {"Authorization": auth})[0] == 200
    status, _, body = request(token_port, "GET", "/api/snapshot", host,
                              {"Authorization": f"Bearer {TOKEN}"})
    assert b"only-in-the-api" in body
    # the page's own files hold no data and load without it (the page then asks for the token)
    for path in ("/", "/static/app.js", "/static/charts.js", "/static/style.css"):
        status, _, body = request(token_port, "GET", path, host)
        assert status == 200 and b"only-in-the-api" not in body
    # the Host rule comes first, token or not
    assert request(token_port, "GET", "/api/snapshot", "evil.example",
                   {"Authorization": f"Bearer {TOKEN}"})[0] == 403


def test_security_headers(open_port: int) -> None:
    _, headers, _ = request(open_port, "GET", "/", f"localhost:{open_port}")
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"


def test_page_sources_never_build_markup_from_data() -> None:
    """Escaping by construction: text goes in through textContent or canvas fillText only."""
    static = resources.files("tpkv.controller.dashboard") / "static"
    for name in ("app.js", "charts.js"):
        source = (static / name).read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                     "new Function", "setAttribute(\"on", "srcdoc"):
            assert sink not in source, (name, sink)
    html = (static / "index.html").read_text()
    assert not re.search(r"<script>|\son\w+=|style=", html)  # no inline script, handler, style


def test_split_host_and_guard() -> None:
    assert split_host("Example.COM:8470") == ("example.com", 8470)
    assert split_host("[::1]:8470") == ("::1", 8470) and split_host("[::1]") == ("::1", None)
    for bad in ("", "[::1", "[::1]x", "a:b", "a:1:2", "a:123456"):
        assert split_host(bad) is None, bad
    g = Guard.for_bind("::1", 9000)
    assert g.host_ok("[::1]:9000") and g.host_ok("localhost") and not g.host_ok("127.0.0.1")
    named = Guard.for_bind("dash.internal", 9000, extra_hosts=["proxy.example"])
    assert named.host_ok("dash.internal:9000") and named.host_ok("proxy.example")
    assert not named.host_ok("localhost")
    wild = Guard.for_bind("0.0.0.0", 9000)  # only when asked: this machine's names, no others
    assert wild.host_ok(f"{socket.gethostname()}:9000") and wild.host_ok("127.0.0.1:9000")
    assert not wild.host_ok("evil.example:9000") and not wild.host_ok("0.0.0.0:1")
    assert Guard.url_for("::1", 9000) == "http://[::1]:9000/"
    assert Guard.url_for("127.0.0.1", 8470) == "http://127.0.0.1:8470/"
    assert Guard(frozenset(), 1, None).token_ok(None)
    assert not Guard(frozenset(), 1, "t").token_ok(None)


def test_binds_only_the_configured_address(open_port: int) -> None:
    """127.0.0.1 by default: nothing listens on the machine's other addresses."""
    others: set[Any] = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            others.add(info[4][0])
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the default route's
        try:  # address (a UDP connect sends nothing)
            probe.connect(("10.255.255.255", 9))
            others.add(probe.getsockname()[0])
        except OSError:
            pass
    others = {a for a in others if not str(a).startswith("127.") and str(a) != "0.0.0.0"}
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for addr in others:
        with pytest.raises(OSError), socket.create_connection((addr, open_port), timeout=2):
            pass
