"""The blocking clients behave like a local env where a trainer leans on it (issue 30,
item 4): ``step()`` before the client's own ``reset()`` is gymnasium's ``ResetNeeded``
with nothing sent; a client dropped without ``close()`` frees the endpoint's one Join
session at once (reference counting, or a reference cycle the next client's constructor
collects); a constructor that raised holds nothing. Each "next client" here is admitted
at once (the reference: as soon as it has read the dropped client's close): an endpoint
refuses a second Join with FAILED_PRECONDITION while one is open.
The cycle collector is off in these tests (``no_gc``), so nothing is released by a
collection the test did not cause."""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from gymnasium.vector import AutoresetMode
from support import envs
from support.fuzz import BUSY_MESSAGE
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio import serve_env
from rlmesh_trio.client import EndpointError, Env, RpcError, VectorEnv

pytestmark = pytest.mark.timeout(120)

KINDS = [pytest.param("ref", marks=pytest.mark.interop), "ours"]
ID = "rlmesh_trio/Remote-v0"


@pytest.fixture
def no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


NOTICE_S = 10.0
"""How long the reference may refuse a next client while it learns of the dropped one:
the drop is a TCP close its tokio workers read on their own time. A session the client
failed to free stays refused forever (the collector is off), so a bound of seconds still
tells the two apart. Our server reads the close before it admits the next Join on the
same loop: no patience there."""


def admitted(address: str, lanes: int, *, patient: bool = False) -> None:
    """A new client of ``address`` joins at once (``patient``: as soon as the server has
    read the previous client's close, within :data:`NOTICE_S`), steps, then closes."""
    deadline = time.monotonic() + (NOTICE_S if patient else 0.0)
    while True:
        try:
            _join_once(address, lanes)
            return
        except RpcError as exc:
            if BUSY_MESSAGE not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)  # no event to wait on: the server's read of a close is not visible


def _join_once(address: str, lanes: int) -> None:
    if lanes == 1:
        one = Env(address)
        try:
            one.reset(seed=0)
            one.step(0)
        finally:
            one.close()
        return
    many = VectorEnv(address)
    try:
        many.reset(seed=0)
        many.step(np.zeros(lanes, np.int64))
    finally:
        many.close()


@contextlib.contextmanager
def nothing_sent(env: Env | VectorEnv) -> Iterator[None]:
    """Fail the test if ``env`` makes a request meanwhile (every request of the blocking
    driver takes an id from its Join state and is queued there)."""
    with pytest.MonkeyPatch.context() as patch:
        if isinstance(env, Env):  # every request of an Env goes through its session
            patch.setattr(env, "_joined", partial(_refused, "_joined"))
        for state in [] if isinstance(env, Env) else [p.state for p in env._parts]:
            for name in ("next_id", "submit", "submit_many"):
                patch.setattr(state, name, partial(_refused, name))
        yield


def _refused(name: str, *args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"a request was made ({name})")


# ---------------------------------------------------------------------- ResetNeeded


@pytest.mark.parametrize("kind", KINDS)
def test_step_before_this_clients_reset_is_reset_needed(servers: ServerPool, kind: str) -> None:
    """On a server an earlier client left with running episodes (which a step would have
    silently continued), and on a fresh one (where a step before any reset is a fatal
    error closing the connection): ``ResetNeeded``, nothing sent, the session intact."""
    used = servers.fresh(kind, ServerConfig(num_envs=2))  # type: ignore[arg-type]
    admitted(used.address, 2)
    fresh = servers.fresh(kind, ServerConfig(num_envs=2))  # type: ignore[arg-type]
    for address in (used.address, fresh.address):
        env = VectorEnv(address)
        local = gym.vector.SyncVectorEnv([envs.make_cartpole, envs.make_cartpole])
        try:
            with (
                nothing_sent(env),
                pytest.raises(gym.error.ResetNeeded, match=r"lanes \[0, 1\] were never reset"),
            ):
                env.step(np.zeros(2, np.int64))
            obs, _ = env.reset(seed=7)
            assert np.array_equal(obs, local.reset(seed=7)[0])
            ours, theirs = env.step(np.ones(2, np.int64)), local.step(np.ones(2, np.int64))
            assert np.array_equal(ours[0], theirs[0])
        finally:
            env.close()
            local.close()


