"""Prometheus metrics (``ServeOptions.metrics_address``): scraped over HTTP and checked
against the requests actually made."""

from __future__ import annotations

import asyncio
import functools
import re
import time
import urllib.request
from typing import Any

import pytest
import trio
from support import envs, wire

from rlmesh_trio import ServeOptions, serve_env

pytestmark = pytest.mark.timeout(60)

pytest.importorskip("prometheus_client")


def scrape(address: str) -> dict[str, float]:
    url = "http" + address[3:] + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def drive(address: str) -> None:
    async with wire.WireClient(address) as client:
        async with client.join() as join:
            await join.call(wire.reset(seeds=[1, 2, 3]))
            for _ in range(5):
                await join.call(wire.step([wire.i64([0, 1, 0])]))
            for _ in range(4):
                await join.call(wire.step([wire.i64([1])], env_indices=[2]))
            await join.call(wire.step([wire.i64([7])], env_indices=[1]))  # Discrete(2): refused
            await join.call(wire.step([wire.i64([0])], env_indices=[9]))  # no such lane
            await join.send(wire.close())
            while await join.recv() is not None:
                pass
        async with client.join() as second:
            await second.call(wire.configure())
            async with client.join() as third:  # one Join at a time: refused
                await third.send(wire.configure())
                await third.recv()


async def test_metrics_count_what_was_served() -> None:
    options = ServeOptions(metrics_address="tcp://127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, envs.make_cartpole, num_envs=3, options=options)
        )
        assert info.metrics_address is not None
        assert info.metrics_address.startswith("tcp://127.0.0.1:")
        before = await trio.to_thread.run_sync(scrape, info.metrics_address)
        await trio.to_thread.run_sync(asyncio.run, drive(info.address))
        after = await trio.to_thread.run_sync(scrape, info.metrics_address)
        nursery.cancel_scope.cancel()
    assert before['rlmesh_trio_lane_steps_total{lane="0"}'] == 0
    assert after['rlmesh_trio_lane_resets_total{lane="0"}'] == 1
    assert after['rlmesh_trio_lane_steps_total{lane="0"}'] == 5
    assert after['rlmesh_trio_lane_steps_total{lane="1"}'] == 5
    assert after['rlmesh_trio_lane_steps_total{lane="2"}'] == 9
    assert after['rlmesh_trio_lane_errors_total{code="INVALID_ACTION",lane="1"}'] == 1
    assert after['rlmesh_trio_requests_rejected_total{code="INVALID_ACTION"}'] == 1
    assert after["rlmesh_trio_step_seconds_count"] == 9
    assert after["rlmesh_trio_env_step_seconds_count"] == 9
    assert after['rlmesh_trio_sessions_total{outcome="admitted"}'] == 2
    assert after['rlmesh_trio_sessions_total{outcome="refused"}'] == 1
    assert after["rlmesh_trio_received_bytes_total"] > 0
    assert after["rlmesh_trio_sent_bytes_total"] > 0
    assert after['rlmesh_trio_lane_rebuilds_total{lane="2"}'] == 0
    assert after["rlmesh_trio_queue_depth"] == 0
    build = [k for k in after if k.startswith("rlmesh_trio_build_info{")]
    assert build and re.search(r'env_id="CartPole-v1"', build[0])


async def test_an_env_failure_is_a_fault_of_its_lane() -> None:
    options = ServeOptions(metrics_address="tcp://127.0.0.1:0")

    async def boom(address: str) -> Any:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as join:
            return await join.call(wire.step([wire.i64([2])], env_indices=[1]))  # raises

    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, envs.make_boom, num_envs=2, options=options)
        )
        reply = await trio.to_thread.run_sync(asyncio.run, boom(info.address))
        after = await trio.to_thread.run_sync(scrape, info.metrics_address)
        nursery.cancel_scope.cancel()
    assert reply.error is not None
    assert after['rlmesh_trio_lane_faults_total{lane="1"}'] == 1
    assert after['rlmesh_trio_lane_faults_total{lane="0"}'] == 0
    assert after['rlmesh_trio_lane_errors_total{code="INTERNAL",lane="1"}'] == 1


