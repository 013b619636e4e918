"""Process lanes (``lane_isolation="process"``): each env in a child process of its own.

The envs of :mod:`support.crashy` segfault, ``os._exit``, hold the GIL in native code or
raise on demand; the other lanes, the health service and the server itself must not
notice, and no child may outlive the server (also when the server is SIGKILLed). The env
of :mod:`support.pipe_liar` writes to its own lane's pipe: a child that lies there costs
the server no memory and is killed like a crashed one.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import trio
from support import crashy, pipe_liar, serving, wire
from support.crashy import EXIT, HOG, OK, RAISE, SEGFAULT

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._options import MAX_MESSAGE_BYTES
from rlmesh_trio._pipe import PIPE_MESSAGE_CAP, RECV_CHUNK, PipeEnd, PipeViolation
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._wire import HEALTH_CHECK_PATH

pytestmark = [pytest.mark.timeout(90), pytest.mark.skipif(sys.platform == "win32", reason="POSIX")]

Code = env_v1.EnvErrorCode
BOUND = 20.0
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"
ROOT = Path(__file__).resolve().parent.parent


def served(
    num_envs: int = 4, factory: Callable[[], Any] = crashy.make_crashy, **options: Any
) -> AbstractAsyncContextManager[str]:
    """:func:`support.serving.served` with process lanes and the server's own close
    timeout unless ``options`` give one."""
    options.setdefault("close_timeout_seconds", None)
    return serving.served(factory, num_envs, lane_isolation="process", **options)


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
        async with wire.joined(address, wire.reset(seeds=[1])) as j:
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
        async with wire.joined(address, wire.reset(seeds=[1])) as j:
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


# ------------------------------------------------------------------ a hostile pipe
#
# The child's end of a lane's pipe is env code's to write to: the parent reads it as it
# reads the network, never sizing a buffer from a length the child wrote.

BIG = 4 << 20
"""Far below any lie below, far above what one read and its doubling may hold."""


def framed(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


class Spy:
    """The parent's socket, counting the reads :class:`PipeEnd` makes of it;
    ``after_read`` runs after each."""

    def __init__(self, sock: socket.socket, after_read: Callable[[], object] = int) -> None:
        self.sock = sock
        self.reads = 0
        self._after_read = after_read

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        self.reads += 1
        self._after_read()
        return data

    def recv_into(self, buffer: memoryview) -> int:
        got = self.sock.recv_into(buffer)
        self.reads += 1
        self._after_read()
        return got


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The parent's end and the child's end of a lane's socketpair; a read that would wait
    for bytes that never come fails in 10 s instead of hanging."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10.0)
    with ours, theirs:
        yield ours, theirs


def parent_end(spy: Spy) -> PipeEnd:
    return PipeEnd(cast(socket.socket, spy))


def peak_while(fn: Callable[[], object]) -> int:
    """The most bytes Python held (tracemalloc) while ``fn`` ran, above what it held before."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_cap_is_above_the_largest_message_the_server_sends() -> None:
    assert MAX_MESSAGE_BYTES + (1 << 20) <= PIPE_MESSAGE_CAP < 1 << 30


@pytest.mark.parametrize(
    "size", [RECV_CHUNK, 200 << 20, PIPE_MESSAGE_CAP], ids=["64KiB", "200MiB", "cap"]
)
def test_a_lying_length_costs_what_arrived_not_what_was_announced(
    pair: tuple[socket.socket, socket.socket], size: int
) -> None:
    """A length under the cap, a few bytes, EOF: the child is gone (EOFError), and the
    parent never held more than one read's worth (it held ``size`` bytes before)."""
    ours, child = pair
    child.sendall(struct.pack("!I", size) + b"a few bytes")
    child.shutdown(socket.SHUT_WR)

    def recv() -> None:
        with pytest.raises(EOFError):
            PipeEnd(ours).recv()

    assert peak_while(recv) < BIG


@pytest.mark.parametrize("size", [PIPE_MESSAGE_CAP + 1, 1 << 30, (1 << 32) - 1])
def test_a_length_over_the_cap_is_refused_at_once(
    pair: tuple[socket.socket, socket.socket], size: int
) -> None:
    """... without waiting for the bytes announced (nor for EOF), and allocating nothing."""
    ours, child = pair
    child.sendall(struct.pack("!I", size) + b"a few bytes")

    def recv() -> None:
        with pytest.raises(PipeViolation) as caught:
            PipeEnd(ours).recv()
        assert str(caught.value) == (
            f"announced a {size}-byte message; the cap is {PIPE_MESSAGE_CAP} bytes"
        )

    assert peak_while(recv) < BIG


