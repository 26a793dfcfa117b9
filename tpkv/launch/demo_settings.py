"""`tpkv demo`'s config: its tiers, then TPKV_* variables, then flags; what a taken port does.

Precedence: `--dashboard-host/--dashboard-port` over TPKV_DASHBOARD_HOST/PORT over the defaults
(127.0.0.1:8470); TPKV_DASHBOARD_TOKEN (no flag: a token on a command line is visible to every
user of the machine) makes the dashboard's data need `Authorization: Bearer <token>`.

A port that is taken: when it was asked for (flag or TPKV_DASHBOARD_PORT) the demo stops with a
ConfigError naming the port and both ways to choose another; when it is the default 8470 (e.g. a
second demo) the dashboard takes a free port instead and the demo prints a notice saying so.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
from collections.abc import Mapping

from tpkv.checks import check_int
from tpkv.config import TpkvConfig, from_env
from tpkv.errors import ConfigError
from tpkv.settings import check_host, read_env

DEFAULT_PORT = 8470  # TpkvConfig.dashboard_port's default


def port_taken(host: str, port: int) -> bool:
    """Whether something on this machine listens on (host, port) already: a bind as the
    dashboard's own (SO_REUSEADDR) fails with EADDRINUSE. ConfigError when `host` is not an
    address this machine can listen on."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"dashboard host {host!r} does not resolve: {exc}") from exc
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
                raise ConfigError(f"the dashboard cannot listen on {host}:{port}: {exc}; set "
                                  f"--dashboard-host or TPKV_DASHBOARD_HOST to an address of "
                                  f"this machine") from exc
    return False


def demo_settings(config: TpkvConfig, host: str | None = None, port: int | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[TpkvConfig, str | None]:
    """`config` with the environment (tpkv.settings) and the flags laid over it, and the notice
    to print (None: nothing to say). Raises ConfigError for a bad value or a port asked for
    that is taken."""
    cfg = from_env(config, env)
    source = None
    if read_env(env).dashboard_port is not None:
        source = "TPKV_DASHBOARD_PORT"
    if host is not None:
        cfg = dataclasses.replace(cfg, dashboard_host=check_host("--dashboard-host", host))
    if port is not None:
        check_int("--dashboard-port", port, 0, 65535)
        cfg, source = dataclasses.replace(cfg, dashboard_port=port), "--dashboard-port"
    p = cfg.dashboard_port
    if p == 0 or not port_taken(cfg.dashboard_host, p):
        return cfg, None
    if source is not None or p != DEFAULT_PORT:
        raise ConfigError(f"dashboard port {p} on {cfg.dashboard_host} (from "
                          f"{source or 'the config'}) is taken: another tpkv demo or program "
                          f"listens there; choose a "
                          f"free one with --dashboard-port or TPKV_DASHBOARD_PORT (0: any free "
                          f"port)")
    notice = (f"dashboard: port {p} on {cfg.dashboard_host} is taken (another tpkv demo?), so it "
              f"takes a free port; --dashboard-port or TPKV_DASHBOARD_PORT chooses one")
    return dataclasses.replace(cfg, dashboard_port=0), notice


def token_note(config: TpkvConfig) -> str:
    """What to print beside the URL when the dashboard needs a token (never the token)."""
    if config.dashboard_token is None:
        return ""
    return (" (its data needs the bearer token of TPKV_DASHBOARD_TOKEN: open the URL with "
            "#token=<token> at its end)")
