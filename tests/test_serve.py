"""``serve_env``: startup (what ``nursery.start`` returns or raises), stop, and its bounds."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from gymnasium import spaces
from support import envs, wire

import rlmesh_trio
from rlmesh_trio import ContractMismatchError, ServeOptions, ServerInfo, serve_env

pytestmark = pytest.mark.timeout(60)

BOUND = 10.0


def server_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("rlmesh-trio-lane-", "rlmesh-trio-transport", "rlmesh-trio-metrics"))
    ]


class Recorder:
    """An env factory that counts the envs it built and closed."""

    def __init__(self, make: Any = envs.make_cartpole) -> None:
        self.make = make
        self.built = 0
        self.closed = 0
        self.kwargs: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, **kwargs: Any) -> gym.Env[Any, Any]:
        with self._lock:
            self.built += 1
            self.kwargs.append(kwargs)
        env = self.make()
        recorder = self
        original_close = env.close

        def close() -> None:
            with recorder._lock:
                recorder.closed += 1
            original_close()

        env.close = close  # type: ignore[method-assign]
        return env


async def in_thread(coro: Any) -> Any:
    return await trio.to_thread.run_sync(asyncio.run, coro)


def test_public_surface() -> None:
    # The errors a caller of serve_env can meet (startup); the rest stays internal.
    assert set(rlmesh_trio.__all__) == {
        "CodecError",
        "ContractMismatchError",
        "RlmeshTrioError",
        "ServeOptions",
        "ServerInfo",
        "UnsupportedSpaceError",
        "__version__",
        "serve_env",
    }
    for name in rlmesh_trio.__all__:
        assert hasattr(rlmesh_trio, name)


async def test_start_reports_the_resolved_address_and_cancel_stops_everything() -> None:
    recorder = Recorder()
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, recorder, num_envs=3, env_kwargs={"flavour": "x"})
        )
        assert isinstance(info, ServerInfo)
        match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", info.address)
        assert match is not None
        assert int(match.group(1)) > 0
        assert info.num_envs == 3
        assert info.env_id == "CartPole-v1"
        assert recorder.built == 3  # every lane built its env before started()
        assert recorder.kwargs == [{"flavour": "x"}] * 3

        async def handshake(address: str) -> Any:
            async with wire.WireClient(address) as client:
                return await client.handshake()

        reply = await in_thread(handshake(info.address))
        assert reply.env_contract.num_envs == 3
        nursery.cancel_scope.cancel()
    assert recorder.closed == 3
    assert server_threads() == []


@pytest.mark.parametrize("isolation", ["thread", "process"])
async def test_no_server_thread_is_alive_when_serving_returns(
    isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lane threads and the transport thread tell the Trio thread they ran their last
    # act, then still have to return: a slow tail (here 0.3 s) must not outlive serve_env.
    from rlmesh_trio._lanes._thread import LaneThreads
    from rlmesh_trio._transport._service import TransportService

    tails: list[str] = []

    def slow_tail(main: Any) -> Any:
        def run(*args: Any) -> None:
            main(*args)
            tails.append(threading.current_thread().name)
            time.sleep(0.3)

        return run

    monkeypatch.setattr(LaneThreads, "_main", slow_tail(LaneThreads._main))
    monkeypatch.setattr(TransportService, "_thread_main", slow_tail(TransportService._thread_main))
    options = ServeOptions(lane_isolation=isolation, metrics_address="tcp://127.0.0.1:0")
    # ... also while the embedding program's worker threads hold every token of Trio's
    # default thread limiter.
    default = trio.to_thread.current_default_thread_limiter()
    old, default.total_tokens = default.total_tokens, 1
    try:
        with trio.fail_after(BOUND):
            async with default, trio.open_nursery() as nursery:
                await nursery.start(
                    functools.partial(serve_env, "CartPole-v1", num_envs=2, options=options)
                )
                nursery.cancel_scope.cancel()
    finally:
        default.total_tokens = old
    assert sorted(tails) == ["rlmesh-trio-lane-0", "rlmesh-trio-lane-1", "rlmesh-trio-transport"]
    assert server_threads() == []


async def test_unix_socket_address(tmp_path: Path) -> None:
    path = tmp_path / "env.sock"
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, "CartPole-v1", address=f"unix://{path}")
        )
        assert info.address == f"unix://{path}"
        assert path.is_socket()

        async def handshake(address: str) -> Any:
            async with wire.WireClient(address) as client:
                return await client.handshake()

        assert (await in_thread(handshake(info.address))).base.compatible
        nursery.cancel_scope.cancel()
    assert not path.exists()


async def test_bad_env_id_raises_at_start() -> None:
    async with trio.open_nursery() as nursery:
        with pytest.raises(gym.error.Error, match="NoSuchEnv"):
            await nursery.start(functools.partial(serve_env, "NoSuchEnv-v9", num_envs=2))
    assert server_threads() == []


async def test_address_in_use_raises_before_any_env_is_built() -> None:
    recorder = Recorder()
    async with trio.open_nursery() as nursery:
        info = await nursery.start(functools.partial(serve_env, "CartPole-v1"))
        with pytest.raises(OSError, match="Address already in use"):
            await nursery.start(functools.partial(serve_env, recorder, address=info.address))
        nursery.cancel_scope.cancel()
    assert recorder.built == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"options": ServeOptions(drain_timeout_seconds=-1)}, "drain_timeout_seconds"),
        ({"options": ServeOptions(close_timeout_seconds=float("inf"))}, "close_timeout_seconds"),
        ({"options": ServeOptions(idle_timeout_seconds=0)}, "idle_timeout_seconds"),
        ({"options": ServeOptions(max_message_bytes=0)}, "max_message_bytes"),
        ({"options": ServeOptions(workflow_edition="1999.01")}, "not implemented"),
        ({"options": ServeOptions(on_lane_fault="retry")}, "on_lane_fault"),  # type: ignore[arg-type]
        ({"options": ServeOptions(lane_timeout_seconds=0)}, "lane_timeout_seconds"),
        ({"options": ServeOptions(lane_timeout_seconds=float("inf"))}, "lane_timeout_seconds"),
        ({"options": ServeOptions(max_abandoned_lanes=-1)}, "max_abandoned_lanes"),
        ({"options": ServeOptions(min_serving_lanes=0)}, "min_serving_lanes"),
        ({"options": ServeOptions(min_serving_lanes=True)}, "min_serving_lanes"),
        ({"options": ServeOptions(min_serving_lanes=3), "num_envs": 2}, "min_serving_lanes=3"),
        ({"options": ServeOptions(max_given_up_lanes=-1)}, "max_given_up_lanes"),
        ({"options": ServeOptions(max_given_up_lanes=False)}, "max_given_up_lanes"),
        ({"options": ServeOptions(max_given_up_lanes=1.0)}, "max_given_up_lanes"),  # type: ignore[arg-type]
        ({"options": ServeOptions(lane_isolation="fiber")}, "lane_isolation"),  # type: ignore[arg-type]
        ({"address": "http://x:1"}, "unsupported address scheme"),
        ({"num_envs": 0}, "num_envs"),
    ],
)
async def test_bad_arguments_raise_before_any_env_is_built(
    kwargs: dict[str, Any], message: str
) -> None:
    recorder = Recorder()
    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match=message):
            await nursery.start(functools.partial(serve_env, recorder, **kwargs))
    assert recorder.built == 0


async def test_options_must_be_serve_options() -> None:
    with pytest.raises(TypeError, match="ServeOptions"):
        await serve_env("CartPole-v1", options={"allow_remote_shutdown": True})  # type: ignore[arg-type]


class OtherSpacesEnv(gym.Env[np.ndarray, int]):
    def __init__(self, n: int) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Discrete(n)

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        return np.zeros(1, np.float32), {}

    def step(self, action: int) -> Any:
        return np.zeros(1, np.float32), 0.0, False, False, {}


async def test_contract_mismatch_raises_at_start() -> None:
    sizes = iter([2, 3])
    lock = threading.Lock()

    def make() -> OtherSpacesEnv:
        with lock:
            return OtherSpacesEnv(next(sizes))

    async with trio.open_nursery() as nursery:
        with pytest.raises(ContractMismatchError):
            await nursery.start(functools.partial(serve_env, make, num_envs=2))
    assert server_threads() == []


async def shutdown(address: str) -> Any:
    async with wire.WireClient(address) as client:
        return await client.shutdown("done")


async def test_returns_after_an_accepted_shutdown_enabled_by_env_var(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLMESH_ALLOW_REMOTE_SHUTDOWN", "TRUE")
    recorder = Recorder()
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(functools.partial(serve_env, recorder))
            reply = await in_thread(shutdown(info.address))
            assert reply.base.accepted
        # serve_env returned by itself: the nursery exited without a cancel.
    assert recorder.closed == 1
    assert server_threads() == []


async def test_shutdown_refused_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLMESH_ALLOW_REMOTE_SHUTDOWN", raising=False)
    async with trio.open_nursery() as nursery:
        info = await nursery.start(functools.partial(serve_env, "CartPole-v1"))
        reply = await in_thread(shutdown(info.address))
        assert not reply.base.accepted
        nursery.cancel_scope.cancel()


async def test_returns_after_the_idle_timeout() -> None:
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    serve_env, "CartPole-v1", options=ServeOptions(idle_timeout_seconds=0.2)
                )
            )
    assert server_threads() == []


@pytest.mark.parametrize("how", ["cancelled", "idle"])
async def test_every_stop_logs_its_reason(how: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rlmesh_trio.serve")
    idle = 0.2 if how == "idle" else None
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(
                    serve_env, "CartPole-v1", options=ServeOptions(idle_timeout_seconds=idle)
                )
            )
            if how == "cancelled":
                nursery.cancel_scope.cancel()
    stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("server stopped")]
    expected = "cancelled" if how == "cancelled" else "idle for 0.2 s"
    assert stops == [f"server stopped: {expected}"]
    assert server_threads() == []


async def test_cancel_drains_an_inflight_request_before_closing_the_lanes() -> None:
    recorder = Recorder(envs.make_slow)
    options = ServeOptions(drain_timeout_seconds=BOUND)
    got: dict[str, Any] = {}

    async def session(address: str) -> None:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([struct.pack("<q", 4)]))  # 0.4 s
            got["sent"].set()
            got["reply"] = await join.recv(timeout=BOUND)
            got["closed_when_replied"] = recorder.closed
            await join.send(wire.close())
            got["close"] = await join.recv(timeout=BOUND)

    got["sent"] = threading.Event()
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(functools.partial(serve_env, recorder, options=options))
            nursery.start_soon(in_thread, session(info.address))
            await trio.to_thread.run_sync(got["sent"].wait)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()  # while the step is in flight
    assert got["reply"] is not None
    assert got["reply"].step is not None
    assert got["closed_when_replied"] == 0  # the lanes were still up during the drain
    assert got["close"] is not None  # the open stream was still served during the drain
    assert recorder.closed == 1
    assert server_threads() == []


async def test_cancel_is_bounded_with_a_wedged_lane() -> None:
    release = threading.Event()
    drain, close = 0.2, 0.3
    options = ServeOptions(drain_timeout_seconds=drain, close_timeout_seconds=close)
    sent = threading.Event()

    async def wedge(address: str) -> Any:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([struct.pack("<q", 1)]))  # HangEnv: blocks
            sent.set()
            return await join.recv(timeout=BOUND)

    try:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                info = await nursery.start(
                    functools.partial(
                        serve_env, functools.partial(envs.HangEnv, release), options=options
                    )
                )
                outer.start_soon(in_thread, wedge(info.address))
                await trio.to_thread.run_sync(sent.wait)
                await trio.sleep(0.05)
                start = trio.current_time()
                nursery.cancel_scope.cancel()
            elapsed = trio.current_time() - start
        assert elapsed < drain + close + 6.0
        # The wedged lane was abandoned; nothing else is left.
        assert server_threads() in ([], ["rlmesh-trio-lane-0"])
    finally:
        release.set()


async def test_cancel_answers_a_request_that_outlives_the_drain() -> None:
    """SPEC §10.3: the env call in flight outlives the drain bound and is still answered
    (while the lanes close), then the lanes are closed and everything stops."""
    recorder = Recorder(envs.make_slow)
    options = ServeOptions(drain_timeout_seconds=0.1, close_timeout_seconds=BOUND)
    sent = threading.Event()
    got: dict[str, Any] = {}

    async def session(address: str) -> None:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([struct.pack("<q", 6)]))  # 0.6 s
            sent.set()
            got["reply"] = await join.recv(timeout=BOUND)
            got["after"] = await join.recv(timeout=BOUND)
            got["end"] = join.end

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(functools.partial(serve_env, recorder, options=options))
            nursery.start_soon(in_thread, session(info.address))
            await trio.to_thread.run_sync(sent.wait)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert got["reply"] is not None
    assert got["reply"].step is not None
    assert got["after"] is None
    assert got["end"].status is None
    assert recorder.closed == 1
    assert server_threads() == []


@pytest.mark.interop
async def test_rlmesh_run_drives_three_lanes() -> None:
    """The 0.1.0 runtime: lane-scoped requests, several in flight, out-of-order replies."""
    rlmesh = pytest.importorskip("rlmesh")
    from rlmesh.numpy import Model

    def run(address: str) -> Any:
        model = Model(lambda observation: int(observation[2] > 0))
        return rlmesh.run(model, address, seeds=[21, 22, 23, 24, 25])

    async with trio.open_nursery() as nursery:
        info = await nursery.start(functools.partial(serve_env, "CartPole-v1", num_envs=3))
        result = await trio.to_thread.run_sync(run, info.address)
        nursery.cancel_scope.cancel()
    episodes = sorted(result.episodes, key=lambda e: e.index)
    assert [e.seed for e in episodes] == [21, 22, 23, 24, 25]
    assert all(e.steps > 0 and e.terminated for e in episodes)


async def test_the_stop_bound_is_enforced_on_trio_time(autojump_clock: Any) -> None:
    """One function computes the stop bound, and the stop meets it even when a part of
    it would not: under the autojump clock every real-time wait of the transport thread
    and of the lanes looks endless to Trio, so only the enforcement ends the stop."""
    from rlmesh_trio._options import stop_bound

    options = ServeOptions(drain_timeout_seconds=0.25, close_timeout_seconds=0.5)
    bound = stop_bound(0.25, 0.5)
    assert bound == 0.25 + 0.5 + 1.0
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve_env, "CartPole-v1", options=options))
            started = trio.current_time()
            scope.cancel()
    elapsed = trio.current_time() - started
    assert elapsed <= bound + 1e-6, elapsed
    # Real time: let the abandoned transport thread and lanes finish their own stop.
    await trio.to_thread.run_sync(_wait_server_threads_gone)


def _wait_server_threads_gone() -> None:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = [t.name for t in threading.enumerate()]
        if not any(n.startswith(("rlmesh-trio-transport", "rlmesh-trio-lane-")) for n in names):
            return
        time.sleep(0.02)


def test_event_loop_option_resolves_to_an_installed_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from rlmesh_trio._options import resolve

    assert resolve(ServeOptions(event_loop="asyncio")).event_loop == "asyncio"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    assert resolve(ServeOptions()).event_loop == "asyncio"  # auto: the fallback
    with pytest.raises(ValueError, match="needs uvloop"):
        resolve(ServeOptions(event_loop="uvloop"))
    with pytest.raises(ValueError, match="event_loop"):
        resolve(ServeOptions(event_loop="tokio"))  # type: ignore[arg-type]
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("uvloop") is not None:
        assert resolve(ServeOptions()).event_loop == "uvloop"


def test_max_given_up_lanes_resolves_with_its_neighbours() -> None:
    """Default 0 (the first lane given up turns health NOT_SERVING); any int >= 0,
    more than the lanes served too (then only min_serving_lanes and max_abandoned_lanes
    decide, as before the option)."""
    from rlmesh_trio._options import DEFAULT_MAX_GIVEN_UP_LANES, resolve

    resolved = resolve(ServeOptions(), environ={})
    assert resolved.max_given_up_lanes == DEFAULT_MAX_GIVEN_UP_LANES == 0
    assert (resolved.min_serving_lanes, resolved.max_abandoned_lanes) == (1, 8)
    assert resolve(ServeOptions(max_given_up_lanes=64), environ={}).max_given_up_lanes == 64
    with pytest.raises(ValueError, match=r"^max_given_up_lanes must be an int >= 0, got -1$"):
        resolve(ServeOptions(max_given_up_lanes=-1), environ={})


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:1", True),
        ("tcp://127.8.9.10:1", True),
        ("tcp://[::1]:1", True),
        ("tcp://localhost:1", True),
        ("unix:///tmp/x.sock", True),
        ("tcp://0.0.0.0:1", False),
        ("tcp://[::]:1", False),
        ("tcp://10.1.2.3:1", False),
        ("tcp://envs.example.org:1", False),
    ],
)
def test_what_counts_as_loopback(address: str, loopback: bool) -> None:
    from rlmesh_trio._address import is_loopback, parse_address

    assert is_loopback(parse_address(address)) is loopback


@pytest.mark.parametrize(
    ("options", "warned"), [(ServeOptions(), True), (ServeOptions(auth_token="t0k"), False)]
)
async def test_serving_beyond_loopback_without_a_token_warns_once(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    options: ServeOptions,
    warned: bool,
) -> None:
    """Issue 17, finding 6: ``--address 0.0.0.0:...`` with no token did not even warn.
    (Tests bind loopback only: the address is taken as reachable from elsewhere.)"""
    from rlmesh_trio import _serve

    monkeypatch.setattr(_serve, "is_loopback", lambda address: False)
    caplog.set_level(logging.WARNING, logger="rlmesh_trio")
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(serve_env, envs.make_cartpole, num_envs=1, options=options)
        )
        nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert warnings[0].levelno == logging.WARNING
        assert "--auth-token" in warnings[0].getMessage()


@pytest.mark.parametrize("metrics", [False, True])
async def test_one_wiring_is_composed_and_reaches_the_loop_server(
    metrics: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve_env wires its server once (``compose``), and that same frozen value is what
    the transport and its loop side hold: nothing is assembled again on the way down."""
    import dataclasses

    from rlmesh_trio import _serve
    from rlmesh_trio._metrics import ServerMetrics
    from rlmesh_trio._session import Session
    from rlmesh_trio._transport._service import TransportService

    composed: list[Any] = []
    services: list[TransportService] = []

    compose = _serve.compose

    def recording_compose(*args: Any) -> Any:
        composed.append(compose(*args))
        return composed[-1]

    monkeypatch.setattr(_serve, "compose", recording_compose)
    init = TransportService.__init__

    def recording_init(self: TransportService, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        services.append(self)

    monkeypatch.setattr(TransportService, "__init__", recording_init)
    options = ServeOptions(metrics_address="tcp://127.0.0.1:0" if metrics else None)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_env, "CartPole-v1", num_envs=2, options=options)
            )
            (wiring,) = composed
            (service,) = services
            loop_server = service._loop_server
            assert loop_server is not None
            assert service.wiring is wiring
            assert loop_server.wiring is wiring
            nursery.cancel_scope.cancel()
    assert wiring.endpoint.num_envs == wiring.lanes.num_envs == 2
    assert wiring.options.metrics_address == options.metrics_address
    if metrics:
        assert isinstance(wiring.metrics, ServerMetrics)
        factory = wiring.session_factory
        assert isinstance(factory, functools.partial)
        assert (factory.func, factory.keywords) == (Session, {"observe": True})
    else:
        assert wiring.metrics is None
        assert wiring.session_factory is Session
    with pytest.raises(dataclasses.FrozenInstanceError):
        wiring.metrics = None  # type: ignore[misc]