@pytest.mark.parametrize("kind", KINDS)
def test_env_step_before_reset_is_reset_needed(servers: ServerPool, kind: str) -> None:
    server = servers.fresh(kind, ServerConfig(num_envs=1))  # type: ignore[arg-type]
    env = Env(server.address)
    try:
        with (
            nothing_sent(env),
            pytest.raises(gym.error.ResetNeeded, match="before this client's own reset"),
        ):
            env.step(0)
        obs, _ = env.reset(seed=2)
        assert np.array_equal(obs, envs.make_cartpole().reset(seed=2)[0])
        assert env.step(1)[1] == 1.0
    finally:
        env.close()


def test_a_lane_this_client_never_reset_is_reset_needed(servers: ServerPool) -> None:
    """Resetting some lanes (``async_reset(env_indices=...)``) is not resetting all."""
    address = servers.get("ours", ServerConfig(num_envs=3)).address
    env = VectorEnv(address)
    try:
        env.async_reset(seed=1, env_indices=[0, 2])
        env.recv()
        with (
            nothing_sent(env),
            pytest.raises(gym.error.ResetNeeded, match=r"lanes \[1\] were never reset"),
        ):
            env.step(np.zeros(3, np.int64))
        env.async_reset(env_indices=[1])
        env.recv()
        env.step(np.zeros(3, np.int64))
    finally:
        env.close()


# ---------------------------------------------------------------------- garbage


def _vector(address: str) -> Any:
    return VectorEnv(address)


def _one(address: str) -> Any:
    return Env(address)


def _made(address: str) -> Any:
    return gym.make(ID, address=address)


def _made_vec(address: str) -> Any:
    return gym.make_vec(ID, num_envs=2, address=address, autoreset_mode="SameStep")


MAKERS: dict[str, tuple[Callable[[str], Any], int]] = {
    "VectorEnv": (_vector, 2),
    "Env": (_one, 1),
    "make": (_made, 1),
    "make_vec": (_made_vec, 2),
}


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_dropped_client_frees_the_session_at_once(
    servers: ServerPool, kind: str, maker: str
) -> None:
    """Reference counting frees a dropped client (no cycle of the client's own: a
    ``VectorEnv`` and its pool used to hold each other, and the session stayed until a
    collection) and its finalizer drops the connection."""
    make, lanes = MAKERS[maker]
    address = servers.get(kind, ServerConfig(num_envs=lanes)).address  # type: ignore[arg-type]
    env = make(address)
    env.reset(seed=0)
    env.step(env.action_space.sample())
    gone = weakref.ref(env.unwrapped)
    del env
    assert gone() is None
    admitted(address, lanes, patient=kind == "ref")


@pytest.mark.usefixtures("no_gc")
def test_a_client_in_a_reference_cycle_is_collected_by_the_next_one(
    servers: ServerPool,
) -> None:
    address = servers.get("ours", ServerConfig(num_envs=2)).address
    holder: dict[str, Any] = {"env": VectorEnv(address)}
    holder["self"] = holder
    holder["env"].reset(seed=0)
    gone = weakref.ref(holder["env"])
    del holder
    assert gone() is not None  # garbage that only the cycle collector frees
    admitted(address, 2)  # its constructor collects it: the finalizer drops the session
    assert gone() is None


class PickyWrapper(gym.vector.VectorWrapper):
    """A trainer's wrapper that refuses NEXT_STEP in its constructor (TorchRL's
    ``GymWrapper`` wants DISABLED or SAME_STEP), after building a reference cycle, as
    such libraries' objects do."""

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env)
        self._callbacks = [self.close]  # the wrapper refers to itself
        if env.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP:
            raise ValueError("NEXT_STEP autoreset is not supported")


@pytest.mark.usefixtures("no_gc")
def test_a_client_whose_wrapper_raised_in_its_constructor(servers: ServerPool) -> None:
    """The issue's case: ``Wrapper(VectorEnv(address))`` raised and the VectorEnv was
    never closed; the next client got FAILED_PRECONDITION until ``gc.collect()``."""
    address = servers.get("ours", ServerConfig(num_envs=2)).address
    message = ""
    try:
        PickyWrapper(VectorEnv(address))
    except ValueError as exc:
        message = str(exc)
    assert message == "NEXT_STEP autoreset is not supported"
    envs_ = PickyWrapper(VectorEnv(address, autoreset_mode=AutoresetMode.SAME_STEP))
    try:
        envs_.reset(seed=0)
        envs_.step(np.zeros(2, np.int64))
    finally:
        envs_.close()