def test_a_length_split_across_reads_is_checked_too(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, child = pair
    header = struct.pack("!I", 1 << 30)
    read = threading.Event()
    spy = Spy(ours, read.set)

    def send() -> None:
        child.sendall(header[:1])
        read.wait(10.0)  # the parent read the first byte alone
        child.sendall(header[1:])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        with pytest.raises(PipeViolation, match="announced a 1073741824-byte message"):
            parent_end(spy).recv()
    finally:
        read.set()
        sender.join()
    assert spy.reads >= 2  # the header did arrive in two reads


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (framed(pickle.dumps("ok")) + b"xyz", "sent 3 bytes past a {size}-byte message"),
        (framed(b"\xffnot a pickle"), "sent a 13-byte message that does not unpickle ("),
        (framed(pickle.dumps("ok")[:-1]), "does not unpickle (UnpicklingError: "),
        (framed(b"\x80\x05" + bytes(RECV_CHUNK)), "does not unpickle ("),  # over one read
    ],
    ids=["bytes-past", "garbage", "truncated-pickle", "long-garbage"],
)
def test_bytes_past_a_message_or_garbage_break_the_pipe(
    pair: tuple[socket.socket, socket.socket], data: bytes, error: str
) -> None:
    ours, child = pair
    sender = threading.Thread(target=child.sendall, args=(data,))
    sender.start()
    try:
        with pytest.raises(PipeViolation) as caught:
            PipeEnd(ours).recv()
    finally:
        sender.join()
    assert error.format(size=len(pickle.dumps("ok"))) in str(caught.value)


@pytest.mark.parametrize(
    ("size", "piece"),
    [(10, 1), (RECV_CHUNK - 100, 4096), (RECV_CHUNK, 4096), (300_000, 997), (3 << 20, 65_521)],
    ids=["bytewise", "one-read", "just-over", "frame-sized", "3MiB"],
)
def test_a_message_split_across_many_sends_arrives_whole(
    pair: tuple[socket.socket, socket.socket], size: int, piece: int
) -> None:
    ours, child = pair
    message = ("stepped", [os.urandom(size)], 1.5)
    data = framed(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def send() -> None:
        for at in range(0, len(data), piece):
            child.sendall(data[at : at + piece])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert PipeEnd(ours).recv() == message
    finally:
        sender.join()


def test_a_small_message_is_one_read(pair: tuple[socket.socket, socket.socket]) -> None:
    """The point of PipeEnd: a step's answer crosses in one syscall."""
    ours, child = pair
    spy = Spy(ours)
    message = ("stepped", [bytes(RECV_CHUNK - 100)], 1.0)
    PipeEnd(child).send(message)
    assert parent_end(spy).recv() == message
    assert spy.reads == 1


@pytest.mark.parametrize(
    ("action", "sent"),
    [
        (pipe_liar.LIE, f"announced a {pipe_liar.LIE_BYTES}-byte message; the cap is "),
        (pipe_liar.GARBAGE, "sent "),
    ],
    ids=["lie", "garbage"],
)
def test_the_proxy_kills_a_child_that_breaks_its_pipe(action: int, sent: str) -> None:
    """Killed (SIGKILL), not asked to exit: the child may still be writing, or waiting for
    a job; the job is answered as the child's death (``faulted``: the policy applies)."""
    import outcome

    from rlmesh_trio._jobs import StepJob
    from rlmesh_trio._lanes._process import ChildLane, LaneProcessDiedError

    child = ChildLane(pipe_liar.make_pipe_liar, "warn", 3, 0)
    try:
        child.build()
        job = StepJob(leaves=[wire.i64([action])], n=1, row=0, validated=False, id=1)
        result, _, faulted = child.execute(job, 0)
        assert faulted
        assert isinstance(result, outcome.Error), result
        assert isinstance(result.error, LaneProcessDiedError)
        assert str(result.error).startswith(
            f"step failed: lane 3 process killed: lane pipe: the child {sent}"
        ), result.error
        assert child._process.returncode == -signal.SIGKILL
    finally:
        child.close()


def rss() -> int | None:
    """This process's resident set (bytes), where /proc tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (
            pipe_liar.LIE,
            re.escape(
                "step failed: lane 1 process killed: lane pipe: the child announced a "
                f"{pipe_liar.LIE_BYTES}-byte message; the cap is {PIPE_MESSAGE_CAP} bytes"
            ),
        ),
        (
            pipe_liar.GARBAGE,
            # the garbage alone in a read, or the child's real answer right behind it
            r"step failed: lane 1 process killed: lane pipe: the child sent "
            rf"(a {len(pipe_liar.GARBAGE_BODY)}-byte message that does not unpickle "
            rf"\(UnpicklingError: .*\)|\d+ bytes past a {len(pipe_liar.GARBAGE_BODY)}-byte "
            r"message)",
        ),
        (pipe_liar.STALL, re.escape("env.step timed out after 1000ms")),  # the watchdog
    ],
    ids=["lie", "garbage", "stall"],
)
async def test_a_child_that_breaks_its_pipe_is_killed_and_its_lane_rebuilt(
    action: int, expected: str
) -> None:
    """Env code in a child writes to its lane's socket: a 1 GiB length (the server once
    allocated it at once, per lane), a message that does not unpickle, a length under the
    cap for bytes that never come. The step is answered as for a crashed child, the child
    is killed, the lane is rebuilt and serves again, and the server's memory did not grow."""

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            before = rss()
            tracemalloc.start()
            try:
                out["broke"] = await j.call(wire.step(acts(action), env_indices=[1]))
                out["peak"] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            after = rss()
            out["rss"] = None if before is None or after is None else after - before
            out["other"] = await j.call(wire.step(acts(pipe_liar.HONEST), env_indices=[0]))
            out["again"] = await j.call(wire.reset(seeds=[3], env_indices=[1]))
            out["step"] = await j.call(wire.step(acts(pipe_liar.HONEST, pipe_liar.HONEST)))
        return out

    async with served(
        num_envs=2,
        factory=pipe_liar.make_pipe_liar,
        on_lane_fault="rebuild",
        lane_timeout_seconds=1.0,
    ) as address:
        out = await on_wire(client(address))
        liar = pids(out["reset"])[1]
        await wait_gone([liar])  # killed, not left running (also for the lie and garbage)
    code, message, recoverable = error(out["broke"])
    assert (code, recoverable) == (Code.CRASHED, True)
    assert re.fullmatch(
        f"{expected} \\(lane 1 faulted and was rebuilt: reset it to go on\\)", message
    ), message
    assert out["peak"] < 64 << 20, out["peak"]
    if out["rss"] is not None:
        assert out["rss"] < 64 << 20, out["rss"]
    assert out["other"].step is not None, out["other"]
    fresh = pids(out["again"])[0]
    assert fresh != liar
    assert pids(out["step"]) == [pids(out["reset"])[0], fresh]


