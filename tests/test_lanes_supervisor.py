"""Lane supervision (docs/supervision.md): fault policies, rebuilds, the watchdog.

Server-level tests drive an in-process ``serve_env`` over the wire (our h2 client, and
rlmesh 0.1.0's ``rlmesh.run``) with :mod:`support.faulty`, whose action picks a fault;
engine-level tests drive :class:`LaneEngine` directly for what the wire cannot show
(backoff, counters, retired threads). Every test checks that no env was ever touched off
the thread that built it, and the autouse fixture that no thread is left behind.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import outcome
import pytest
import trio
from support import wire
from support.faulty import HANG, RAISE, Controller, Factory
from support.lanes import engine as lane_engine

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._errors import LaneBrokenError, LaneDeadError, LaneTimeoutError
from rlmesh_trio._jobs import CallJob, LaneReply, ResetJob, StepJob
from rlmesh_trio._lanes import LANE_THREAD_PREFIX, LaneEngine
from rlmesh_trio._lanes._supervisor import FREE_REBUILDS, MAX_LEFT_BEHIND
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._wire import HEALTH_CHECK_PATH

pytestmark = pytest.mark.timeout(60)

Code = env_v1.EnvErrorCode
MODES = ("error", "rebuild", "truncate")
SUPERVISED = ("rebuild", "truncate")
BOUND = 10.0
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"


# ------------------------------------------------------------------------------ helpers


@asynccontextmanager
async def served(ctl: Controller, num_envs: int = 2, **options: Any) -> AsyncIterator[str]:
    """``serve_env`` over ``Factory(ctl)``; at exit hanging env calls are released."""
    try:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(
                functools.partial(
                    serve_env,
                    Factory(ctl),
                    num_envs=num_envs,
                    options=ServeOptions(**{"close_timeout_seconds": 2.0, **options}),
                )
            )
            try:
                yield info.address
            finally:
                ctl.release.set()
                nursery.cancel_scope.cancel()
    finally:
        ctl.release.set()
    assert ctl.violations == [], ctl.violations


async def on_wire(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an asyncio client coroutine (support.wire) on a worker thread."""
    return await trio.to_thread.run_sync(asyncio.run, coro)


def acts(*actions: int) -> list[bytes]:
    return [wire.i64(actions)]


def obs(reply: env_v1.JoinResponse) -> np.ndarray:
    body = reply.step if reply.step is not None else reply.reset
    assert body is not None and body.observation is not None, reply
    return np.frombuffer(body.observation.leaves[0], np.float32)


def error(reply: env_v1.JoinResponse | None) -> tuple[Code, str, bool]:
    assert reply is not None and reply.error is not None, reply
    return reply.error.code, reply.error.message, reply.error.is_recoverable


def lane_fault(final_info: Any) -> Any:
    return wire.from_meta_map(final_info).get("rlmesh_trio.lane_fault")


def threads_named(suffix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(suffix)]


async def wait_for(predicate: Callable[[], bool], seconds: float = BOUND) -> None:
    """Poll a condition the code under test offers no event for (a thread's exit, a
    supervisor's state change on another thread)."""
    with trio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - no event exists for these
            await trio.sleep(0.01)


# ------------------------------------------------------------------------ step raises