def test_a_client_in_use_is_never_collected(servers: ServerPool) -> None:
    """The next client of an endpoint whose session is held by a live client is refused,
    and the live one goes on."""
    address = servers.get("ours", ServerConfig(num_envs=2)).address
    first = VectorEnv(address)
    try:
        first.reset(seed=0)
        with pytest.raises(RpcError, match="FAILED_PRECONDITION: environment already has"):
            VectorEnv(address)
        first.step(np.zeros(2, np.int64))
    finally:
        first.close()
    admitted(address, 2)


async def test_a_client_dropped_on_its_servers_own_thread_does_not_wait_for_it(
    no_gc: None,
) -> None:
    """The finalizer runs on whatever thread drops the last reference -- here the Trio
    thread that runs the server. It sends nothing it would wait for (a Close round trip
    would wait for a server that cannot answer until the finalizer returns)."""
    box: list[Any] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(serve_env, envs.make_cartpole, num_envs=2, address="tcp://127.0.0.1:0")
            )
            # In a worker thread (the client blocks), kept in ``box`` only: no worker
            # holds a reference once it returns.
            await trio.to_thread.run_sync(
                lambda: box.append(VectorEnv(server.address, close_timeout_seconds=5))
            )
            await trio.to_thread.run_sync(lambda: box[0].reset(seed=0))
            env = box.pop()
            gone = weakref.ref(env)
            start = time.perf_counter()
            del env  # here, on the server's thread
            took = time.perf_counter() - start
            assert gone() is None
            assert took < 1.0, took
            await trio.to_thread.run_sync(admitted, server.address, 2)
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- constructors


def _num_envs_mismatch(address: str) -> Any:
    return gym.make_vec(ID, num_envs=3, vectorization_mode="vector_entry_point", address=address)


def _env_of_two_lanes(address: str) -> Any:
    return Env(address)


def _render_mode_mismatch(address: str) -> Any:
    return VectorEnv(address, render_mode="rgb_array")


def _batch_size_too_large(address: str) -> Any:
    return VectorEnv(address, batch_size=3)


FAILING: dict[str, tuple[Callable[[str], Any], str]] = {
    "num_envs": (_num_envs_mismatch, "num_envs=3, but the endpoint"),
    "Env of 2 lanes": (_env_of_two_lanes, "2 lanes; use VectorEnv"),
    "render_mode": (_render_mode_mismatch, "render_mode='rgb_array', but"),
    "batch_size": (_batch_size_too_large, r"batch_size must be in 1\.\.num_envs=2"),
}


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("case", sorted(FAILING))
def test_a_constructor_that_raised_holds_nothing(servers: ServerPool, case: str) -> None:
    """Even while its exception -- whose traceback holds the half-built client -- is
    still alive (as a REPL keeps the last one)."""
    address = servers.get("ours", ServerConfig(num_envs=2)).address
    build, message = FAILING[case]
    with pytest.raises(ValueError, match=message) as info:
        build(address)
    admitted(address, 2)
    assert info.value.__traceback__ is not None


# ---------------------------------------------------------------------- fork


def _in_forked_child(env: VectorEnv) -> int:
    """What a forked child does with its parent's client: use it (refused, nothing
    written), then drop it and collect (nothing written either). Its exit code."""
    try:
        env.step(np.zeros(2, np.int64))
    except EndpointError as exc:
        code = 0 if "opened by the parent process" in str(exc) else 4
    else:
        code = 3
    del env
    gc.collect()
    return code


def test_a_forked_child_leaves_the_parents_session_alone(servers: ServerPool) -> None:
    """``AsyncVectorEnv``'s fork workers (TorchRL's ``GymEnv(num_envs=N)``) inherit the
    parent's open clients: the child closes its copies without writing a byte (a GOAWAY
    from there ended the parent's session), and refuses to use them."""
    address = servers.get("ours", ServerConfig(num_envs=2)).address
    env = VectorEnv(address)
    try:
        env.reset(seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(_in_forked_child(env))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for _ in range(3):
            env.step(np.zeros(2, np.int64))
    finally:
        env.close()
