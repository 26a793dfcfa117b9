"""Every TPKV_* environment variable, read and typed here; a bad value is a ConfigError naming it.

`read_env()` returns the settings that are set (`config.from_env` lays them over a TpkvConfig);
every entry point (tpkv.init, `tpkv demo`, `tpkv demo-tiers`, `tpkv launch`, `tpkv status` /
`dashboard`) reads them through it, so they all see the same values and refuse the same ones.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from tpkv.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'8GiB', '512M', '4096' -> bytes (binary units either way)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 4096, 512MiB, 8GiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _UNITS[unit])


Env = Mapping[str, str]
T = TypeVar("T")

# name -> what it sets (what `tpkv --help` and the errors say)
VARIABLES = {
    "TPKV_SSD_DIR": "directory of the L3 tier (TpkvConfig.l3.root)",
    "TPKV_L2_BYTES": "L2 budget of the node, e.g. 64GiB (TpkvConfig.l2.budget_bytes)",
    "TPKV_DASHBOARD_HOST": "address the dashboard listens on (TpkvConfig.dashboard_host)",
    "TPKV_DASHBOARD_PORT": "port of the dashboard, 1-65535 or 0 for any free one "
                           "(TpkvConfig.dashboard_port)",
    "TPKV_DASHBOARD_TOKEN": "bearer token the dashboard's data needs (TpkvConfig.dashboard_token)",
    "TPKV_WAIT_TIMEOUT_S": "bound on every wait, in seconds (TpkvConfig.wait_timeout_s)",
    "TPKV_RAW_MEMCPY_BATCH": "1/0: batched copies through the raw cudaMemcpyBatchAsync entry",
    "TPKV_EXTERNAL_STORE": "1/0: the launcher hosts the rendezvous store (set by tpkv launch)",
}
# Set by a launcher for the ranks it starts, never passed on from the user's environment.
LAUNCHER_ONLY = ("TPKV_EXTERNAL_STORE",)
MAX_WAIT_S = 7 * 86400.0  # a week: beyond that a bound is no bound (and timedelta overflows)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_TOKEN = re.compile(r"^[\x21-\x7e]{1,4096}$")  # visible ASCII: it travels in an HTTP header
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bad(name: str, raw: object, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={raw!r} is not valid: {allowed}")


def parse_int(name: str, raw: str, lo: int, hi: int) -> int:
    """An integer in lo..hi, or a ConfigError naming `name`, the value and the range."""
    text = raw.strip()
    if not re.fullmatch(r"[+-]?\d{1,19}", text):
        raise _bad(name, raw, f"expected an integer in {lo}..{hi}")
    value = int(text)
    if not lo <= value <= hi:
        raise _bad(name, raw, f"expected an integer in {lo}..{hi}")
    return value


def parse_float(name: str, raw: str, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite number in lo..hi (lo excluded when lo_open)."""
    allowed = f"expected a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    try:
        value = float(raw.strip())
    except ValueError:
        raise _bad(name, raw, allowed) from None
    if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
        raise _bad(name, raw, allowed)
    return value


