"""Calls cut off by their connection, logged as one rate-limited line (issue 43).

grpclib logs "Server error" or "Application error" with a traceback of four exceptions
for every handler a GOAWAY, a client's reset or a close cut off: hundreds a second under
a flood. :class:`QuietCallEnds`, a filter on grpclib's server logger, makes such records
one rate-limited INFO line; every other record passes as it is.
"""

from __future__ import annotations

import asyncio
import logging

import h2.exceptions
from grpclib.exceptions import StreamTerminatedError

from .._logging import RateLimit

__all__ = ["QuietCallEnds", "quiet_call_ends"]


_CALL_ENDS = RateLimit()
"""At most a few lines per window about calls cut off by their connection's end."""


def _connection_gone(exc: BaseException | None, depth: int = 0) -> bool:
    """``exc``, or what caused it, says the call's connection or stream is gone (a
    GOAWAY, a reset, a close): not the handler's fault."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, (StreamTerminatedError, h2.exceptions.StreamClosedError)):
        return True
    if isinstance(exc, (ConnectionError, asyncio.CancelledError)):
        return True
    if isinstance(exc, h2.exceptions.ProtocolError) and "CLOSED" in str(exc):
        return True  # h2: a frame sent on a closed connection or stream
    if isinstance(exc, BaseExceptionGroup):
        return all(_connection_gone(e, depth + 1) for e in exc.exceptions)
    return _connection_gone(exc.__cause__ or exc.__context__, depth + 1)


class QuietCallEnds(logging.Filter):
    """On grpclib's server logger: a call whose handler was cut off by its connection's
    end (a GOAWAY of a flood limit, a client's reset, a close) is logged by grpclib as
    "Server error" or "Application error" with a traceback of four exceptions, once per
    handler: hundreds a second under a flood. Such records become one rate-limited
    INFO line saying how many; every other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or not _connection_gone(record.exc_info[1]):
            return True
        held = _CALL_ENDS.allow()
        if held is None:
            return False
        record.msg = "a call ended with its connection (GOAWAY, reset or close)%s"
        record.args = (f"; {held} more not logged" if held else "",)
        record.exc_info = None
        record.exc_text = None
        record.levelno = logging.INFO
        record.levelname = logging.getLevelName(logging.INFO)
        return True


def quiet_call_ends() -> None:
    """Install :class:`QuietCallEnds` on grpclib's server logger (once)."""
    logger = logging.getLogger("grpclib.server")
    if not any(isinstance(f, QuietCallEnds) for f in logger.filters):
        logger.addFilter(QuietCallEnds())
