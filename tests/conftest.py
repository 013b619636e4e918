"""Shared fixtures: the no-leaked-thread check, the pool of server subprocesses, and
the options of a server built in-process on each transport loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from support.refserver import ServerPool

from rlmesh_trio import ServeOptions

THREAD_JOIN_SECONDS = 5.0
"""How long threads that a test started may take to finish after it returned."""


def _idle_trio_workers() -> set[threading.Thread]:
    """Trio's cached worker threads that are idle (waiting for their next job).

    They belong to the process-wide thread cache and linger for ~10 s by design;
    a worker still running a job (a lane that was never stopped) is *not* idle.
    """
    try:
        from trio._core._thread_cache import THREAD_CACHE

        return {worker._thread for worker in list(THREAD_CACHE._idle_workers)}
    except (ImportError, AttributeError):  # pragma: no cover - trio's internals moved
        # Fallback: every thread of trio's cache (named "Trio thread N"); a lane's
        # thread is never one of them (rlmesh-trio names its own).
        return {t for t in threading.enumerate() if t.name.startswith("Trio thread")}


def leaked_threads(before: set[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Threads not in ``before`` still alive after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        idle = _idle_trio_workers()
        suspects = [
            t
            for t in threading.enumerate()
            if t not in before and t not in idle and t is not threading.current_thread()
        ]
        remaining = deadline - time.monotonic()
        if not suspects or remaining <= 0:
            return suspects
        suspects[0].join(min(0.05, remaining))


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """Fail a test that leaves a thread running (idle Trio cache workers aside)."""
    before = set(threading.enumerate())
    yield
    leaked = leaked_threads(before, THREAD_JOIN_SECONDS)
    assert not leaked, f"threads leaked by this test: {[t.name for t in leaked]}"


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPool]:
    """Server subprocesses shared by one test module, all stopped at its end."""
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(params=["asyncio", "uvloop"])
def serve_options(request: pytest.FixtureRequest) -> ServeOptions:
    """The options a test starts from (``dataclasses.replace`` adds its own): a test that
    takes them runs once on asyncio's selector loop and once on uvloop (when installed)."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    return ServeOptions(event_loop=request.param)
