"""Logs people can act on: what the server reports, how much of it, in which format.

* :func:`report` turns a session's :class:`~rlmesh_trio._session.Report` into a log
  record: an env failure at ERROR on ``rlmesh_trio.env`` (lane, request kind, request id,
  the env's traceback), every one of them; a rejected or timed-out request at WARNING on
  ``rlmesh_trio.requests``, through a :class:`RateLimit` so that a client looping on a bad
  request cannot flood the log (what was held back is counted in the next line).
* :func:`configure` sets up the CLI's logging: our loggers at the chosen level, third
  party ones (hpack, h2, grpclib, asyncio) at WARNING unless ``--log-level debug`` asks
  for everything; text or one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._session import Report

__all__ = ["JsonFormatter", "RateLimit", "configure", "report"]

env_log = logging.getLogger("rlmesh_trio.env")
requests_log = logging.getLogger("rlmesh_trio.requests")

RATE_BURST = 10
"""Rejected-request warnings logged at most per :data:`RATE_WINDOW` seconds."""

RATE_WINDOW = 10.0

OUR_LOGGER = "rlmesh_trio"


class RateLimit:
    """At most ``burst`` events per ``window`` seconds; counts the ones held back."""

    def __init__(
        self,
        burst: int = RATE_BURST,
        window: float = RATE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.window = window
        self._clock = clock
        self._window_start = -float("inf")
        self._count = 0
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: hold this one back. Else how many were held back since the last one."""
        now = self._clock()
        if now - self._window_start >= self.window:
            self._window_start = now
            self._count = 0
        if self._count >= self.burst:
            self.suppressed += 1
            return None
        self._count += 1
        held, self.suppressed = self.suppressed, 0
        return held


def report(item: Report, limit: RateLimit) -> None:
    """Log one session report (see the module docstring)."""
    lanes = ",".join(str(lane) for lane in item.lanes) or "-"
    if item.kind in ("fault", "truncated"):
        error = item.error
        exc_info = None if error is None else (type(error), error, error.__traceback__)
        env_log.error(
            "lane %s: %s failed (request_id=%r): %s",
            lanes,
            item.verb,
            item.request_id,
            item.message,
            exc_info=exc_info,
            extra={"lane": lanes, "verb": item.verb, "request_id": item.request_id},
        )
        return
    held = limit.allow()
    if held is None:
        return
    suffix = f" ({held} similar warnings were held back)" if held else ""
    requests_log.warning(
        "%s request %r %s: %s %s%s",
        item.verb,
        item.request_id,
        "timed out" if item.kind == "timeout" else "rejected",
        item.code.name,
        item.message,
        suffix,
        extra={"lane": lanes, "verb": item.verb, "request_id": item.request_id},
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the context fields
    (``lane``, ``verb``, ``request_id``) and traceback when there are any."""

    _EXTRA = ("lane", "verb", "request_id")

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in self._EXTRA:
            if hasattr(record, name):
                data[name] = getattr(record, name)
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def configure(level: str, *, fmt: str = "text", everything: bool = False) -> None:
    """Logging for the CLI: ``rlmesh_trio.*`` at ``level``; other libraries at WARNING,
    or at ``level`` too when ``everything`` (``--log-level debug``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric if everything else max(numeric, logging.WARNING))
    logging.getLogger(OUR_LOGGER).setLevel(numeric)
