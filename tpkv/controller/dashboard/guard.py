"""Request rules of the dashboard: GET/HEAD only, Host must name the bound address, bearer token."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web

ALLOWED_METHODS = ("GET", "HEAD")
_LOOPBACK_NAMES = {"127.0.0.1": ("localhost",), "::1": ("localhost",),
                   "localhost": ("127.0.0.1", "::1")}
_WILDCARDS = ("0.0.0.0", "::", "")
# The page loads its own script, style and data only; nothing may frame it.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def split_host(header: str) -> tuple[str, int | None] | None:
    """'Name:port', '[v6]:port' or a bare name -> (lower-case name, port or None)."""
    header = header.strip().lower()
    if not header:
        return None
    if header.startswith("["):
        name, sep, rest = header[1:].partition("]")
        if not sep:
            return None
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            return None
    else:
        name, sep, port_text_raw = header.partition(":")
        port_text = port_text_raw if sep else None
        if ":" in port_text_raw:
            return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or len(port_text) > 5:
        return None
    return name, int(port_text)


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    for name in {socket.gethostname(), socket.getfqdn()}:
        names.add(name.lower())
        try:
            names.update(str(info[4][0]).lower() for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return names


@dataclass(frozen=True)
class Guard:
    """The names a Host header may carry (DNS rebinding), the port, and the optional token."""

    names: frozenset[str]
    port: int
    token: str | None = None

    @classmethod
    def for_bind(cls, host: str, port: int, token: str | None = None,
                 extra_hosts: Iterable[str] = ()) -> Guard:
        """The bound name or address; loopback also as localhost; a wildcard bind (asked for
        explicitly) also this machine's names and addresses."""
        bound = host.strip().strip("[]").lower()
        names = {bound, *_LOOPBACK_NAMES.get(bound, ())}
        if bound in _WILDCARDS:
            names |= _local_names()
        names |= {h.strip().strip("[]").lower() for h in extra_hosts}
        names.discard("")
        return cls(frozenset(names), int(port), token or None)

    @staticmethod
    def url_for(host: str, port: int) -> str:
        name = host.strip().strip("[]")
        if name in _WILDCARDS:
            name = socket.getfqdn() or "127.0.0.1"
        try:
            if ipaddress.ip_address(name).version == 6:
                name = f"[{name}]"
        except ValueError:
            pass
        return f"http://{name}:{port}/"

    def host_ok(self, header: str | None) -> bool:
        parsed = split_host(header) if header else None
        if parsed is None:
            return False
        name, port = parsed
        return name in self.names and (port is None or port == self.port)

    def token_ok(self, authorization: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.token.encode())

    def check(self, method: str, headers: Mapping[str, str],
              public: bool) -> web.Response | None:
        """None when the request may proceed, else the refusal (403, 405 or 401)."""
        if not self.host_ok(headers.get("Host")):
            return web.Response(status=403, text="403: Host header does not name this "
                                                 "dashboard's address\n")
        if method.upper() not in ALLOWED_METHODS:
            return web.Response(status=405, text="405: read-only; GET and HEAD only\n",
                                headers={"Allow": ", ".join(ALLOWED_METHODS)})
        if not public and not self.token_ok(headers.get("Authorization")):
            return web.Response(status=401, text="401: bearer token required\n",
                                headers={"WWW-Authenticate": 'Bearer realm="tpkv"'})
        return None


def security_headers(response: web.StreamResponse) -> None:
    h = response.headers
    h.setdefault("Content-Security-Policy", CSP)
    h.setdefault("X-Content-Type-Options", "nosniff")
    h.setdefault("X-Frame-Options", "DENY")
    h.setdefault("Referrer-Policy", "no-referrer")
    h.setdefault("Cache-Control", "no-store")
    h.setdefault("Cross-Origin-Resource-Policy", "same-origin")
