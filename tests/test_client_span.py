"""Clients made by id and vectors over several endpoints (issue 40), against both servers
(the reference's "several endpoints" are several ``rlmesh.EnvServer`` in one process):

* ``RLMESH_TRIO_ADDRESS`` gives ``gymnasium.make`` / ``make_vec`` their address; from a
  list, whole endpoints are gathered in list order, a BUSY one passed over at once, and
  a count the free endpoints cannot make up is refused naming every endpoint;
* one ``VectorEnv`` over several endpoints is ``SyncVectorEnv`` over the same envs in
  every autoreset mode, its pool hands out the first lanes to finish on any endpoint,
  and an endpoint lost is named (the others closed);
* the Trio client takes a list and the variable too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from support import envs
from support.refserver import ServerConfig, ServerPool
from test_client_gym import CASES, MODES, WireInfos, drive, same
from test_client_pool import UNEVEN, alone, drive_lanes, lane_results

import rlmesh_trio  # noqa: F401  (registers rlmesh_trio/Remote-v0)
from rlmesh_trio.client import (
    ConnectionLostError,
    EndpointsUnavailableError,
    Env,
    EnvError,
    ErrorCode,
    RpcError,
    VectorEnv,
    open_endpoint,
)
from rlmesh_trio.client._gather import ADDRESS_VARIABLE, Gathering, addresses_of

pytestmark = [pytest.mark.interop, pytest.mark.timeout(240)]

KINDS = ["ref", "ours"]
ID = "rlmesh_trio/Remote-v0"
BOUND = 30.0
"""Bound (seconds) on any retry loop of these tests: they fail, never hang."""


@contextlib.contextmanager
def variable(monkeypatch: pytest.MonkeyPatch, addresses: list[str]) -> Iterator[None]:
    monkeypatch.setenv(ADDRESS_VARIABLE, ",".join(addresses))
    yield


def closed_port() -> str:
    """An address nothing listens on (a port bound, then closed)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def retrying_busy(make: Any) -> Any:
    """``make()``, retried while its endpoint has not yet freed its last session (the
    reference frees its one Join slot in its own time after a client's Close)."""
    deadline = time.monotonic() + BOUND
    while True:
        try:
            return make()
        except (EndpointsUnavailableError, RpcError) as exc:
            if exc.code != ErrorCode.BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ------------------------------------------------------------------- the rule, no IO


def test_addresses_of_the_argument_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADDRESS_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=f"no address: pass address=.*set {ADDRESS_VARIABLE}"):
        addresses_of(None)
    monkeypatch.setenv(ADDRESS_VARIABLE, " tcp://127.0.0.1:1 , unix:///tmp/x.sock ")
    assert addresses_of(None) == ["tcp://127.0.0.1:1", "unix:///tmp/x.sock"]
    # An explicit address wins over the variable; a list or one comma-separated string.
    assert addresses_of("tcp://h:2") == ["tcp://h:2"]
    assert addresses_of(["tcp://h:2", "tcp://h:3"]) == ["tcp://h:2", "tcp://h:3"]
    for bad in ("tcp://h:2,,tcp://h:3", ",", "tcp://h:2,tcp://h:2"):
        with pytest.raises(ValueError):
            addresses_of(bad)
    monkeypatch.setenv(ADDRESS_VARIABLE, "   ")
    with pytest.raises(ValueError, match="no address"):
        addresses_of(None)
    with pytest.raises(TypeError):
        addresses_of(5)  # type: ignore[arg-type]


def test_gathering_takes_whole_endpoints_in_order() -> None:
    g = Gathering(["a", "b", "c", "d"], 4)
    g.refused("a", "busy")
    assert not g.offered("b", 8)  # more than is wanted: passed over
    assert g.offered("c", 3) and not g.done
    assert g.offered("d", 1) and g.done
    g.check()
    short = Gathering(["a", "b"], 2)
    short.refused("a", "busy: taken")
    assert short.offered("b", 1)
    with pytest.raises(EndpointsUnavailableError) as caught:
        short.check()
    assert caught.value.reasons == {"a": "busy: taken"}
    assert "cannot gather 2 lanes from 2 endpoints (1 held" in str(caught.value)
    every = Gathering(["a", "b"], None)
    assert every.offered("a", 5) and every.offered("b", 7)
    every.check()


# -------------------------------------------------------------- gymnasium.make by id


