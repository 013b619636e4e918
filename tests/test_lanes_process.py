"""Process lanes (``lane_isolation="process"``): each env in a child process of its own.

The envs of :mod:`support.crashy` segfault, ``os._exit``, hold the GIL in native code or
raise on demand; the other lanes, the health service and the server itself must not
notice, and no child may outlive the server (also when the server is SIGKILLed).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from support import crashy, wire
from support.crashy import EXIT, HOG, OK, RAISE, SEGFAULT

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._wire import HEALTH_CHECK_PATH

pytestmark = [pytest.mark.timeout(90), pytest.mark.skipif(sys.platform == "win32", reason="POSIX")]

Code = env_v1.EnvErrorCode
BOUND = 20.0
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"
ROOT = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def served(num_envs: int = 4, **options: Any) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(
                serve_env,
                crashy.make_crashy,
                num_envs=num_envs,
                options=ServeOptions(lane_isolation="process", **options),
            )
        )
        try:
            yield info.address
        finally:
            nursery.cancel_scope.cancel()


async def on_wire(coro: Any) -> Any:
    return await trio.to_thread.run_sync(asyncio.run, coro)


def acts(*actions: int) -> list[bytes]:
    return [wire.i64(actions)]


def pids(reply: env_v1.JoinResponse) -> list[int]:
    body = reply.step if reply.step is not None else reply.reset
    assert body is not None and body.observation is not None, reply
    return [int(v) for v in np.frombuffer(body.observation.leaves[0], np.float32)[1::2]]


def error(reply: env_v1.JoinResponse | None) -> tuple[Code, str, bool]:
    assert reply is not None and reply.error is not None, reply
    return reply.error.code, reply.error.message, reply.error.is_recoverable


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is not alive
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


async def wait_gone(pids_: list[int], seconds: float = BOUND) -> None:
    with trio.fail_after(seconds):
        while any(alive(pid) for pid in pids_):  # noqa: ASYNC110 - no event for another process
            await trio.sleep(0.05)


async def test_envs_live_in_their_own_processes_and_answer_as_thread_lanes_do() -> None:
    async def client(address: str) -> dict[str, Any]:
        async with wire.WireClient(address) as c, c.join() as j:
            reset = await j.call(wire.reset(seeds=[1, 2, 3, 4]))
            step = await j.call(wire.step(acts(OK, OK, OK, OK)))
            lane = await j.call(wire.step(acts(OK), env_indices=[2]))
            return {"reset": reset, "step": step, "lane": lane}

    async with served() as address:
        out = await on_wire(client(address))
    children = pids(out["reset"])
    assert len(set(children)) == 4 and os.getpid() not in children
    assert pids(out["step"]) == children
    obs = np.frombuffer(out["lane"].step.observation.leaves[0], np.float32)
    assert obs.tolist() == [2.0, float(children[2])]
    await wait_gone(children)  # stopped with the server


@pytest.mark.parametrize(
    ("action", "how"), [(SEGFAULT, "SIGSEGV"), (EXIT, "exit code 3")], ids=["segfault", "exit"]
)
async def test_a_child_that_dies_costs_the_other_lanes_nothing(action: int, how: str) -> None:
    """Policy ``error``: the lane is lost for good (given up), the other lanes serve on,
    and health says NOT_SERVING (``max_given_up_lanes`` 0) so that it is restarted."""

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2, 3, 4]))
            out["health"] = (await c.unary(HEALTH_CHECK_PATH, b"")).reply
            out["death"] = await j.call(wire.step(acts(action), env_indices=[2]))
            for lane in (0, 1, 3):
                out[lane] = await j.call(wire.step(acts(OK), env_indices=[lane]))
            out["gone"] = await j.call(wire.reset(env_indices=[2]))
            # (after the refusal: the failed step is answered before the lane is marked)
            out["health after"] = (await c.unary(HEALTH_CHECK_PATH, b"")).reply
        return out

    async with served() as address:
        out = await on_wire(client(address))
    assert error(out["death"]) == (
        Code.INTERNAL,
        f"step failed: lane 2 process died ({how})",
        False,
    )
    for lane in (0, 1, 3):
        assert out[lane].step is not None, out[lane]
    code, message, recoverable = error(out["gone"])
    assert (code, recoverable) == (Code.INTERNAL, False)
    assert message.startswith(f"lane 2 is gone: lane 2 process died ({how})"), message
    assert (out["health"], out["health after"]) == (SERVING, NOT_SERVING)


@pytest.mark.parametrize("mode", ["rebuild", "truncate"])
async def test_a_dead_child_is_replaced_by_a_fresh_process(mode: str) -> None:
    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            out["death"] = await j.call(wire.step(acts(SEGFAULT), env_indices=[1]))
            out["again"] = await j.call(wire.reset(seeds=[5], env_indices=[1]))
            out["step"] = await j.call(wire.step(acts(OK, OK)))
        return out

    async with served(num_envs=2, on_lane_fault=mode) as address:
        out = await on_wire(client(address))
    if mode == "truncate":
        step = out["death"].step
        assert step is not None and step.truncated_mask == b"\x01"
        (episode,) = step.completed_episodes
        assert wire.from_meta_map(episode.final_info)["rlmesh_trio.lane_fault"] == {
            "error": "LaneProcessDiedError: step failed: lane 1 process died (SIGSEGV)",
            "lane": 1,
            "rebuilt": True,
        }
    else:
        assert error(out["death"]) == (
            Code.CRASHED,
            "step failed: lane 1 process died (SIGSEGV) (lane 1 faulted and was rebuilt: "
            "reset it to go on)",
            True,
        )
    first, fresh = pids(out["reset"]), pids(out["again"])
    assert fresh[0] != first[1]
    assert pids(out["step"]) == [first[0], fresh[0]]


async def test_a_child_killed_from_outside_is_rebuilt() -> None:
    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            os.kill(pids(out["reset"])[0], signal.SIGKILL)
            await asyncio.sleep(0.2)
            out["death"] = await j.call(wire.step(acts(OK), env_indices=[0]))
            out["again"] = await j.call(wire.reset(env_indices=[0]))
        return out

    async with served(num_envs=2, on_lane_fault="rebuild") as address:
        out = await on_wire(client(address))
    assert error(out["death"]) == (
        Code.CRASHED,
        "step failed: lane 0 process died (SIGKILL) (lane 0 faulted and was rebuilt: "
        "reset it to go on)",
        True,
    )
    assert out["again"].reset is not None


async def test_a_gil_holding_env_freezes_nothing_and_the_watchdog_kills_it() -> None:
    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            await j.send(wire.step(acts(HOG), env_indices=[1], request_id="hog"))
            await asyncio.sleep(0.3)  # the child is deep in the regex, holding its GIL
            t0 = time.monotonic()
            out["health"] = (await c.unary(HEALTH_CHECK_PATH, b"")).reply
            out["health_s"] = time.monotonic() - t0
            out["other"] = await j.call(wire.step(acts(OK), env_indices=[0], request_id="ok"))
            out["hog"] = await j.recv(timeout=BOUND)
            out["again"] = await j.call(wire.reset(seeds=[3], env_indices=[1]))
        return out

    async with served(num_envs=2, on_lane_fault="rebuild", lane_timeout_seconds=2.0) as address:
        out = await on_wire(client(address))
    assert out["health"] == SERVING and out["health_s"] < 1.5
    assert out["other"].step is not None
    assert error(out["hog"]) == (
        Code.CRASHED,
        "env.step timed out after 2000ms (lane 1 faulted and was rebuilt: reset it to go on)",
        True,
    )
    assert pids(out["again"])[0] != pids(out["reset"])[1]
    await wait_gone([pids(out["reset"])[1]])


async def test_an_env_error_in_a_child_keeps_its_type_and_text() -> None:
    async def client(address: str) -> env_v1.JoinResponse:
        async with wire.WireClient(address) as c, c.join() as j:
            await j.call(wire.reset(seeds=[1]))
            return await j.call(wire.step(acts(RAISE)))

    async with served(num_envs=1) as address:
        reply = await on_wire(client(address))
    assert error(reply) == (Code.INTERNAL, "step failed: RuntimeError: crashy raised", False)


async def test_an_unpicklable_factory_is_a_clear_startup_error() -> None:
    with pytest.raises(TypeError, match="lane_isolation='process' needs an env factory"):
        await serve_env(
            lambda: crashy.make_crashy(), options=ServeOptions(lane_isolation="process")
        )


# ------------------------------------------------------------------ no orphans


def start_cli_server(*extra: str) -> tuple[subprocess.Popen[bytes], str]:
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh_trio",
            "serve",
            "--entrypoint",
            "support.crashy:make_crashy",
            "--num-envs",
            "2",
            "--lane-isolation",
            "process",
            "--ready-fd",
            str(write_fd),
            *extra,
        ],
        pass_fds=(write_fd,),
        env=env,
        stdin=subprocess.DEVNULL,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as ready:
        address = ready.readline().strip()
    assert address, "the server did not report its address"
    return proc, address


async def children_of(address: str) -> list[int]:
    async def client() -> list[int]:
        async with wire.WireClient(address) as c, c.join() as j:
            return pids(await j.call(wire.reset(seeds=[1, 2])))

    return await on_wire(client())


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_no_child_outlives_the_server(how: signal.Signals) -> None:
    proc, address = await trio.to_thread.run_sync(start_cli_server)
    try:
        children = await children_of(address)
        assert all(alive(pid) for pid in children)
        os.kill(proc.pid, how)
        await trio.to_thread.run_sync(proc.wait, BOUND)
        await wait_gone(children, 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "info",
    [
        {},
        {"x": 0.5, "n": -3, "s": "é", "b": True, "raw": b"\x00\xff", "l": [1, 2.5], "m": {"k": 1}},
    ],
)
def test_the_pipe_forms_round_trip(info: dict[str, Any]) -> None:
    """A step and a reset (and their results) come out of the pipe's compact forms as they
    went in; anything else is pickled whole."""
    import pickle

    import outcome

    from rlmesh_trio._codec import Candidate, to_meta_map
    from rlmesh_trio._jobs import Phases, ResetJob, ResetResult, StepJob, StepResult
    from rlmesh_trio._lanes._process import pack_job, pack_result, unpack_job, unpack_result
    from rlmesh_trio._wire import encode_meta_map

    def through(message: Any) -> Any:
        return pickle.loads(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    step = StepJob(leaves=[memoryview(b"\x01" + bytes(7))], n=1, row=0, validated=False, id=9)
    job, queue_ns = unpack_job(through(pack_job(step, 123)))
    assert queue_ns == 123
    assert job == StepJob(leaves=[b"\x01" + bytes(7)], n=1, row=0, validated=False, id=9)
    reset = ResetJob(seed=4, options={"a": 1}, id=3)
    assert unpack_job(through(pack_job(reset, 5))) == (reset, 5)

    warning = Candidate("observation", "$", "$: Box value at element 0 out of bounds: above")
    phases = Phases(1, 2, 3, 4)
    results: list[Any] = [
        StepResult([b"ab"], 1.5, True, False, to_meta_map(info), None, warning),
        ResetResult([b"cd", b""], to_meta_map(info), warning),
    ]
    for result in results:
        packed = pack_result(outcome.Value(result), phases, False)
        assert packed is not None
        back, back_phases, faulted = unpack_result(through(packed))
        assert isinstance(back, outcome.Value)
        assert back.value == result and back_phases == phases and faulted is False
        assert encode_meta_map(back.value.info) == encode_meta_map(result.info)
    assert pack_result(outcome.Error(ValueError("x")), phases, True) is None
    assert pack_result(outcome.Value(42), phases, False) is None


async def test_a_wedged_child_dumps_its_stack(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 19, finding 8, for a process lane: the env runs in the child, so the child
    dumps every thread's stack (faulthandler, on the server's stderr) when the lane is
    declared wedged -- here while the env holds the child's GIL in native code."""

    async def client(address: str) -> env_v1.JoinResponse:
        async with wire.WireClient(address) as c, c.join() as j:
            await j.call(wire.reset(seeds=[1]))
            return await j.call(wire.step(acts(HOG)))

    async with served(num_envs=1, lane_timeout_seconds=0.5, close_timeout_seconds=1.0) as a:
        reply = await on_wire(client(a))
        assert error(reply)[0] == Code.TIMEOUT
        err = ""
        with trio.fail_after(BOUND):
            while "crashy.py" not in err:  # no event for another process
                await trio.sleep(0.05)
                err += capfd.readouterr().err
    assert "Current thread" in err or "Thread 0x" in err, err  # faulthandler's dump
