"""Several endpoints from one server process (issue 40): ``serve_env(..., endpoints=K)``
and ``rlmesh-trio serve --endpoints K``. Each endpoint is a plain rlmesh-wire-v1 endpoint
with its own session, shutdown and metrics; the addresses are consecutive ports (or
``name-k.sock``), all bound before any env is built; the CLI prints every one."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from support import envs, wire
from test_cli import read_ready
from test_serve import Recorder, in_thread, server_threads, shutdown

from rlmesh_trio import ServeOptions, ServerInfo, serve_env
from rlmesh_trio._address import TcpAddress, UnixAddress, endpoint_addresses
from rlmesh_trio.client import VectorEnv

pytestmark = pytest.mark.timeout(90)

BOUND = 30.0


def test_endpoint_addresses() -> None:
    assert endpoint_addresses(TcpAddress("::1", 5000), 3) == [
        TcpAddress("::1", 5000),
        TcpAddress("::1", 5001),
        TcpAddress("::1", 5002),
    ]
    assert endpoint_addresses(TcpAddress("127.0.0.1", 0), 2) == [TcpAddress("127.0.0.1", 0)] * 2
    assert endpoint_addresses(UnixAddress("/run/x/env.sock"), 2) == [
        UnixAddress("/run/x/env-0.sock"),
        UnixAddress("/run/x/env-1.sock"),
    ]
    assert endpoint_addresses(UnixAddress("/run/x/env"), 1) == [UnixAddress("/run/x/env")]
    with pytest.raises(ValueError, match="past 65535"):
        endpoint_addresses(TcpAddress("h", 65535), 2)


async def handshake(address: str) -> Any:
    async with wire.WireClient(address) as client:
        return await client.handshake()


async def test_k_endpoints_each_its_own_session_and_shutdown(tmp_path: Path) -> None:
    recorder = Recorder()
    options = ServeOptions(allow_remote_shutdown=True)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info: ServerInfo = await nursery.start(
                functools.partial(serve_env, recorder, num_envs=2, endpoints=3, options=options)
            )
            assert len(info.addresses) == 3 and info.address == info.addresses[0]
            assert len(set(info.addresses)) == 3
            assert recorder.built == 6  # every endpoint's lanes built before started()
            for address in info.addresses:
                reply = await in_thread(handshake(address))
                assert reply.env_contract.num_envs == 2

            def three_clients() -> list[Any]:
                # Three clients at once, one per endpoint, each its own env's answers.
                clients = [VectorEnv(address) for address in info.addresses]
                try:
                    return [c.reset(seed=7 + i)[0] for i, c in enumerate(clients)]
                finally:
                    for c in clients:
                        c.close()

            observations = await trio.to_thread.run_sync(three_clients)
            for i, obs in enumerate(observations):
                local = [envs.make_cartpole() for _ in range(2)]
                expected = np.stack([e.reset(seed=7 + i + j)[0] for j, e in enumerate(local)])
                assert np.array_equal(obs, expected)
            # A Shutdown stops its own endpoint only.
            reply = await in_thread(shutdown(info.addresses[1]))
            assert reply.base.accepted
            deadline = trio.current_time() + BOUND
            while recorder.closed < 2:
                assert trio.current_time() < deadline
                await trio.sleep(0.02)
            for address in (info.addresses[0], info.addresses[2]):
                assert (await in_thread(handshake(address))).env_contract.num_envs == 2
            for address in (info.addresses[0], info.addresses[2]):
                assert (await in_thread(shutdown(address))).base.accepted
        # serve_env returned once every endpoint had stopped.
    assert recorder.closed == 6
    assert server_threads() == []


async def test_consecutive_ports_and_unix_sockets(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    if base > 65000:
        base = 40000 + base % 20000
    async with trio.open_nursery() as nursery:
        try:
            info = await nursery.start(
                functools.partial(
                    serve_env, "CartPole-v1", address=f"127.0.0.1:{base}", endpoints=2
                )
            )
        except OSError:
            pytest.skip(f"port {base} or {base + 1} was taken meanwhile")
        assert info.addresses == (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")
        unix = await nursery.start(
            functools.partial(
                serve_env, "CartPole-v1", address=f"unix://{tmp_path}/env.sock", endpoints=2
            )
        )
        assert unix.addresses == (
            f"unix://{tmp_path}/env-0.sock",
            f"unix://{tmp_path}/env-1.sock",
        )
        for address in unix.addresses:
            assert (await in_thread(handshake(address))).env_contract.num_envs == 1
        nursery.cancel_scope.cancel()
    assert not socket_files(tmp_path)  # every socket file removed at the stop


def socket_files(folder: Path) -> list[Path]:
    return list(folder.glob("*.sock"))


async def test_a_port_in_use_fails_before_any_env_is_built() -> None:
    recorder = Recorder()
    async with trio.open_nursery() as nursery:
        taken = await nursery.start(functools.partial(serve_env, "CartPole-v1"))
        port = int(taken.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="Address already in use"):
            await nursery.start(
                functools.partial(serve_env, recorder, address=f"127.0.0.1:{port - 1}", endpoints=2)
            )
        nursery.cancel_scope.cancel()
    assert recorder.built == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoints": 0}, "endpoints must be an int >= 1"),
        ({"endpoints": True}, "endpoints must be an int >= 1"),
        (
            {"endpoints": 2, "options": ServeOptions(record_video="/nonexistent/v")},
            "recording serves one endpoint per process",
        ),
    ],
)
async def test_bad_endpoint_counts_raise_before_any_env_is_built(
    kwargs: dict[str, Any], message: str
) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match=message):
        await serve_env(recorder, **kwargs)
    assert recorder.built == 0


async def test_a_failing_endpoint_stops_the_others_and_raises_plainly() -> None:
    built = 0

    def make() -> Any:
        nonlocal built
        built += 1
        if built == 3:  # the second endpoint's first lane
            raise RuntimeError("no env for you")
        return envs.make_cartpole()

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            with pytest.raises(RuntimeError, match="no env for you"):
                await nursery.start(functools.partial(serve_env, make, num_envs=2, endpoints=2))
    assert server_threads() == []


@pytest.mark.interop
async def test_rlmesh_run_drives_every_endpoint() -> None:
    """Each endpoint is a plain rlmesh-wire-v1 endpoint: rlmesh 0.1.0's runtime drives
    them at once, one run per endpoint."""
    rlmesh = pytest.importorskip("rlmesh")
    from rlmesh.numpy import Model

    def run(address: str, seeds: list[int]) -> Any:
        return rlmesh.run(Model(lambda o: int(o[2] > 0)), address, seeds=seeds)

    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, "CartPole-v1", num_envs=2, endpoints=2)
        )
        results: list[Any] = [None, None]

        async def one(k: int) -> None:
            results[k] = await trio.to_thread.run_sync(run, info.addresses[k], [k, k + 10])

        async with trio.open_nursery() as runs:
            for k in range(2):
                runs.start_soon(one, k)
        nursery.cancel_scope.cancel()
    for k, result in enumerate(results):
        assert sorted(e.seed for e in result.episodes) == [k, k + 10]
        assert all(e.steps > 0 for e in result.episodes)


def test_cli_prints_every_address_and_reports_them_on_the_ready_fd() -> None:
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh_trio",
            "serve",
            "--env",
            "CartPole-v1",
            "--endpoints",
            "3",
            "--ready-fd",
            str(write_fd),
        ],
        stderr=subprocess.PIPE,
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    try:
        addresses = read_ready(read_fd).split()
        assert len(addresses) == 3 and len(set(addresses)) == 3
        assert all(a.startswith("tcp://127.0.0.1:") for a in addresses)
        env = VectorEnv(addresses)
        try:
            assert env.num_envs == 3
            env.reset(seed=0)
        finally:
            env.close()
    finally:
        proc.send_signal(2)
        _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err.decode()
    lines = err.decode().splitlines()
    serving = [line for line in lines if line.startswith("rlmesh-trio: serving")]
    assert serving == [
        f"rlmesh-trio: serving CartPole-v1 x1 lane on {a} (endpoint {k} of 3)"
        for k, a in enumerate(addresses)
    ]
    assert f"rlmesh-trio: RLMESH_TRIO_ADDRESS={','.join(addresses)}" in lines


async def test_each_endpoint_serves_its_own_metrics() -> None:
    pytest.importorskip("prometheus_client")
    import urllib.request

    options = ServeOptions(metrics_address="127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, "CartPole-v1", endpoints=2, options=options)
        )
        assert len(info.metrics_addresses) == 2
        assert len(set(info.metrics_addresses)) == 2
        assert info.metrics_address == info.metrics_addresses[0]

        def scrape(address: str) -> str:
            with urllib.request.urlopen(f"http{address[3:]}/metrics", timeout=BOUND) as r:
                return str(r.read().decode())

        for address in info.metrics_addresses:
            text = await trio.to_thread.run_sync(scrape, address)
            assert "rlmesh_trio_lane_state" in text
        nursery.cancel_scope.cancel()