def parse_bool(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _bad(name, raw, "expected 1/0, true/false, yes/no or on/off")


def parse_port(name: str, raw: str) -> int:
    """1-65535, or 0 for any free port."""
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or not 0 <= int(text) <= 65535:
        raise _bad(name, raw, "expected a port number 1-65535, or 0 for any free port")
    return int(text)


def check_host(name: str, host: object) -> str:
    """An IPv4 or IPv6 address (brackets allowed), a wildcard (0.0.0.0, ::) or a host name:
    no scheme, port, path or spaces."""
    allowed = ("expected an IP address or a host name (e.g. 127.0.0.1, 0.0.0.0, ::1, "
               "node-3.cluster), without scheme or port")
    if not isinstance(host, str):
        raise _bad(name, host, allowed)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return host
    except ValueError:
        pass
    if bare is host and _HOSTNAME.match(host):
        return host
    raise _bad(name, host, allowed)


def parse_host(name: str, raw: str) -> str:
    """check_host of `raw` without the spaces around it (the error shows `raw` as it is)."""
    try:
        return check_host(name, raw.strip())
    except ConfigError:
        check_host(name, raw)  # raises, showing raw
        raise


def check_token(name: str, token: object) -> str:
    """Visible ASCII, 1 to 4096 characters (no spaces: it is sent as `Bearer <token>`)."""
    if isinstance(token, str) and _TOKEN.match(token):
        return token
    if not isinstance(token, str):
        shown = f"a {type(token).__name__}"
    elif not token:
        shown = "empty"
    else:  # the value itself is a secret: say what is wrong with it, not what it is
        odd = sorted({c for c in token if not "\x21" <= c <= "\x7e"})
        shown = f"{len(token)} characters" + (f", with {''.join(odd)!r} among them" if odd else "")
    raise ConfigError(f"{name} ({shown}) is not valid: expected 1 to 4096 visible ASCII "
                      f"characters, no spaces (unset it for no token)")


def parse_bytes_env(name: str, raw: str) -> int:

    allowed = "expected a positive size in bytes, e.g. 4096, 512MiB or 64GiB"
    try:
        value = parse_bytes(raw)
    except ConfigError:
        raise _bad(name, raw, allowed) from None
    if value <= 0:
        raise _bad(name, raw, allowed)
    return value


def parse_dir(name: str, raw: str) -> str:
    if not raw.strip() or "\0" in raw:
        raise _bad(name, raw, "expected a directory path")
    return raw


@dataclass(frozen=True)
class EnvSettings:
    """The TPKV_* variables that are set, typed; None where a variable is not set."""

    ssd_dir: str | None = None
    l2_bytes: int | None = None
    dashboard_host: str | None = None
    dashboard_port: int | None = None
    dashboard_token: str | None = None
    wait_timeout_s: float | None = None
    raw_memcpy_batch: bool | None = None
    external_store: bool | None = None
    ray_address: str | None = None  # RAY_ADDRESS, Ray's own variable


def read_env(env: Env | None = None) -> EnvSettings:
    """Read and check every TPKV_* variable of `env` (default: os.environ)."""
    e = os.environ if env is None else env

    def opt(name: str, parse: Callable[[str, str], T]) -> T | None:
        raw = e.get(name)
        return None if raw is None else parse(name, raw)

    return EnvSettings(
        ssd_dir=opt("TPKV_SSD_DIR", parse_dir),
        l2_bytes=opt("TPKV_L2_BYTES", parse_bytes_env),
        dashboard_host=opt("TPKV_DASHBOARD_HOST", parse_host),
        dashboard_port=opt("TPKV_DASHBOARD_PORT", parse_port),
        dashboard_token=opt("TPKV_DASHBOARD_TOKEN", check_token),
        wait_timeout_s=opt("TPKV_WAIT_TIMEOUT_S",
                           lambda n, r: parse_float(n, r, 0.0, MAX_WAIT_S, lo_open=True)),
        raw_memcpy_batch=opt("TPKV_RAW_MEMCPY_BATCH", parse_bool),
        external_store=opt("TPKV_EXTERNAL_STORE", parse_bool),
        ray_address=e.get("RAY_ADDRESS") or None)


def env_flag(name: str, default: bool, env: Env | None = None) -> bool:
    """One boolean TPKV_* variable (checked like read_env checks it)."""
    raw = (os.environ if env is None else env).get(name)
    return default if raw is None else parse_bool(name, raw)


def tpkv_env(env: Env | None = None) -> dict[str, str]:
    """The TPKV_* variables of `env` that tpkv reads, after checking them all (launchers pass
    these on to ranks that may run on other machines)."""
    e = os.environ if env is None else env
    read_env(e)
    return {k: e[k] for k in VARIABLES if k in e and k not in LAUNCHER_ONLY}