async def test_the_lanes_supervision_counters_and_states() -> None:
    from support.faulty import HANG, RAISE, Controller, Factory

    ctl = Controller()
    options = ServeOptions(
        metrics_address="tcp://127.0.0.1:0",
        on_lane_fault="rebuild",
        lane_timeout_seconds=0.2,
    )

    async def faults(address: str) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as join:
            await join.call(wire.step([wire.i64([RAISE])], env_indices=[1]))
            await join.call(wire.reset(seeds=[3], env_indices=[1]))
            await join.call(wire.step([wire.i64([HANG])], env_indices=[0]))  # watchdog

    try:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(
                functools.partial(serve_env, Factory(ctl), num_envs=2, options=options)
            )
            await trio.to_thread.run_sync(asyncio.run, faults(info.address))
            after = await trio.to_thread.run_sync(scrape, info.metrics_address)
            nursery.cancel_scope.cancel()
    finally:
        ctl.release.set()
    assert after['rlmesh_trio_lane_faults_total{lane="1"}'] == 1
    assert after['rlmesh_trio_lane_rebuilds_total{lane="1"}'] == 1
    assert after['rlmesh_trio_lane_wedges_total{lane="0"}'] == 1
    assert after['rlmesh_trio_lane_wedges_total{lane="1"}'] == 0
    assert after['rlmesh_trio_lane_abandoned_threads{lane="0"}'] == 1
    assert after['rlmesh_trio_lane_state{lane="1",state="serving"}'] == 1
    assert after['rlmesh_trio_lane_state{lane="1",state="dead"}'] == 0


def test_the_metrics_address_must_be_tcp() -> None:
    from rlmesh_trio._options import resolve

    with pytest.raises(ValueError, match="metrics_address"):
        resolve(ServeOptions(metrics_address="unix:///tmp/m.sock"))


def _open_idle(address: str, count: int) -> list[Any]:
    import socket

    host, port = address[len("tcp://") :].rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


def _threads() -> int:
    import threading

    return threading.active_count()


@pytest.mark.timeout(120)
async def test_a_flood_of_idle_metrics_connections_holds_no_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 17, finding 5: 1,000 slow connections held 1,008 threads and, with the fd
    limit reached, starved the gRPC side. Now: at most METRICS_MAX_CONNECTIONS are
    served at once (the rest closed on accept), each idle one dropped after the socket
    timeout, and the gRPC side answers throughout."""
    from rlmesh_trio import _metrics

    monkeypatch.setattr(_metrics, "METRICS_SOCKET_TIMEOUT", 1.0)
    options = ServeOptions(metrics_address="tcp://127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, envs.make_cartpole, num_envs=1, options=options)
        )
        assert info.metrics_address is not None
        baseline = _threads()
        idle = await trio.to_thread.run_sync(_open_idle, info.metrics_address, 300)
        try:
            await trio.sleep(0.5)  # let the server accept them all (a bound, not a wait)
            assert _threads() <= baseline + _metrics.METRICS_MAX_CONNECTIONS + 2

            async def handshake() -> None:
                async with wire.WireClient(info.address) as client:
                    await client.handshake()

            await trio.to_thread.run_sync(asyncio.run, handshake())  # gRPC unaffected

            def closed_by_server(sock: Any) -> bool:
                sock.settimeout(10)
                try:
                    return sock.recv(1) == b""
                except OSError:
                    return True

            # Every idle connection is closed by the server: at once past the bound,
            # after the socket timeout within it.
            results = await trio.to_thread.run_sync(
                lambda: [closed_by_server(sock) for sock in idle]
            )
            assert all(results)
        finally:
            for sock in idle:
                sock.close()
        samples = await trio.to_thread.run_sync(scrape, info.metrics_address)
        assert samples['rlmesh_trio_lane_steps_total{lane="0"}'] == 0

        def threads_back_to(count: int) -> int:
            # Handler threads exit on their own: no event tells when, so poll (bounded).
            deadline = time.monotonic() + 30
            while _threads() > count and time.monotonic() < deadline:
                time.sleep(0.05)
            return _threads()

        assert await trio.to_thread.run_sync(threads_back_to, baseline + 1) <= baseline + 1
        nursery.cancel_scope.cancel()