async def test_steps_and_resets_are_written_to_the_child_by_the_poster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lane waiting for work has its next step or reset written to its child by the
    thread that posts it (the child runs it while the lane thread wakes); what is too big
    for that (the echo env's 1.25 MiB actions) is sent by the lane thread. Both are
    answered the same, and a child that dies on a job written ahead is a dead child."""
    from rlmesh_trio._lanes._process import ChildLane

    counts = {"ahead": 0, "declined": 0}
    send_ahead = ChildLane.send_ahead

    def counted(self: ChildLane, job: Any) -> bool:
        sent = send_ahead(self, job)
        counts["ahead" if sent else "declined"] += 1
        return sent

    monkeypatch.setattr(ChildLane, "send_ahead", counted)

    async def crashy_client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            out["steps"] = [await j.call(wire.step(acts(OK, OK))) for _ in range(5)]
            out["death"] = await j.call(wire.step(acts(SEGFAULT), env_indices=[1]))
            out["other"] = await j.call(wire.step(acts(OK), env_indices=[0]))
        return out

    async with served(num_envs=2) as address:
        out = await on_wire(crashy_client(address))
    children = pids(out["reset"])
    assert all(pids(step) == children for step in out["steps"])
    assert error(out["death"]) == (
        Code.INTERNAL,
        "step failed: lane 1 process died (SIGSEGV)",
        False,
    )
    assert out["other"].step is not None
    assert counts == {"ahead": 2 + 5 * 2 + 1 + 1, "declined": 0}

    from support.envs import EchoEnv, make_echo

    big = np.arange(np.prod(EchoEnv.SHAPE), dtype=np.uint64).astype(np.uint8).reshape(EchoEnv.SHAPE)

    async def echo_client(address: str) -> tuple[env_v1.JoinResponse, env_v1.JoinResponse]:
        async with wire.WireClient(address) as c, c.join() as j:
            reset = await j.call(wire.reset(seeds=[0]))
            return reset, await j.call(wire.step([big.tobytes()]))

    counts.update(ahead=0, declined=0)
    async with served(num_envs=1, factory=make_echo) as address:
        reset, step = await on_wire(echo_client(address))
    assert reset.reset is not None and step.step is not None, step
    assert step.step.observation.leaves[0] == big.tobytes()
    assert counts == {"ahead": 1, "declined": 1}


async def test_a_job_written_ahead_when_the_lane_stops_is_answered_with_its_result(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lane stops between a step being written to its child and the lane thread
    taking it: the child runs it anyway, so the lane thread reads the child's answer and
    gives it (not ``stopped before answering``), and the child then exits when asked
    (its answer does not sit unread in the pipe)."""
    from rlmesh_trio._lanes._lane import Lane

    post_ahead = Lane.post_ahead
    stopped: list[int] = []

    def post_then_stop(self: Lane, job: Any) -> None:
        post_ahead(self, job)
        if self.ahead is not None and self.index == 1:  # the lock is held: as a close would
            self.close_mailbox()
            stopped.append(self.index)

    async def client(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with wire.WireClient(address) as c, c.join() as j:
            out["reset"] = await j.call(wire.reset(seeds=[1, 2]))
            monkeypatch.setattr(Lane, "post_ahead", post_then_stop)
            out["step"] = await j.call(wire.step(acts(OK), env_indices=[1]))
        return out

    async with served(num_envs=2) as address:
        out = await on_wire(client(address))
    assert stopped == [1]
    assert out["step"].step is not None, out["step"]
    assert pids(out["step"]) == pids(out["reset"])[1:]
    assert not [r for r in caplog.records if "did not exit" in r.getMessage()]
    await wait_gone(pids(out["reset"]))
