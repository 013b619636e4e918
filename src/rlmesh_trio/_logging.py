"""Logs people can act on: what the server reports, how much of it, in which format.

* :func:`report` turns a session's :class:`~rlmesh_trio._session.Report` into a log
  record: an env failure at ERROR on ``rlmesh_trio.env`` (lane, request kind, request id,
  the env's traceback), every one of them; a rejected or timed-out request, and a job a
  lane refused (dead, wedged: no env code ran), at WARNING on ``rlmesh_trio.requests``,
  through a :class:`RateLimit` so that a client looping on a bad request or a dead lane
  cannot flood the log (what was held back is counted in the next line).
* :func:`configure` sets up the CLI's logging: our loggers at the chosen level, third
  party ones (hpack, h2, grpclib, asyncio) at WARNING unless ``--log-level debug`` asks
  for everything; text or one JSON object per line. Its handler carries the credential
  filter (``_credentials.py``, re-exported here for the server's transport).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._credentials import CredentialFilter, protect_credentials

if TYPE_CHECKING:
    from ._session import Report

__all__ = [
    "CredentialFilter",
    "JsonFormatter",
    "RateLimit",
    "configure",
    "protect_credentials",
    "report",
]

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


_OUTCOME = {"timeout": "timed out", "refused": "refused by its lane"}


def lane_field(lanes: tuple[int, ...]) -> int | list[int] | None:
    """The ``lane`` of a log record: the lane's number, a list of them, or None (no lane,
    e.g. a request refused before it named one)."""
    if not lanes:
        return None
    return lanes[0] if len(lanes) == 1 else list(lanes)


def report(item: Report, limit: RateLimit) -> None:
    """Log one session report (see the module docstring)."""
    lanes = ",".join(str(lane) for lane in item.lanes) or "-"
    context = {"lane": lane_field(item.lanes), "verb": item.verb, "request_id": item.request_id}
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
            extra=context,
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
        _OUTCOME.get(item.kind, "rejected"),
        item.code.name,
        item.message,
        suffix,
        extra=context,
    )


def utc_timestamp(created: float) -> str:
    """RFC 3339 in UTC with milliseconds: ``2026-12-01T17:17:11.042Z``."""
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, milliseconds, ``Z``), ``level``,
    ``logger``, ``message``, and the context fields when a record has them: ``lane`` (a
    number, or a list of numbers for a request over several lanes), ``verb``,
    ``request_id``, and ``traceback``."""

    _EXTRA = ("lane", "verb", "request_id")

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in self._EXTRA:
            value = getattr(record, name, None)
            if value is not None:
                data[name] = value
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def configure(level: str, *, fmt: str = "text", everything: bool = False) -> None:
    """Logging for the CLI: ``rlmesh_trio.*`` at ``level``; other libraries at WARNING,
    or at ``level`` too when ``everything`` (``--log-level debug``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(protect_credentials())  # every record this handler writes
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