@pytest.mark.parametrize("mode", MODES)
async def test_a_whole_vector_step_that_raises(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            await j.call(wire.step(acts(0, 0)))
            out["fault"] = await j.call(wire.step(acts(0, RAISE)))
            if mode == "truncate":
                out["reset"] = await j.call(wire.reset(seeds=[5], env_indices=[1]))
                out["after"] = await j.call(wire.step(acts(0, 0)))
                out["close"] = await j.call(wire.close())
            elif mode == "rebuild":
                # The session goes on: the lane's reset works, then the whole vector steps.
                out["reset"] = await j.call(wire.reset(seeds=[5], env_indices=[1]))
                out["after"] = await j.call(wire.step(acts(0, 0)))
                out["close"] = await j.call(wire.close())
            else:
                out["end"] = await j.wait_end(BOUND)
        async with wire.WireClient(address) as c, c.join() as j:
            out["next"] = await j.call(wire.reset(seeds=[3, 4]))
            out["next_step"] = await j.call(wire.step(acts(1, 1)))
        return out

    async with served(ctl, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    first, second = ctl.built[0], ctl.built[1]
    if mode == "rebuild":
        # CRASHED, recoverable: the stream goes on. Lane 0 stepped (its result is dropped
        # with the request); debug_info names the faulted lane for a client.
        assert error(out["fault"]) == (
            Code.CRASHED,
            "step failed: RuntimeError: boom on step 1 (lane 1 faulted and was rebuilt: "
            "reset it to go on; the other lanes of this request stepped, their results "
            "are dropped)",
            True,
        )
        fault = {"error": "RuntimeError: boom on step 1", "lane": 1, "rebuilt": True}
        assert json.loads(out["fault"].error.debug_info) == {"rlmesh_trio.lane_fault": [fault]}
        assert obs(out["reset"]).tolist() == [0.0, 5.0]
        # Lane 0 is at t=3 (two steps before, one dropped with the faulted request).
        assert obs(out["after"]).tolist() == [3.0, 1.0, 1.0, 5.0]
        (interrupted,) = out["after"].step.completed_episodes
        assert (interrupted.env_index, interrupted.seed, interrupted.truncated) == (1, 2, True)
        final = out["close"].close.final_episodes
        assert sorted((e.env_index, e.seed, e.step_count) for e in final) == [(0, 1, 3), (1, 5, 1)]
    elif mode == "error":
        # The reference's reply: fatal, and the whole-vector stream ends.
        assert error(out["fault"]) == (
            Code.INTERNAL,
            "step failed: RuntimeError: boom on step 1",
            False,
        )
        assert out["end"].status == 0
    if mode == "error":
        assert len(ctl.built) == 2  # nothing rebuilt: lane 1 is the env the exception left
        assert obs(out["next_step"]).tolist() == [1.0, 3.0, 1.0, 4.0]
        return
    assert len(ctl.built) == 3
    rebuilt = ctl.built[2]
    # A fresh OS thread built the new env; the faulted one was closed on its own thread.
    assert rebuilt.thread_object not in (first.thread_object, second.thread_object)
    assert second in ctl.closed
    assert obs(out["next_step"]).tolist() == [1.0, 3.0, 1.0, 4.0]
    if mode == "truncate":
        step = out["fault"].step
        assert step is not None
        assert list(step.rewards) == [1.0, 0.0]
        assert step.terminated_mask == b"\x00\x00" and step.truncated_mask == b"\x00\x01"
        # lane 1 answers with its last observation ([t=1, seed 2]).
        assert obs(out["fault"]).tolist() == [2.0, 1.0, 1.0, 2.0]
        (episode,) = step.completed_episodes
        assert (episode.env_index, episode.seed, episode.truncated) == (1, 2, True)
        assert episode.step_count == 2 and episode.cumulative_reward == 1.0
        fault = {"error": "RuntimeError: boom on step 1", "lane": 1, "rebuilt": True}
        assert lane_fault(episode.final_info) == fault
        infos = wire.from_meta_map(step.infos)
        assert infos["_final_info"] == [False, True]
        assert infos["final_info"][1] == {"rlmesh_trio.lane_fault": fault}
        assert obs(out["reset"]).tolist() == [0.0, 5.0]
        after = out["after"].step
        assert after is not None and after.truncated_mask == b"\x00\x00"
        assert obs(out["after"]).tolist() == [3.0, 1.0, 1.0, 5.0]
        final = out["close"].close.final_episodes
        assert sorted((e.env_index, e.seed, e.step_count) for e in final) == [(0, 1, 3), (1, 5, 1)]


@pytest.mark.parametrize("mode", MODES)
async def test_a_lane_scoped_step_that_raises_keeps_the_stream(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["fault"] = await j.call(wire.step(acts(RAISE), env_indices=[1]))
            out["other"] = await j.call(wire.step(acts(0), env_indices=[0]))
            out["unreset"] = await j.call(wire.step(acts(0), env_indices=[1]))
            out["reset"] = await j.call(wire.reset(seeds=[7], env_indices=[1]))
            out["again"] = await j.call(wire.step(acts(0), env_indices=[1]))
            out["close"] = await j.call(wire.close())
        return out

    async with served(ctl, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    other = out["other"].step
    assert other is not None
    if mode == "truncate":
        fault = out["fault"].step
        assert fault is not None and fault.truncated_mask == b"\x01"
        assert obs(out["fault"]).tolist() == [0.0, 2.0]
        (episode,) = fault.completed_episodes
        assert episode.env_index == 1 and episode.truncated
        # Not reset since the rebuild: answered as a truncation again, no env call.
        unreset = out["unreset"].step
        assert unreset is not None and unreset.truncated_mask == b"\x01"
        assert not unreset.completed_episodes  # the lane has no episode to end
    elif mode == "error":
        assert error(out["fault"]) == (
            Code.INTERNAL,
            "step failed: RuntimeError: boom on step 0",
            False,
        )
    if mode == "rebuild":
        assert error(out["fault"]) == (
            Code.CRASHED,
            "step failed: RuntimeError: boom on step 0 (lane 1 faulted and was rebuilt: "
            "reset it to go on)",
            True,
        )
        # The lost episode is reported as interrupted, in the next step reply (SPEC §7.7).
        (episode,) = other.completed_episodes
        assert (episode.env_index, episode.seed, episode.truncated) == (1, 2, True)
        assert error(out["unreset"]) == (
            Code.NOT_READY,
            "step failed: lane 1 was rebuilt after a fault (RuntimeError: boom on step 0); "
            "reset it before stepping",
            True,
        )
    if mode == "error":
        assert not other.completed_episodes
        assert obs(out["unreset"]).tolist() == [1.0, 2.0]  # the same env goes on
        assert len(ctl.built) == 2
    else:
        assert len(ctl.built) == 3
    assert obs(out["again"]).tolist() == [1.0, 7.0]


# ----------------------------------------------------------------------- reset raises


@pytest.mark.parametrize("mode", MODES)
async def test_a_reset_that_raises(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["fault"] = await j.call(wire.reset(env_indices=[1], options={"raise": 1}))
            out["ok"] = await j.call(wire.reset(seeds=[3], env_indices=[1]))
        return out

    async with served(ctl, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    if mode == "error":
        assert error(out["fault"]) == (
            Code.INTERNAL,
            "reset failed: ValueError: reset refused",
            False,
        )
    else:  # truncate: the retried reset failed too, and is answered as under rebuild
        assert error(out["fault"]) == (
            Code.CRASHED,
            "reset failed: ValueError: reset refused (lane 1 faulted and was rebuilt: "
            "reset it to go on)",
            True,
        )
    assert obs(out["ok"]).tolist() == [0.0, 3.0]
    # error: no rebuild; rebuild: one; truncate: one, the retried reset failed again: two.
    assert len(ctl.built) == {"error": 2, "rebuild": 3, "truncate": 4}[mode]


async def test_truncate_retries_a_failed_reset_once_on_the_rebuilt_env() -> None:
    ctl = Controller()

    async def client(address: str) -> env_v1.JoinResponse:
        async with wire.WireClient(address) as c, c.join() as j:
            return await j.call(wire.reset(seeds=[4, 5], options={"raise_once": "x"}))

    async with served(ctl, on_lane_fault="truncate") as address:
        reply = await on_wire(client(address))
    # One lane raised (the first to get there); it was rebuilt and the reset retried there.
    assert reply.reset is not None, reply
    assert obs(reply).tolist() == [0.0, 4.0, 0.0, 5.0]
    assert len(ctl.built) == 3


# ---------------------------------------------------------------------- render raises


@pytest.mark.parametrize("mode", MODES)
async def test_a_render_that_raises(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1])) as j:
            ctl.render_raises = True
            out["fault"] = await j.call(wire.render())
            if mode == "error":
                out["end"] = await j.wait_end(BOUND)
            else:  # recoverable: the same session resets the rebuilt lane and renders
                ctl.render_raises = False
                await j.call(wire.reset(seeds=[1]))
                out["same"] = await j.call(wire.render())
        ctl.render_raises = False
        async with wire.joined(address, wire.reset(seeds=[1])) as j:
            out["render"] = await j.call(wire.render())
        return out

    async with served(ctl, num_envs=1, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    if mode == "error":
        assert error(out["fault"]) == (Code.INTERNAL, "render failed: OSError: no display", False)
    else:
        assert error(out["fault"]) == (
            Code.CRASHED,
            "render failed: OSError: no display (lane 0 faulted and was rebuilt: reset "
            "it to go on)",
            True,
        )
        assert out["same"].render is not None and out["same"].render.frame
    assert out["render"].render is not None and out["render"].render.frame
    assert len(ctl.built) == (1 if mode == "error" else 2)


# ------------------------------------------------------------------- step hangs


@pytest.mark.parametrize("mode", MODES)
async def test_a_step_that_hangs_past_its_deadline(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["hang"] = await j.call(wire.step(acts(0, HANG), timeout_ms=300))
            if mode != "error":
                t0 = time.monotonic()
                out["next"] = await j.call(wire.reset(seeds=[3, 4], timeout_ms=5000))
                out["next_s"] = time.monotonic() - t0
        if mode == "error":
            # A later session is not stuck behind the wedged lane: refused at once.
            async with wire.WireClient(address) as c, c.join() as j:
                t0 = time.monotonic()
                out["busy"] = await j.call(wire.reset(seeds=[3, 4], timeout_ms=5000))
                out["busy_s"] = time.monotonic() - t0
                ctl.release.set()
                # The lane serves again once the released call has returned.
                deadline = time.monotonic() + BOUND
                while True:
                    out["next"] = await j.call(wire.reset(seeds=[3, 4], timeout_ms=5000))
                    if out["next"].reset is not None or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
        return out

    async with served(ctl, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
        if mode != "error":
            assert [t.name for t in threads_named("-abandoned")] == [
                f"{LANE_THREAD_PREFIX}1-abandoned"
            ]
    if mode == "truncate":
        step = out["hang"].step
        assert step is not None and step.truncated_mask == b"\x00\x01"
        (episode,) = step.completed_episodes
        assert lane_fault(episode.final_info) == {
            "error": "TimeoutError: env.step timed out after 300ms",
            "lane": 1,
            "rebuilt": True,
        }
    else:  # the request's own deadline answers first (the lane is rebuilt after it)
        assert error(out["hang"]) == (Code.TIMEOUT, "env.step timed out after 300ms", True)
    if mode == "error":
        code, message, recoverable = error(out["busy"])
        assert (code, recoverable) == (Code.BUSY, True)
        assert message.startswith("lane 1 is wedged: its env.step overran a deadline"), message
        assert out["busy_s"] < 4.0  # well within its 5 s deadline
        assert len(ctl.built) == 2
    else:
        assert out["next_s"] < 4.0
        assert len(ctl.built) == 3
    assert obs(out["next"]).tolist() == [0.0, 3.0, 0.0, 4.0]
    await wait_for(lambda: not threads_named("-abandoned"))


@pytest.mark.parametrize("mode", MODES)
async def test_the_watchdog_answers_a_hanging_step(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["hang"] = await j.call(wire.step(acts(0, HANG)))  # no deadline of its own
            out["next"] = await j.call(wire.step(acts(0, 0)))
            ctl.release.set()
        return out

    async with served(ctl, on_lane_fault=mode, lane_timeout_seconds=0.3) as address:
        out = await on_wire(client(address))
    if mode == "truncate":
        step = out["hang"].step
        assert step is not None and step.truncated_mask == b"\x00\x01"
        next_step = out["next"].step
        assert next_step is not None
    elif mode == "error":
        assert error(out["hang"]) == (Code.TIMEOUT, "env.step timed out after 300ms", True)
    else:  # the wedged env was abandoned and the lane rebuilt: CRASHED, recoverable
        assert error(out["hang"]) == (
            Code.CRASHED,
            "env.step timed out after 300ms (lane 1 faulted and was rebuilt: reset it to "
            "go on; the other lanes of this request stepped, their results are dropped)",
            True,
        )
    if mode == "error":
        code, message, _ = error(out["next"])
        assert code == Code.BUSY and message.startswith("lane 1 is wedged"), message
    elif mode == "rebuild":
        assert error(out["next"])[0] == Code.NOT_READY  # lane 1 is fresh: reset first
    await wait_for(lambda: not threads_named("-abandoned"))


async def test_a_call_wedged_by_its_deadline_and_then_by_the_watchdog_stops_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Policy ``error``: a request's deadline declares the hanging call wedged first,
    then the lane's own watchdog does. The second declaration took the lane from WEDGED
    to WEDGED, an illegal move whose error ended ``serve_env`` itself. Now the watchdog
    takes the jobs without a state change: the other lane and the server serve on, and
    the wedged lane serves again once its call returns."""
    ctl = Controller()
    caplog.set_level(logging.WARNING, logger="rlmesh_trio.lanes")

    def declared() -> int:
        return sum("has run for" in r.getMessage() for r in caplog.records)

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["hang"] = await j.call(wire.step(acts(HANG), env_indices=[1], timeout_ms=100))
            async with asyncio.timeout(BOUND):
                while declared() < 2:  # noqa: ASYNC110 - a log record has no event
                    await asyncio.sleep(0.01)
            out["other"] = await j.call(wire.step(acts(0), env_indices=[0]))
            out["wedged"] = await j.call(wire.step(acts(0), env_indices=[1]))
            ctl.release.set()
            async with asyncio.timeout(BOUND):
                while True:  # the late return puts the lane back in service
                    again = await j.call(wire.step(acts(0), env_indices=[1]))
                    if again.step is not None:
                        break
                    await asyncio.sleep(0.01)
            out["again"] = again
        return out

    async with served(ctl, on_lane_fault="error", lane_timeout_seconds=0.3) as address:
        out = await on_wire(client(address))
    assert error(out["hang"]) == (Code.TIMEOUT, "env.step timed out after 100ms", True)
    assert out["other"].step is not None, out["other"]
    code, message, _ = error(out["wedged"])
    assert code == Code.BUSY and message.startswith("lane 1 is wedged"), message
    assert out["again"].step is not None
    assert not [r for r in caplog.records if "no transition" in r.getMessage()]


@pytest.mark.parametrize("mode", MODES)
async def test_the_wedge_warning_shows_where_the_env_is_stuck(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19, finding 8: the watchdog named the lane and the call, not the env's code
    that is stuck. Now the warning carries the lane thread's current Python stack."""
    ctl = Controller()
    caplog.set_level(logging.WARNING, logger="rlmesh_trio.lanes")

    async def client(address: str) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            await j.call(wire.step(acts(0, HANG)))
            ctl.release.set()

    async with served(ctl, on_lane_fault=mode, lane_timeout_seconds=0.3) as address:
        await on_wire(client(address))
    (record,) = [r for r in caplog.records if "has run for" in r.getMessage()]
    text = record.getMessage()
    assert "stuck in:" in text, text
    # The env's own frames (FaultyEnv.step, then its _hang, waiting on an Event).
    stack = text.split("stuck in:\n", 1)[1]
    assert "in step" in stack and "in _hang" in stack and 'faulty.py", line' in stack, text
    assert stack.index("in step") < stack.index("in _hang"), text
    await wait_for(lambda: not threads_named("-abandoned"))


async def test_a_close_waits_for_a_hanging_lane_at_most_close_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            await j.send(wire.step(acts(HANG), env_indices=[1]))  # lane-scoped: no barrier
            await asyncio.to_thread(ctl.wait_hanging)
            t0 = time.monotonic()
            out["close"] = await j.call(wire.close())
            out["close_s"] = time.monotonic() - t0
            out["end"] = await j.wait_end(BOUND)
        return out

    caplog.set_level(logging.WARNING)
    async with served(ctl, close_timeout_seconds=0.5) as address:
        out = await on_wire(client(address))
    assert out["close"].close is not None
    assert 0.4 <= out["close_s"] < 4.0
    assert any(
        "close waited 0.5 s for env calls still running on lanes 1" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


# --------------------------------------------------------------- close and factory


@pytest.mark.parametrize("mode", SUPERVISED)
async def test_a_faulted_env_whose_close_hangs_does_not_hold_the_rebuild(mode: str) -> None:
    ctl = Controller()
    ctl.close_hangs = True

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["fault"] = await j.call(wire.step(acts(RAISE), env_indices=[1]))
            out["reset"] = await j.call(wire.reset(seeds=[3], env_indices=[1]))
            out["step"] = await j.call(wire.step(acts(0), env_indices=[1]))
            out["health"] = (await j.client.unary(HEALTH_CHECK_PATH, b"")).reply
            await asyncio.to_thread(ctl.wait_hanging)
            # The retired thread does not finish closing within close_timeout: it is
            # counted abandoned, and with max_abandoned_lanes=0 health says so.
            deadline = time.monotonic() + BOUND
            while time.monotonic() < deadline:
                out["health_later"] = (await j.client.unary(HEALTH_CHECK_PATH, b"")).reply
                if out["health_later"] == NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
        return out

    async with served(
        ctl, on_lane_fault=mode, close_timeout_seconds=0.3, max_abandoned_lanes=0
    ) as address:
        out = await on_wire(client(address))
        ctl.release.set()
    if mode == "truncate":
        assert out["fault"].step is not None and out["fault"].step.truncated_mask == b"\x01"
    assert obs(out["step"]).tolist() == [1.0, 3.0]
    assert out["health"] == SERVING
    assert out["health_later"] == NOT_SERVING


@pytest.mark.parametrize("mode", SUPERVISED)
async def test_a_rebuild_whose_factory_fails_answers_a_clear_recoverable_error(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            ctl.fail_builds = 1
            out["fault"] = await j.call(wire.step(acts(RAISE), env_indices=[1]))
            out["dead"] = await j.call(wire.reset(env_indices=[1]))
            out["other"] = await j.call(wire.step(acts(0), env_indices=[0]))
        return out

    async with served(ctl, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    # The lane is tried again after its backoff: CRASHED, recoverable (the session goes on).
    assert error(out["dead"]) == (
        Code.CRASHED,
        "lane 1 could not be rebuilt (attempt 1): RuntimeError: factory down; the next "
        "attempt is in 0.5 s",
        True,
    )
    fault = {
        "error": "lane 1 could not be rebuilt (attempt 1): RuntimeError: factory down; the "
        "next attempt is in 0.5 s",
        "lane": 1,
        "rebuilt": False,
    }
    assert json.loads(out["dead"].error.debug_info) == {"rlmesh_trio.lane_fault": [fault]}
    assert obs(out["other"]).tolist() == [1.0, 1.0]  # the other lane is untouched


async def test_one_log_record_per_lane_state_change(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 19, finding 6: every move of a lane's state table is one record (from the
    one place the moves happen), rebuild attempts numbered; startup and stop at DEBUG."""
    ctl = Controller()
    caplog.set_level(logging.DEBUG, logger="rlmesh_trio.lanes")

    async def client(address: str) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            ctl.fail_builds = 1
            await j.call(wire.step(acts(RAISE), env_indices=[1]))
            deadline = time.monotonic() + BOUND
            while (await j.call(wire.reset(env_indices=[1]))).error is not None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

    async with served(ctl, on_lane_fault="rebuild") as address:
        await on_wire(client(address))
    moves = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "rlmesh_trio.lanes" and " -> " in r.getMessage()
    ]
    lane1 = [m for m in moves if m[1].startswith("lane 1:")]
    assert lane1 == [
        ("DEBUG", "lane 1: starting -> serving"),
        ("INFO", "lane 1: serving -> rebuilding (rebuild attempt 1)"),
        ("INFO", "lane 1: rebuilding -> dead"),
        ("INFO", "lane 1: dead -> rebuilding (rebuild attempt 2)"),
        ("INFO", "lane 1: rebuilding -> serving"),
        ("DEBUG", "lane 1: serving -> stopped"),
    ]
    assert [m for m in moves if m[1].startswith("lane 0:")] == [
        ("DEBUG", "lane 0: starting -> serving"),
        ("DEBUG", "lane 0: serving -> stopped"),
    ]


async def test_a_dead_lane_does_not_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 19, finding 6: every refusal of a dead lane wrote an ERROR with the factory's
    traceback (13 MB in 60 s from one client). A refusal runs no env code: it goes through
    the rate-limited requests logger, without a traceback; the fault itself is logged."""
    ctl = Controller()
    caplog.set_level(logging.INFO)

    async def client(address: str) -> list[Any]:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            ctl.fail_builds = 1_000
            await j.call(wire.step(acts(RAISE), env_indices=[1]))
            return [await j.call(wire.reset(env_indices=[1])) for _ in range(200)]

    async with served(ctl, on_lane_fault="rebuild") as address:
        replies = await on_wire(client(address))
    assert all(error(r)[0] == Code.CRASHED for r in replies)
    env_errors = [r for r in caplog.records if r.name == "rlmesh_trio.env"]
    assert len(env_errors) == 1  # the step's own fault, with its traceback
    refusals = [r for r in caplog.records if "refused by its lane" in r.getMessage()]
    assert 1 <= len(refusals) <= 20  # a burst, then held back (and counted)
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in refusals)


# ------------------------------------------------------------------- engine level


class Replies:
    """Lane replies bridged into Trio, by key."""

    def __init__(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.got: dict[str, list[LaneReply]] = {}
        self.changed = trio.Event()

    def to(self, key: str) -> Callable[[LaneReply], None]:
        def reply(r: LaneReply) -> None:
            self.token.run_sync_soon(self._put, key, r)

        return reply

    def _put(self, key: str, reply: LaneReply) -> None:
        self.got.setdefault(key, []).append(reply)
        self.changed.set()
        self.changed = trio.Event()

    async def get(self, key: str) -> LaneReply:
        with trio.fail_after(BOUND):
            while key not in self.got:
                await self.changed.wait()
        return self.got[key][0]


@asynccontextmanager
async def engine_for(
    ctl: Controller, num_envs: int = 2, **kwargs: Any
) -> AsyncIterator[LaneEngine]:
    try:
        async with trio.open_nursery() as nursery:
            engine = lane_engine(Factory(ctl), num_envs, **kwargs)
            await nursery.start(engine.run)
            try:
                yield engine
            finally:
                ctl.release.set()
                engine.close()
    finally:
        ctl.release.set()
    assert ctl.violations == [], ctl.violations


def step_job(action: int, id: int = 1) -> StepJob:
    return StepJob(leaves=[wire.i64([action])], n=1, row=0, validated=False, id=id)


async def test_failed_rebuilds_back_off_then_the_lane_serves_again() -> None:
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, on_fault="rebuild", rebuild_backoff=(0.05, 0.2)) as engine:
        engine.post(1, ResetJob(seed=1, options=None), replies.to("reset"))
        await replies.get("reset")
        ctl.fail_builds = 2
        engine.post(1, step_job(RAISE), replies.to("fault"))
        fault = await replies.get("fault")
        assert fault.fault is not None and fault.fault.error == "RuntimeError: boom on step 0"
        states: list[str] = []

        def serving_again() -> bool:
            states.append(engine.status()[1].state)
            return engine.status()[1].state == "serving"

        await wait_for(serving_again)
        assert "dead" in states
        status = engine.status()[1]
        assert (status.faults, status.rebuilds) == (1, 1)
        # two startup builds, two failed factory calls (not built), then the rebuild
        assert len(ctl.built) == 3
        engine.post(1, ResetJob(seed=2, options=None), replies.to("after"))
        assert (await replies.get("after")).outcome.unwrap().observation


async def test_a_dead_lane_refuses_with_the_attempt_and_the_cause() -> None:
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, on_fault="rebuild", rebuild_backoff=(30.0, 30.0)) as engine:
        ctl.mismatch_builds = 1
        engine.post(0, step_job(RAISE), replies.to("fault"))
        await replies.get("fault")
        await wait_for(lambda: engine.status()[0].state == "dead")
        with pytest.raises(LaneDeadError) as info:
            engine.post(0, ResetJob(seed=1, options=None), replies.to("never"))
        message = str(info.value)
        assert message.startswith(
            "lane 0 could not be rebuilt (attempt 1): ContractMismatchError: the rebuilt env "
            "disagrees with lane 0 on the env contract: observation_space"
        ), message
        # The other lane is untouched.
        engine.post(1, ResetJob(seed=1, options=None), replies.to("other"))
        assert isinstance((await replies.get("other")).outcome, outcome.Value)
    assert "never" not in replies.got


async def test_rebuilt_lanes_use_their_env_only_on_the_thread_that_built_it() -> None:
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, num_envs=1, on_fault="rebuild") as engine:
        threads = []
        for round_ in range(5):
            engine.post(0, ResetJob(seed=round_, options=None), replies.to(f"reset{round_}"))
            await replies.get(f"reset{round_}")
            engine.post(
                0,
                CallJob(fn=lambda env: threading.current_thread()),
                replies.to(f"who{round_}"),
            )
            threads.append((await replies.get(f"who{round_}")).outcome.unwrap())
            engine.post(0, step_job(RAISE), replies.to(f"fault{round_}"))
            await replies.get(f"fault{round_}")
        await wait_for(lambda: engine.status()[0].rebuilds == 5)
        assert len(set(threads)) == 5  # a fresh OS thread for every incarnation
        assert [env.thread_object for env in ctl.built] == [*threads, ctl.built[-1].thread_object]
    assert len(ctl.closed) == 6  # every env closed, each on its own thread (no violation)


async def test_the_watchdog_abandons_a_wedged_call_and_counts_it() -> None:
    ctl = Controller()
    replies = Replies()
    async with engine_for(
        ctl, num_envs=2, on_fault="rebuild", lane_timeout=0.2, max_abandoned=0
    ) as engine:
        engine.post(1, ResetJob(seed=1, options=None), replies.to("reset"))
        await replies.get("reset")
        engine.post(1, step_job(HANG), replies.to("hang"))
        engine.post(1, ResetJob(seed=2, options=None), replies.to("queued"))
        hang = await replies.get("hang")
        with pytest.raises(LaneTimeoutError, match=r"^env\.step timed out after 200ms$"):
            hang.outcome.unwrap()
        assert hang.fault is not None and hang.fault.rebuilt
        # The job queued behind the wedged call is served by the fresh env.
        assert isinstance((await replies.get("queued")).outcome, outcome.Value)
        status = engine.status()[1]
        assert (status.wedges, status.abandoned, status.state) == (1, 1, "serving")
        assert not engine.healthy
        ctl.release.set()
        await wait_for(lambda: engine.status()[1].abandoned == 0)
        assert engine.healthy


async def test_a_lane_down_for_a_while_leaves_health_alone() -> None:
    """Neither a lane being rebuilt (its factory still running) nor one dead until its
    next rebuild attempt is given up: health stays SERVING (the other lane meets
    ``min_serving_lanes=1``) and nothing is counted against ``max_given_up_lanes=0``."""
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, on_fault="rebuild", rebuild_backoff=(30.0, 30.0)) as engine:
        ctl.block_builds = ctl.fail_builds = 1  # the rebuild's factory hangs, then raises
        engine.post(1, step_job(RAISE), replies.to("fault"))
        await replies.get("fault")
        await trio.to_thread.run_sync(ctl.wait_hanging)
        assert engine.status()[1].state == "rebuilding"
        assert (engine.given_up, engine.serving, engine.healthy) == (0, 2, True)
        ctl.release.set()
        await wait_for(lambda: engine.status()[1].state == "dead")
        assert (engine.given_up, engine.serving, engine.healthy) == (0, 1, True)


@pytest.mark.parametrize("tolerated", [0, 1])
async def test_a_lane_whose_thread_dies_of_an_engine_bug_is_given_up(
    monkeypatch: pytest.MonkeyPatch, tolerated: int
) -> None:
    """A lane thread that dies of a bug of ours stops its lane for good while the engine
    runs: given up like any other, so health follows ``max_given_up_lanes``."""

    def broken(*args: Any) -> bool:
        raise RuntimeError("an engine bug")

    monkeypatch.setattr("rlmesh_trio._lanes._thread.LaneThreads._rebuilt", broken)
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, on_fault="rebuild", max_given_up=tolerated) as engine:
        assert (engine.given_up, engine.healthy) == (0, True)
        engine.post(1, step_job(RAISE), replies.to("fault"))
        await replies.get("fault")
        await wait_for(lambda: engine.status()[1].state == "stopped")
        assert (engine.given_up, engine.serving) == (1, 1)
        assert engine.healthy is (tolerated == 1)
        with pytest.raises(LaneBrokenError, match="lane 1 is no longer running"):
            engine.post(1, ResetJob(seed=1, options=None), replies.to("never"))
        engine.post(0, ResetJob(seed=1, options=None), replies.to("other"))
        assert isinstance((await replies.get("other")).outcome, outcome.Value)


# ------------------------------------------------------------------ rlmesh.run


@pytest.mark.interop
async def test_rlmesh_run_completes_every_seed_while_a_lane_crashes_every_few_steps() -> None:
    """rlmesh 0.1.0's own driver, 4 lanes, truncate mode: episodes whose seed is a
    multiple of 3 crash on their third step; the run completes all seeds, and exactly the
    crashed episodes are marked (truncated, with the fault in the step's info)."""
    rlmesh = pytest.importorskip("rlmesh")
    from rlmesh.numpy import Model

    ctl = Controller()
    seeds = list(range(30, 46))
    faults: list[tuple[int | None, Any]] = []

    class Hooks(rlmesh.RunHooks):  # type: ignore[misc]
        def on_step(self, event: Any) -> None:
            if "rlmesh_trio.lane_fault" in event.info:
                faults.append((event.seed, event.info["rlmesh_trio.lane_fault"]))

    def policy(observation: Any) -> int:
        t, s = int(observation[0]), int(observation[1])
        return RAISE if s % 3 == 0 and t == 2 else 0

    def run(address: str) -> Any:
        return rlmesh.run(Model(policy), address, seeds=seeds, hooks=Hooks())

    async with served(ctl, num_envs=4, on_lane_fault="truncate") as address:
        result = await trio.to_thread.run_sync(run, address)
    episodes = sorted(result.episodes, key=lambda e: e.seed)
    assert [e.seed for e in episodes] == seeds
    crashed = {e.seed for e in episodes if e.truncated}
    assert crashed == {s for s in seeds if (s % 10) % 3 == 0}
    for e in episodes:
        if e.seed in crashed:
            assert (e.steps, e.reward, e.terminated) == (3, 2.0, False)
        else:
            assert (e.steps, e.terminated) == (8, True)
    assert sorted(seed for seed, _ in faults) == sorted(crashed)
    assert all(f["error"] == "RuntimeError: boom on step 2" and f["rebuilt"] for _, f in faults)
    assert len(ctl.built) == 4 + len(crashed)


# ----------------------------------------------------------------------- stress


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


STORMS = {
    # The storms: a step that always raises and a close() that hangs (threads
    # 7 -> 9,711 in 60 s); a step that always hangs under a watchdog (7 -> 577); a step
    # that always raises (rebuilds at ~160/s).
    "raise-close-hangs": ({"on_lane_fault": "rebuild", "close_timeout_seconds": 0.2}, RAISE, True),
    "hang-watchdog": ({"on_lane_fault": "truncate", "lane_timeout_seconds": 0.1}, HANG, False),
    "raise": ({"on_lane_fault": "rebuild"}, RAISE, False),
}


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("storm", list(STORMS))
async def test_a_fault_storm_stays_bounded(storm: str) -> None:
    """Issue 19, finding 5: lane 1 faults on every step for 3 s while lane 0 serves. The
    threads stay within the lanes plus the lane's cap of abandoned ones (then the lane is
    given up: dead, refusing), the rebuilds are backed off, and memory stays flat."""
    options, action, close_hangs = STORMS[storm]
    ctl = Controller()
    ctl.close_hangs = close_hangs
    seconds = 3.0

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {"codes": set(), "healthy_steps": 0}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["threads_before"] = threading.active_count()
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                if "rss_warm" not in out and time.monotonic() - start > 0.5:
                    out["rss_warm"] = rss_bytes()
                reset = await j.call(wire.reset(env_indices=[1]))
                step = await j.call(wire.step(acts(action), env_indices=[1]))
                for reply in (reset, step):
                    if reply.error is not None:
                        out["codes"].add(reply.error.code)
                healthy = await j.call(wire.step(acts(0), env_indices=[0]))
                assert healthy.step is not None, healthy
                out["healthy_steps"] += 1
                out["threads_max"] = max(out.get("threads_max", 0), threading.active_count())
            out["rss_end"] = rss_bytes()
            out["dead"] = await j.call(wire.reset(env_indices=[1]))
        return out

    async with served(ctl, **options) as address:
        out = await on_wire(client(address))
    # The lane's abandoned threads (at most MAX_LEFT_BEHIND), a retired one closing and
    # the fresh one: nothing grows with the number of faults.
    assert out["threads_max"] <= out["threads_before"] + MAX_LEFT_BEHIND + 2, out
    assert out["rss_end"] - out["rss_warm"] < 8 * 2**20, out
    assert out["healthy_steps"] > 10  # lane 0 went on meanwhile
    # Backed off: FREE_REBUILDS at once, then after 0.5 s, 1 s, 2 s... (not ~500 in 3 s);
    # meanwhile the lane refuses at once, CRASHED and recoverable, saying when.
    assert len(ctl.built) <= 2 + FREE_REBUILDS + 3, len(ctl.built)
    assert Code.CRASHED in out["codes"]
    if out["dead"].error is not None:
        code, message, recoverable = error(out["dead"])
        assert code == Code.CRASHED and recoverable, message
        assert "times in a row" in message and "it is rebuilt again in" in message, message
    await wait_for(lambda: not threads_named("-abandoned"))


async def test_a_lane_that_leaves_too_many_threads_behind_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its cap of abandoned threads still running, a lane is not rebuilt again: dead,
    refusing fatally with a clear message, and health says NOT_SERVING (no lane left)."""
    monkeypatch.setattr("rlmesh_trio._lanes._supervisor.MAX_LEFT_BEHIND", 2)
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": []}
        async with wire.WireClient(address) as c, c.join() as j:
            for _ in range(3):  # every step hangs and is abandoned by the watchdog
                await j.call(wire.reset(seeds=[1]))
                out["steps"].append(await j.call(wire.step(acts(HANG))))
            out["dead"] = await j.call(wire.reset(seeds=[1]))
            out["health"] = (await c.unary(HEALTH_CHECK_PATH, b"")).reply
        return out

    async with served(ctl, num_envs=1, on_lane_fault="rebuild", lane_timeout_seconds=0.1) as a:
        out = await on_wire(client(a))
        assert len(threads_named("-abandoned")) == 3
        assert len(ctl.built) == 3  # the first env and two rebuilds, then no more
        ctl.release.set()
    code, message, recoverable = error(out["dead"])
    assert (code, recoverable) == (Code.INTERNAL, False)
    assert message == (
        "lane 0 is given up after repeated faults: 3 threads it abandoned are still running "
        "(an env.close() or env call that does not return); restart the server to get it back"
    )
    assert out["health"] == NOT_SERVING
    await wait_for(lambda: not threads_named("-abandoned"))


@pytest.mark.parametrize(
    ("options", "health"),
    [({}, NOT_SERVING), ({"max_given_up_lanes": 1}, SERVING)],
    ids=["default", "max_given_up_lanes=1"],
)
async def test_a_given_up_lane_turns_health_not_serving_unless_tolerated(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    options: dict[str, Any],
    health: bytes,
) -> None:
    """The soak's lane 3: given up after its hangs while ``max_abandoned_lanes`` is far
    above them. Every whole-vector request fails from then on, so health says NOT_SERVING
    at once by default, with lane 0 still serving; ``max_given_up_lanes=1`` keeps today's
    rule for lane-scoped clients (SERVING while ``min_serving_lanes`` is met)."""
    monkeypatch.setattr("rlmesh_trio._lanes._supervisor.MAX_LEFT_BEHIND", 0)  # 1st hang
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            out["before"] = (await j.client.unary(HEALTH_CHECK_PATH, b"")).reply
            # The watchdog abandons the hung step; the lane is given up instead of rebuilt.
            out["hang"] = await j.call(wire.step(acts(HANG), env_indices=[1]))
            # Refused, or queued and then refused by the give-up: either way it is dead.
            out["dead"] = await j.call(wire.reset(env_indices=[1]))
            out["after"] = (await j.client.unary(HEALTH_CHECK_PATH, b"")).reply
            out["lane 0"] = await j.call(wire.step(acts(0), env_indices=[0]))
            out["whole"] = await j.call(wire.step(acts(0, 0)))
        return out

    caplog.set_level(logging.WARNING, "rlmesh_trio.lanes")
    async with served(
        ctl, on_lane_fault="rebuild", lane_timeout_seconds=0.1, max_abandoned_lanes=64, **options
    ) as address:
        out = await on_wire(client(address))
        ctl.release.set()
    assert out["before"] == SERVING
    assert error(out["hang"])[0] == Code.CRASHED
    code, message, recoverable = error(out["dead"])
    assert (code, recoverable) == (Code.INTERNAL, False)
    assert message.startswith("lane 1 is given up after repeated faults"), message
    assert out["after"] == health
    assert out["lane 0"].step is not None, out["lane 0"]
    assert out["whole"].error is not None, out["whole"]
    said = [r.getMessage() for r in caplog.records]
    if health == NOT_SERVING:
        assert (
            "lane 1 is given up for good: health now reports NOT_SERVING (1 of 2 lanes given "
            "up, max_given_up_lanes tolerates 0); restart this server"
        ) in said, said
    else:
        assert any("health stays SERVING" in m for m in said), said
    await wait_for(lambda: not threads_named("-abandoned"))


@pytest.mark.parametrize("mode", SUPERVISED)
async def test_stress_random_faults_and_hangs_on_eight_lanes(mode: str) -> None:
    """8 lanes driven concurrently with lane-scoped requests; random steps raise or hang
    (the watchdog abandons those). Every reply answers its own request, every episode is
    reported exactly once with the steps the client saw, and once the hung calls are
    released no thread is left."""
    import random

    ctl = Controller(episode_steps=6)
    lanes, per_lane = 8, 160

    async def client(address: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[env_v1.JoinResponse]] = {}
        records: list[Any] = []
        episodes: dict[int, dict[str, Any]] = {}  # seed -> what the client saw
        mismatched: list[str] = []

        async with wire.WireClient(address) as c, c.join() as j:

            async def receive() -> None:
                while True:
                    reply = await j.recv(timeout=BOUND)
                    if reply is None:
                        return
                    future = futures.pop(reply.request_id, None)
                    if future is None:
                        mismatched.append(reply.request_id)
                    else:
                        future.set_result(reply)

            async def call(request: env_v1.JoinRequest) -> env_v1.JoinResponse:
                future: asyncio.Future[env_v1.JoinResponse] = loop.create_future()
                futures[request.request_id] = future
                await j.send(request)
                reply = await asyncio.wait_for(future, BOUND)
                if reply.step is not None:
                    records.extend(reply.step.completed_episodes)
                return reply

            async def drive(lane: int) -> None:
                rng = random.Random(lane)
                seed: int | None = None
                for k in range(per_lane):
                    rid = f"{lane}-{k}"
                    if seed is None:
                        seed = lane * 10_000 + k
                        reply = await call(
                            wire.reset(seeds=[seed], env_indices=[lane], request_id=rid)
                        )
                        assert reply.reset is not None, reply
                        episodes[seed] = {"steps": 0, "end": None}
                        continue
                    roll = rng.random()
                    action = RAISE if roll < 0.04 else HANG if roll < 0.05 else 0
                    reply = await call(wire.step(acts(action), env_indices=[lane], request_id=rid))
                    seen = episodes[seed]
                    if reply.error is not None:
                        assert mode == "rebuild" and action != 0, reply
                        seen["end"] = "interrupted"
                        seed = None
                        continue
                    step = reply.step
                    assert step is not None and list(step.env_indices) == [lane], reply
                    seen["steps"] += 1
                    if step.truncated_mask == b"\x01":
                        assert mode == "truncate" and action != 0, reply
                        seen["end"] = "truncated"
                        seed = None
                    elif step.terminated_mask == b"\x01":
                        seen["end"] = "terminated"
                        seed = None

            receiver = asyncio.create_task(receive())
            await asyncio.gather(*(drive(lane) for lane in range(lanes)))
            futures["close"] = loop.create_future()
            await j.send(wire.close(request_id="close"))
            close = await asyncio.wait_for(futures["close"], BOUND)
            await asyncio.wait_for(receiver, BOUND)
        assert close.close is not None
        records.extend(close.close.final_episodes)
        return {"records": records, "episodes": episodes, "mismatched": mismatched}

    async with served(
        ctl,
        num_envs=lanes,
        on_lane_fault=mode,
        lane_timeout_seconds=0.2,
        max_abandoned_lanes=1000,
    ) as address:
        out = await on_wire(client(address))
        ctl.release.set()
        await wait_for(lambda: not threads_named("-abandoned"))
    assert out["mismatched"] == []
    by_seed: dict[int, list[Any]] = {}
    for record in out["records"]:
        by_seed.setdefault(record.seed, []).append(record)
    episodes = out["episodes"]
    assert sorted(by_seed) == sorted(episodes)  # every episode reported...
    for seed, seen in episodes.items():
        (record,) = by_seed[seed]  # ...exactly once
        assert record.env_index == seed // 10_000
        assert record.step_count == seen["steps"], (seed, seen, record)
        if seen["end"] == "terminated":
            assert record.terminated and not record.truncated
        elif seen["end"] is not None:
            assert record.truncated and not record.terminated
        else:  # still running at Close
            assert record.truncated
    faults = sum(1 for seen in episodes.values() if seen["end"] in ("interrupted", "truncated"))
    assert faults > 0
    assert len(ctl.built) == lanes + faults


# ---------------------------------------------------------------------- shutdown


async def test_the_stop_bound_holds_with_abandoned_and_retired_threads() -> None:
    """rebuild mode: one lane's thread abandoned in a hung step, another's retired thread
    hung in the faulted env's close(); cancelling the server still returns within
    drain + close + 1 s, and both threads exit once released."""
    ctl = Controller()
    drain, close = 0.2, 0.4

    async def client(address: str) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            await j.call(wire.step(acts(HANG), env_indices=[0], timeout_ms=100))
            ctl.close_hangs = True
            await j.call(wire.step(acts(RAISE), env_indices=[1]))
            await asyncio.to_thread(ctl.wait_hanging)  # lane 0's step
            await asyncio.to_thread(ctl.wait_hanging)  # lane 1's faulted env's close()

    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(
                serve_env,
                Factory(ctl),
                num_envs=2,
                options=ServeOptions(
                    on_lane_fault="rebuild",
                    drain_timeout_seconds=drain,
                    close_timeout_seconds=close,
                ),
            )
        )
        await on_wire(client(info.address))
        ctl.close_hangs = False  # the fresh envs close normally
        start = trio.current_time()
        nursery.cancel_scope.cancel()
    elapsed = trio.current_time() - start
    try:
        assert elapsed < drain + close + 1.0 + 2.0  # the bound, plus scheduling slack
        assert {t.name for t in threads_named("-abandoned")} <= {
            f"{LANE_THREAD_PREFIX}0-abandoned",
            f"{LANE_THREAD_PREFIX}1-abandoned",
        }
    finally:
        ctl.release.set()
    await wait_for(lambda: not threads_named("-abandoned") and not threads_named("-retired"))
    assert ctl.violations == []


@pytest.mark.parametrize("mode", MODES)
async def test_an_env_close_that_hangs_at_stop_is_abandoned_within_the_bound(mode: str) -> None:
    ctl = Controller()

    async def client(address: str) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as j:
            await j.call(wire.step(acts(0, 0)))

    close = 0.3
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(
                serve_env,
                Factory(ctl),
                num_envs=2,
                options=ServeOptions(
                    on_lane_fault=mode, drain_timeout_seconds=0.1, close_timeout_seconds=close
                ),
            )
        )
        await on_wire(client(info.address))
        ctl.close_hangs = True
        start = trio.current_time()
        nursery.cancel_scope.cancel()
    elapsed = trio.current_time() - start
    try:
        assert elapsed < 0.1 + close + 1.0 + 2.0
        assert ctl.closed == []  # both closes hang, on their own lane threads
    finally:
        ctl.release.set()
    await wait_for(lambda: len(ctl.closed) == 2)
    await wait_for(
        lambda: not [t for t in threading.enumerate() if t.name.startswith(LANE_THREAD_PREFIX)]
    )
    assert ctl.violations == []


async def test_jobs_queued_behind_a_pending_rebuild_are_answered_at_stop() -> None:
    ctl = Controller()
    replies = Replies()
    async with engine_for(ctl, num_envs=1, on_fault="rebuild", teardown_timeout=0.3) as engine:
        ctl.block_builds = 1
        engine.post(0, step_job(RAISE), replies.to("fault"))
        await replies.get("fault")
        await trio.to_thread.run_sync(ctl.wait_hanging)  # the rebuild's factory call hangs
        engine.post(0, ResetJob(seed=1, options=None), replies.to("queued"))
        assert engine.status()[0].state == "rebuilding"
        engine.close()
        queued = await replies.get("queued")
        with pytest.raises(LaneBrokenError, match=r"^lane 0 stopped before answering$"):
            queued.outcome.unwrap()


async def test_a_lanes_answers_reach_the_session_in_the_lanes_order() -> None:
    """A lane-scoped reset of lanes 0 and 1 while lane 1 hangs, then two steps of lane 0
    (a pipelining client): lane 0 resets and steps at once, and its episode counts both
    steps. (The reset's answers were once gathered until lane 1 answered, so lane 0's
    steps reached the session before its reset, and counted in the old episode.)"""
    ctl = Controller()

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.joined(address, wire.configure(), wire.reset(seeds=[1, 2])) as join:
            await join.send(wire.step(acts(HANG), env_indices=[1], request_id="hang"))
            ctl.wait_hanging()
            await join.send(wire.reset(seeds=[3, 4], env_indices=[0, 1], request_id="r"))
            for i in range(2):
                await join.send(wire.step(acts(0), env_indices=[0], request_id=f"s{i}"))
            for _ in range(2):
                reply = await join.recv()
                assert reply is not None
                out[reply.request_id] = reply
            ctl.release.set()
            for _ in range(2):
                reply = await join.recv()
                assert reply is not None
                out[reply.request_id] = reply
            out["close"] = await join.call(wire.close())
        return out

    async with served(ctl) as address:
        out = await on_wire(client(address))
    assert obs(out["s0"]).tolist() == [1.0, 3.0] and obs(out["s1"]).tolist() == [2.0, 3.0]
    final = out["close"].close.final_episodes
    got = sorted((e.env_index, e.seed, e.step_count) for e in final)
    assert got == [(0, 3, 2), (1, 2, 1), (1, 4, 0)], got  # lane 1: seed 2 cut by the reset