@pytest.mark.parametrize("kind", KINDS)
def test_make_by_id_takes_one_lane_endpoints_in_order(
    servers: ServerPool, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CleanRL's way: ``gym.make(env_id)`` once per env, nothing but the variable. The
    N clients take endpoints 0..N-1 in order, so seeds land where a local run puts
    them; one more is refused naming every endpoint; a closed one is taken again."""
    server = servers.get(kind, ServerConfig(num_envs=1, endpoints=3))  # type: ignore[arg-type]
    monkeypatch.setenv(ADDRESS_VARIABLE, ",".join(server.addresses))
    made = [gym.make(ID) for _ in range(3)]
    try:
        # Made, they hold nothing yet (a Handshake read the spaces); reset in turn, as
        # SyncVectorEnv and DummyVecEnv do, each takes the next endpoint.
        assert [env.unwrapped.address for env in made] == [None] * 3
        local = [envs.make_cartpole() for _ in range(3)]
        for i, (remote, mine) in enumerate(zip(made, local, strict=True)):
            same(mine.reset(seed=10 + i)[0], remote.reset(seed=10 + i)[0])
            for action in (0, 1, 1, 0):
                same(mine.step(action)[:4], remote.step(action)[:4])
        assert [env.unwrapped.address for env in made] == server.addresses
        extra = gym.make(ID)  # spaces only: made while every endpoint is taken
        try:
            with pytest.raises(EndpointsUnavailableError) as caught:
                extra.reset(seed=0)
        finally:
            extra.close()
        message = str(caught.value)
        for address in server.addresses:
            assert f"{address}: busy: another client holds its Join session" in message
        made[1].close()
        again = gym.make(ID)
        made[1] = again
        retrying_busy(lambda: again.reset(seed=0))
        assert again.unwrapped.address == server.addresses[1]
    finally:
        for env in made:
            env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_make_vec_clients_take_one_endpoint_each(
    servers: ServerPool, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``make_vec(num_envs=2)`` over two 2-lane endpoints take one each; a third is
    refused; one ``make_vec(num_envs=4)`` over the same list spans both."""
    server = servers.get(kind, ServerConfig(num_envs=2, endpoints=2))  # type: ignore[arg-type]
    monkeypatch.setenv(ADDRESS_VARIABLE, ",".join(server.addresses))
    first = gym.make_vec(ID, num_envs=2)
    try:
        second = gym.make_vec(ID, num_envs=2)
        try:
            assert first.unwrapped.addresses == server.addresses[:1]
            assert second.unwrapped.addresses == server.addresses[1:]
            with pytest.raises(EndpointsUnavailableError, match="cannot gather 2 lanes"):
                gym.make_vec(ID, num_envs=2)
        finally:
            second.close()
    finally:
        first.close()
    both = retrying_busy(lambda: gym.make_vec(ID, num_envs=4))
    try:
        assert both.num_envs == 4 and both.unwrapped.addresses == server.addresses
    finally:
        both.close()


def test_a_count_the_list_cannot_make_up_names_every_endpoint(
    servers: ServerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = servers.get("ours", ServerConfig(num_envs=1))
    two = servers.get("ours", ServerConfig(num_envs=2))
    nowhere = closed_port()
    holder = Env(one.address)
    holder.reset(seed=0)  # the session is taken at the first reset
    try:
        monkeypatch.setenv(ADDRESS_VARIABLE, f"{one.address},{nowhere},{two.address}")
        with pytest.raises(EndpointsUnavailableError) as caught:
            gym.make(ID).reset()
        reasons = caught.value.reasons
        assert list(reasons) == [one.address, nowhere, two.address]
        assert reasons[one.address].startswith("busy")
        assert reasons[nowhere].startswith("unreachable: cannot connect to")
        assert reasons[two.address].startswith("serves 2 lanes, 1 lane was still wanted")
        # What it opened on the way was closed: the 2-lane endpoint admits a client now.
        VectorEnv(two.address).close()
        # An explicit address wins over the variable.
        monkeypatch.setenv(ADDRESS_VARIABLE, nowhere)
        VectorEnv(address=[two.address]).close()
    finally:
        holder.close()


def test_no_address_anywhere_says_how_to_give_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADDRESS_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=f"set {ADDRESS_VARIABLE}"):
        gym.make(ID)
    with pytest.raises(ValueError, match=f"set {ADDRESS_VARIABLE}"):
        gym.make_vec(ID, num_envs=2)


# -------------------------------------------------------- one vector, many endpoints


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("case", ["cartpole", "nested", "frozenlake"])
@pytest.mark.parametrize("kind", KINDS)
def test_vector_over_endpoints_equals_sync_vector_env(
    servers: ServerPool, kind: str, case: str, mode: AutoresetMode
) -> None:
    """Three endpoints of two lanes: one vector of six, ``SyncVectorEnv``'s transcript
    (rewards, flags, ``final_obs`` / ``final_info``, infos and their masks) exactly."""
    entrypoint, factory, _, steps = CASES[case]
    server = servers.get(kind, ServerConfig(entrypoint=entrypoint, num_envs=2, endpoints=3))  # type: ignore[arg-type]
    remote = VectorEnv(server.addresses, autoreset_mode=mode)
    local = SyncVectorEnv([lambda: WireInfos(factory()) for _ in range(6)], autoreset_mode=mode)
    try:
        assert remote.num_envs == 6 and remote.addresses == server.addresses
        remote.action_space.seed(9)
        actions = [remote.action_space.sample() for _ in range(steps)]
        same(drive(local, mode, actions, seed=4), drive(remote, mode, actions, seed=4))
    finally:
        remote.close()
        local.close()


def test_uneven_endpoints_of_both_servers_make_one_vector(servers: ServerPool) -> None:
    """A one-lane reference endpoint beside a three-lane one of ours: four lanes."""
    ref = servers.get("ref", ServerConfig(num_envs=1))
    ours = servers.get("ours", ServerConfig(num_envs=3))
    remote = VectorEnv(f"{ref.address},{ours.address}", num_envs=4)
    local = SyncVectorEnv([lambda: WireInfos(envs.make_cartpole()) for _ in range(4)])
    try:
        remote.action_space.seed(2)
        actions = [remote.action_space.sample() for _ in range(120)]
        mode = AutoresetMode.NEXT_STEP
        same(drive(local, mode, actions, seed=30), drive(remote, mode, actions, seed=30))
        # Seeds per lane, a reset mask crossing both endpoints, render (none served).
        seeds: list[int | None] = [1, None, 3, None]
        same(local.reset(seed=seeds)[0][[0, 2]], remote.reset(seed=seeds)[0][[0, 2]])
        mask = np.array([False, True, True, False])
        same(
            local.reset(seed=5, options={"reset_mask": mask.copy()})[0],
            remote.reset(seed=5, options={"reset_mask": mask.copy()})[0],
        )
        assert remote.render() is None
    finally:
        remote.close()
        local.close()
    # The servers' episode reports, in the vector's lane numbers (the second endpoint's
    # lanes 0..2 are the vector's 1..3).
    assert {e.env_index for e in remote.final_episodes} == {0, 1, 2, 3}


def test_endpoints_serving_different_envs_are_refused(servers: ServerPool) -> None:
    cartpole = servers.get("ours", ServerConfig(num_envs=1))
    nested = servers.get("ours", ServerConfig(entrypoint="support.envs:make_nested"))
    with pytest.raises(ValueError, match="must serve the same env"):
        VectorEnv([cartpole.address, nested.address])
    # Both were closed: each admits a client at once.
    VectorEnv([cartpole.address]).close()
    VectorEnv([nested.address]).close()


@pytest.mark.parametrize("kind", KINDS)
def test_pool_across_endpoints_each_lane_is_its_env_alone(servers: ServerPool, kind: str) -> None:
    """``send`` / ``recv`` with batches of two over two endpoints of uneven lanes: every
    lane's own trajectory is its env's alone, batches name the vector's lanes."""
    server = servers.get(kind, dataclasses.replace(UNEVEN, num_envs=2, endpoints=2))  # type: ignore[arg-type]
    rng = np.random.default_rng(5)
    actions = {lane: [int(a) for a in rng.integers(0, 2, 50)] for lane in range(4)}
    env = VectorEnv(server.addresses, batch_size=2)
    try:
        assert env.batch_size == 2
        env.async_reset(seed=60)
        first = lane_results(env.recv()) + lane_results(env.recv())
        trajectories, batches = drive_lanes(env.send, env.recv, first, actions)
        with pytest.raises(RuntimeError, match="batch_size=2 < num_envs"):
            env.step(np.zeros(4, np.int64))
    finally:
        env.close()
    assert all(len(b) <= 2 and b == sorted(b) for b in batches)
    assert {lane for b in batches for lane in b} == {0, 1, 2, 3}
    for lane in range(4):
        expected = alone(envs.make_cartpole, AutoresetMode.NEXT_STEP, 60 + lane, actions[lane])
        same(expected, trajectories[lane])


def test_recv_across_endpoints_returns_the_lanes_that_finish_first(servers: ServerPool) -> None:
    server = servers.get("ours", ServerConfig(entrypoint="support.envs:make_slow", endpoints=3))
    env = VectorEnv(server.addresses, batch_size=1)
    try:
        env.async_reset()
        assert sorted(int(env.recv()[4]["env_id"][0]) for _ in range(3)) == [0, 1, 2]
        # Lane 0 (the first endpoint) sleeps 2 s: the other endpoints' lanes come first.
        env.send(np.array([20, 0, 0]))
        assert {int(env.recv()[4]["env_id"][0]) for _ in range(2)} == {1, 2}
        _obs, rewards, *_, infos = env.recv()
        assert infos["env_id"].tolist() == [0] and rewards.tolist() == [20.0]
        with pytest.raises(RuntimeError, match="no lane is in flight"):
            env.recv()
    finally:
        env.close()


def test_an_endpoint_lost_is_named_and_the_others_are_closed(servers: ServerPool) -> None:
    doomed = servers.fresh("ours", ServerConfig(num_envs=2))
    kept = servers.get("ours", ServerConfig(num_envs=2))
    env = VectorEnv([kept.address, doomed.address])
    try:
        env.reset(seed=0)
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
        with pytest.raises(ConnectionLostError) as caught:
            env.step(np.zeros(4, np.int64))
        assert f"the endpoint at {doomed.address} (lanes 2..3 of the vector) was lost" in str(
            caught.value
        )
        # The other endpoint's session ended cleanly: a new client is admitted at once.
        VectorEnv(kept.address).close()
    finally:
        env.close()


# ----------------------------------------------------------------------- Trio client


@pytest.mark.parametrize("kind", KINDS)
async def test_trio_client_takes_the_first_free_endpoint(
    servers: ServerPool, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = await trio.to_thread.run_sync(
        functools.partial(servers.get, kind, ServerConfig(num_envs=2, endpoints=2))
    )
    monkeypatch.setenv(ADDRESS_VARIABLE, ",".join(server.addresses))
    with trio.fail_after(BOUND):
        async with open_endpoint() as first, open_endpoint(num_envs=2) as second:
            assert first.num_envs == second.num_envs == 2
            obs = await second.reset(seeds=[1, 2])
            local = [envs.make_cartpole() for _ in range(2)]
            same(np.stack([e.reset(seed=s)[0] for e, s in zip(local, (1, 2), strict=True)]), obs[0])
            with pytest.raises(EndpointsUnavailableError, match="busy"):
                async with open_endpoint():
                    pass
        with pytest.raises(EndpointsUnavailableError, match="serves 2 lanes, 3 wanted"):
            async with open_endpoint(num_envs=3):
                pass


def test_a_wrong_action_over_endpoints_sends_nothing_and_the_vector_goes_on(
    servers: ServerPool,
) -> None:
    """An action that does not fit the space, or the wrong count of them, is refused on
    the client before any endpoint is sent a request; the vector steps on after it."""
    server = servers.get("ours", ServerConfig(num_envs=2, endpoints=2))
    remote = VectorEnv(server.addresses)
    local = SyncVectorEnv([lambda: WireInfos(envs.make_cartpole()) for _ in range(4)])
    try:
        same(local.reset(seed=3)[0], remote.reset(seed=3)[0])
        sent = [p.state.next_id() for p in remote._parts]
        with pytest.raises(EnvError) as wrong:
            remote.step([0, 1, {"not": "an action"}, 0])
        assert wrong.value.code == ErrorCode.INVALID_ACTION and wrong.value.is_recoverable
        with pytest.raises(ValueError, match="expected 4 actions, got 3"):
            remote.step([0, 1, 0])
        # No request was made by either refusal (each endpoint's next request id follows).
        after = [p.state.next_id() for p in remote._parts]
        assert [int(r.split("-")[1]) for r in after] == [int(r.split("-")[1]) + 1 for r in sent]
        actions = np.array([0, 1, 1, 0])
        same(local.step(actions)[:4], remote.step(actions)[:4])
    finally:
        remote.close()
        local.close()
