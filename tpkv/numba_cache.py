"""Where numba keeps tpkv's compiled kernels, so that a second start compiles nothing.

numba looks, in order, at NUMBA_CACHE_DIR, `__pycache__` beside the kernel's source and the
user's cache directory (~/.cache/numba), and takes the first it can write; with none writable
(a read-only install, run by a user with no writable home), `njit(cache=True)` fails at import.
`ensure_cache_dir`, called by each kernel module before its kernels are defined, then points
numba at a directory of this user under the temp dir instead, with a warning.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from tpkv.errors import ConfigError

log = logging.getLogger(__name__)

FALLBACK_NAME = "tpkv-numba-cache"


def _probe() -> None:
    """Stands in for a kernel of another file when asking numba where it would cache it."""


def numba_finds_a_dir(source: str) -> bool:
    """Whether numba's own search finds a writable cache directory for kernels of `source`."""
    import types

    from numba.core.caching import FunctionCache

    probe = types.FunctionType(_probe.__code__.replace(co_filename=source), {})
    try:
        FunctionCache(probe)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return False
    return True


def ensure_cache_dir(source: str) -> str | None:
    """Make sure numba can cache the kernels of the module at `source`; returns the directory
    set in its place (None when numba found one itself). A ConfigError names what was tried
    when not even the fallback under the temp dir is writable."""
    if numba_finds_a_dir(source):
        return None
    from numba.core import config

    fallback = Path(tempfile.gettempdir()) / f"{FALLBACK_NAME}-{os.getuid()}"
    try:
        fallback.mkdir(mode=0o700, exist_ok=True)
        st = fallback.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:  # numba unpickles what it finds
            raise PermissionError(f"{fallback} is not this user's alone")
        tempfile.TemporaryFile(dir=fallback).close()
    except OSError as exc:
        raise ConfigError(
            f"numba has no writable directory for the kernels of {source} (tried "
            f"NUMBA_CACHE_DIR={getattr(config, 'CACHE_DIR', '') or '(unset)'}, "
            f"{Path(source).parent / '__pycache__'}, the user cache directory and {fallback}: "
            f"{exc}); set NUMBA_CACHE_DIR to a writable directory") from exc
    setattr(config, "CACHE_DIR", str(fallback))  # noqa: B010 (set at run time: mypy knows none)
    log.warning("numba cannot write its cache beside %s nor in the user cache directory; "
                "kernels are cached in %s (set NUMBA_CACHE_DIR to choose)", source, fallback)
    return str(fallback)
