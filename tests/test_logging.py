"""What the server logs (``rlmesh_trio._logging``): env failures with their tracebacks,
rejected requests rate-limited, the JSON format, and which loggers the CLI turns on."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterator

import pytest

from rlmesh_trio._logging import JsonFormatter, RateLimit, configure, report
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._session import Report

pytestmark = pytest.mark.timeout(30)

Code = env_v1.EnvErrorCode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_rate_limit_holds_back_past_the_burst_and_counts() -> None:
    clock = Clock()
    limit = RateLimit(burst=3, window=10.0, clock=clock)
    assert [limit.allow() for _ in range(5)] == [0, 0, 0, None, None]
    clock.now = 9.9
    assert limit.allow() is None
    clock.now = 10.0  # a new window: the next one says how many were held back
    assert limit.allow() == 3
    assert limit.allow() == 0


def test_an_env_failure_is_logged_at_error_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = raised(RuntimeError("boom in step"))
    item = Report(
        "fault", "step", "r-7", (2,), Code.INTERNAL, "step failed: RuntimeError: boom", error
    )
    with caplog.at_level(logging.DEBUG, logger="rlmesh_trio"):
        report(item, RateLimit())
    [record] = caplog.records
    assert record.name == "rlmesh_trio.env"
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert "lane 2" in message and "step failed" in message and "'r-7'" in message
    assert record.exc_info is not None and record.exc_info[1] is error
    assert "boom in step" in caplog.text and "Traceback" in caplog.text


def test_rejected_requests_warn_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limit = RateLimit(burst=2, window=10.0, clock=clock)
    item = Report("rejected", "step", "x", (), Code.INVALID_ACTION, "$: value 5 not in range")
    with caplog.at_level(logging.DEBUG, logger="rlmesh_trio"):
        for _ in range(50):  # a client looping on a bad action
            report(item, limit)
        clock.now = 10.0
        report(item, limit)
    records = [r for r in caplog.records if r.name == "rlmesh_trio.requests"]
    assert len(records) == 3
    assert all(r.levelno == logging.WARNING for r in records)
    assert "INVALID_ACTION" in records[0].getMessage()
    assert "48 similar warnings were held back" in records[2].getMessage()


def test_timeouts_are_warnings_too(caplog: pytest.LogCaptureFixture) -> None:
    item = Report("timeout", "reset", "t", (0,), Code.TIMEOUT, "env.reset timed out after 5ms")
    with caplog.at_level(logging.DEBUG, logger="rlmesh_trio"):
        report(item, RateLimit())
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "timed out" in record.getMessage()


def test_json_lines_carry_the_context_and_the_traceback() -> None:
    error = raised(ValueError("bad"))
    record = logging.LogRecord(
        "rlmesh_trio.env", logging.ERROR, __file__, 1, "lane %s failed", ("3",), None
    )
    record.exc_info = (type(error), error, error.__traceback__)
    record.lane = 3
    record.request_id = "abc"
    data = json.loads(JsonFormatter().format(record))
    assert data["level"] == "ERROR"
    assert data["logger"] == "rlmesh_trio.env"
    assert data["message"] == "lane 3 failed"
    assert data["lane"] == 3 and data["request_id"] == "abc"
    assert "ValueError: bad" in data["traceback"]


def test_json_time_is_utc_with_milliseconds_and_a_zone() -> None:
    record = logging.LogRecord("rlmesh_trio.serve", logging.INFO, __file__, 1, "hi", (), None)
    record.created = 1796145431.0429  # 2026-12-01T17:17:11.042 UTC
    data = json.loads(JsonFormatter().format(record))
    assert data["time"] == "2026-12-01T17:17:11.042Z"
    parsed = datetime.datetime.fromisoformat(data["time"].replace("Z", "+00:00"))
    assert parsed.utcoffset() == datetime.timedelta(0)


@pytest.mark.parametrize(("lanes", "expected"), [((2,), 2), ((0, 2), [0, 2]), ((), None)])
def test_json_lane_is_a_number_or_a_list_of_numbers(
    lanes: tuple[int, ...], expected: int | list[int] | None, caplog: pytest.LogCaptureFixture
) -> None:
    item = Report(
        "rejected", "step", "r-1", lanes, env_v1.EnvErrorCode.INVALID_ACTION, "bad action"
    )
    with caplog.at_level(logging.WARNING, logger="rlmesh_trio"):
        report(item, RateLimit())
    [record] = caplog.records
    data = json.loads(JsonFormatter().format(record))
    assert data.get("lane") == expected
    assert data["verb"] == "step" and data["request_id"] == "r-1"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    ours = logging.getLogger("rlmesh_trio")
    saved = (list(root.handlers), root.level, ours.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.setLevel(saved[2])


@pytest.mark.usefixtures("restore_logging")
def test_verbose_turns_on_our_loggers_not_hpack() -> None:
    configure("debug", everything=False)
    assert logging.getLogger("rlmesh_trio.transport").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("hpack.hpack").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("h2.connection").isEnabledFor(logging.INFO)
    configure("debug", everything=True)  # --log-level debug: everything
    assert logging.getLogger("hpack.hpack").isEnabledFor(logging.DEBUG)
    configure("warning")
    assert not logging.getLogger("rlmesh_trio.serve").isEnabledFor(logging.INFO)
    assert logging.getLogger("rlmesh_trio.env").isEnabledFor(logging.ERROR)
