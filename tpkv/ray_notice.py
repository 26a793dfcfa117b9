"""Drops Ray's "token authentication is enabled" notice for the clusters tpkv starts or joins.

Ray (2.5x and later) turns token authentication on by itself for a new local cluster when
RAY_AUTH_MODE is unset, and for a driver joining one when a token file exists, and logs a
warning saying so on every command. tpkv keeps that default (authentication stays on: nothing
is disabled), so the notice tells a tpkv user nothing they can act on; only that one record is
dropped. Ray's warning that authentication is *disabled* (RAY_AUTH_MODE=disabled, or no token)
still shows.
"""

from __future__ import annotations

import logging

_LOGGER = "ray._private.authentication.authentication_token_setup"
_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOTICE)


def quiet_token_notice() -> None:
    """Before ray.init: drop the notice that Ray enabled token auth (idempotent)."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, _DropTokenNotice) for f in logger.filters):
        logger.addFilter(_DropTokenNotice())
