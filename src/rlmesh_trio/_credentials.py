"""Credentials kept out of logs, and where a token may come from.

A leaf: the server (``_transport``, the CLI's logging) and the client (a token's
metadata) both install :func:`protect_credentials`, so it stands on nothing of the
package. hpack's DEBUG lines print every header it encodes or decodes, ``authorization``
included; the :class:`CredentialFilter` on the HTTP/2 stack's loggers redacts them.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = [
    "AUTH_TOKEN_ENV",
    "HEADER_LOGGERS",
    "REDACTED",
    "CredentialFilter",
    "protect_credentials",
]

AUTH_TOKEN_ENV = "RLMESH_TRIO_AUTH_TOKEN"
"""The environment variable an auth token may come from (so it is not on a command line):
the server's ``ServeOptions``, the CLI's ``serve``, ``probe`` and ``fleet``, and the Ray
fleet's endpoint actors read it."""

REDACTED = "<redacted>"

HEADER_LOGGERS = ("hpack", "hpack.hpack", "hpack.table", "h2", "grpclib")
"""Loggers of the HTTP/2 stack that can print a header (hpack's DEBUG lines print every
header it encodes or decodes, ``authorization`` included)."""

_BEARER = re.compile(r"(?i)(bearer\s+)[^\s'\",)\]}]+")
_AUTHORIZATION = re.compile(r"(?i)(authorization['\"]?\s*[,:=]\s*b?['\"]?)[^'\"]*")
_BLOCK_DUMPS = ("Decoding ", "Encoded header block to ")
"""hpack's dumps of a whole header block: HPACK bytes, Huffman-coded or not, that a
reader could decode back to the token. Replaced by their size."""


class CredentialFilter(logging.Filter):
    """Redacts credentials from a record before any handler sees it: the value of an
    ``authorization`` field, a ``Bearer`` token, any token a server registered
    (:meth:`add_secret`), and hpack's raw header-block dumps. Costs nothing for records
    below the logger's level (a filter runs only on records that are emitted)."""

    def __init__(self) -> None:
        super().__init__("")
        self._secrets: set[str] = set()
        self._lock = threading.Lock()

    def add_secret(self, secret: str) -> None:
        with self._lock:
            self._secrets.add(secret)

    def discard_secret(self, secret: str) -> None:
        with self._lock:
            self._secrets.discard(secret)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True  # a broken record is logging's to report, not ours
        if record.name.startswith("hpack") and message.startswith(_BLOCK_DUMPS):
            head = message.split(" ", 1)[0] if message.startswith("Decoding") else message[:23]
            message = f"{head} <a header block, not shown>"
        else:
            redacted = _AUTHORIZATION.sub(rf"\1{REDACTED}", _BEARER.sub(rf"\1{REDACTED}", message))
            for secret in tuple(self._secrets):
                redacted = redacted.replace(secret, REDACTED)
            if redacted == message:
                return True
            message = redacted
        record.msg = message
        record.args = None
        return True


_credentials = CredentialFilter()


def protect_credentials(secret: str | None = None) -> CredentialFilter:
    """Install the credential filter on the HTTP/2 stack's loggers (once) and register
    ``secret``; returns the filter (a handler of one's own can carry it too)."""
    if secret is not None:
        _credentials.add_secret(secret)
    for name in HEADER_LOGGERS:
        logger = logging.getLogger(name)
        if _credentials not in logger.filters:
            logger.addFilter(_credentials)
    return _credentials
