"""``_errors.first_line``: the one way an error is told in one line (the CLI's hints, the
fleet's shard and retry records, the Ray fleet's log of a dead endpoint)."""

from __future__ import annotations

import pytest

from rlmesh_trio._errors import first_line


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("bad seed"), "ValueError: bad seed"),
        (RuntimeError("  first\nsecond\n"), "RuntimeError: first"),
        (KeyError(), "KeyError"),
        (OSError("   \n "), "OSError"),
        (BaseExceptionGroup("one", [TimeoutError("slow lane")]), "TimeoutError: slow lane"),
        (
            BaseExceptionGroup("two", [ValueError("a"), ValueError("b")]),
            "ExceptionGroup: two (2 sub-exceptions)",
        ),
    ],
)
def test_first_line(exc: BaseException, line: str) -> None:
    assert first_line(exc) == line


def test_the_cli_and_the_fleet_tell_errors_by_the_same_function() -> None:
    from rlmesh_trio._cli import _hints
    from rlmesh_trio.fleet import _scheduler, _shard

    assert _hints.first_line is first_line
    assert _scheduler.first_line is first_line
    assert _shard.first_line is first_line
