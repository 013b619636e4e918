"""The client's 0.1 keyword names, deprecated until 0.2: each still does what it did,
with a ``DeprecationWarning`` naming its replacement (issue 21).

One test per old keyword of every entry point (``open_endpoint``, ``VectorEnv``,
``Env``, ``probe``), each showing its effect, not only the warning: a token lets a
session through a server that wants it; ``connect_timeout`` and the probe's ``timeout``
bound a peer that never answers (the value is in the error); the PING keywords give up
on a frozen server (both values are in the error); ``close_timeout`` bounds a close no
one answers; ``request_timeout_ms`` reaches the server as its deadline (the server's
TIMEOUT names it).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import trio
from support import envs

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio.client import (
    ConnectionLostError,
    Env,
    EnvError,
    ErrorCode,
    RpcError,
    VectorEnv,
    open_endpoint,
    probe,
)
from rlmesh_trio.client._settings import DEFAULT_CLOSE_TIMEOUT_SECONDS

pytestmark = pytest.mark.timeout(60)

BOUND = 30.0
TOKEN = "s3cret"
PING_INTERVAL, PING_TIMEOUT = 0.2, 0.4
GAVE_UP_ON_PING = re.escape(
    f"no answer to a keep-alive PING (sent after {PING_INTERVAL:g} s of silence) "
    f"within {PING_TIMEOUT:g} s"
)
CLOSE_TIMEOUT = 0.2
CLOSE_BOUND = DEFAULT_CLOSE_TIMEOUT_SECONDS / 2
"""A close bounded by ``CLOSE_TIMEOUT`` ends well within this; one left at the default
(5 s) would not."""


def deprecated(call: str, old: str, new: str) -> Any:
    """``pytest.warns`` for the warning of ``call(old=)``, which names ``new=``."""
    return pytest.warns(
        DeprecationWarning, match=re.escape(f"{call}({old}=) is deprecated") + f".*use {new}="
    )


class Relay:
    """A TCP relay in front of a server that can freeze: the connections stay open and
    nothing passes any more in either direction (a server that stopped answering, even
    PINGs, as a SIGSTOPped process does, without one)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self._target = (host, int(port))
        self.frozen = False
        self.address = ""

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.address = f"tcp://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        with contextlib.suppress(OSError, trio.BrokenResourceError):
            async with (
                client,
                await trio.open_tcp_stream(*self._target) as upstream,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(self._pipe, client, upstream, nursery.cancel_scope)
                nursery.start_soon(self._pipe, upstream, client, nursery.cancel_scope)

    async def _pipe(
        self, source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some(65536):
                if not self.frozen:  # frozen: read and drop, answer nothing
                    await sink.send_all(data)
        scope.cancel()


@contextlib.asynccontextmanager
async def serving(*, auth_token: str | None = None) -> AsyncIterator[Relay]:
    """A one-lane SlowEnv server (in this process) behind a :class:`Relay`."""
    async with trio.open_nursery() as nursery:
        with trio.fail_after(BOUND):
            info = await nursery.start(
                functools.partial(
                    serve_env, envs.make_slow, options=ServeOptions(auth_token=auth_token)
                )
            )
            relay = Relay(info.address)
            await nursery.start(relay.serve)
        try:
            yield relay
        finally:
            nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def silent_peer() -> AsyncIterator[str]:
    """An address that accepts connections and never says a word."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


async def in_thread(fn: Callable[[], Any]) -> Any:
    with trio.fail_after(BOUND):
        return await trio.to_thread.run_sync(fn)


# ---------------------------------------------------------------------------- open_endpoint


async def test_open_endpoint_token() -> None:
    async with serving(auth_token=TOKEN) as relay:
        with pytest.raises(RpcError, match="UNAUTHENTICATED"):
            async with open_endpoint(relay.address):
                pass
        with trio.fail_after(BOUND), deprecated("open_endpoint", "token", "auth_token"):
            async with open_endpoint(relay.address, token=TOKEN) as ep:
                obs, _ = await ep.reset()
        assert obs.shape == (1, 1)


async def test_open_endpoint_connect_timeout() -> None:
    async with silent_peer() as address:
        with (
            trio.fail_after(BOUND),
            deprecated("open_endpoint", "connect_timeout", "connect_timeout_seconds"),
            pytest.raises(ConnectionLostError, match=r"within connect_timeout_seconds=0\.3$"),
        ):
            async with open_endpoint(address, connect_timeout=0.3):
                pass


@pytest.mark.parametrize("old", ["ping_interval", "ping_timeout"])
async def test_open_endpoint_ping_keywords(old: str) -> None:
    keywords = {
        "ping_interval_seconds": PING_INTERVAL,
        "ping_timeout_seconds": PING_TIMEOUT,
    }
    keywords[old] = keywords.pop(f"{old}_seconds")
    async with serving() as relay:
        with trio.fail_after(BOUND):
            with deprecated("open_endpoint", old, f"{old}_seconds"):
                endpoint = open_endpoint(relay.address, **keywords)
            async with endpoint as ep:
                await ep.reset()
                relay.frozen = True
                with pytest.raises(ConnectionLostError, match=GAVE_UP_ON_PING):
                    await ep.step(np.array([0]))


async def test_open_endpoint_close_timeout() -> None:
    async with serving() as relay:
        with trio.fail_after(BOUND):
            with deprecated("open_endpoint", "close_timeout", "close_timeout_seconds"):
                endpoint = open_endpoint(relay.address, close_timeout=CLOSE_TIMEOUT)
            async with endpoint as ep:
                await ep.reset()
                relay.frozen = True  # the Close is never answered
                with trio.fail_after(CLOSE_BOUND):
                    assert await ep.aclose() == []


# ---------------------------------------------------------------------------- VectorEnv, Env

ADAPTERS = [VectorEnv, Env]


@pytest.mark.parametrize("cls", ADAPTERS)
async def test_adapter_token(cls: type[VectorEnv | Env]) -> None:
    async with serving(auth_token=TOKEN) as relay:

        def drive() -> Any:
            with deprecated(cls.__name__, "token", "auth_token"):
                env = cls(relay.address, token=TOKEN)
            try:
                return env.reset()[0]
            finally:
                env.close()

        assert np.asarray(await in_thread(drive)).size == 1


@pytest.mark.parametrize("cls", ADAPTERS)
async def test_adapter_connect_timeout(cls: type[VectorEnv | Env]) -> None:
    async with silent_peer() as address:

        def drive() -> None:
            with (
                deprecated(cls.__name__, "connect_timeout", "connect_timeout_seconds"),
                pytest.raises(ConnectionLostError, match=r"within connect_timeout_seconds=0\.3$"),
            ):
                cls(address, connect_timeout=0.3)

        await in_thread(drive)


@pytest.mark.parametrize("old", ["ping_interval", "ping_timeout"])
@pytest.mark.parametrize("cls", ADAPTERS)
async def test_adapter_ping_keywords(cls: type[VectorEnv | Env], old: str) -> None:
    keywords = {
        "ping_interval_seconds": PING_INTERVAL,
        "ping_timeout_seconds": PING_TIMEOUT,
    }
    keywords[old] = keywords.pop(f"{old}_seconds")
    async with serving() as relay:

        def drive() -> None:
            with deprecated(cls.__name__, old, f"{old}_seconds"):
                env = cls(relay.address, **keywords)
            try:
                env.reset()
                relay.frozen = True
                with pytest.raises(ConnectionLostError, match=GAVE_UP_ON_PING):
                    env.step(np.array([0]) if isinstance(env, VectorEnv) else 0)
            finally:
                env.close()

        await in_thread(drive)


@pytest.mark.parametrize("cls", ADAPTERS)
async def test_adapter_close_timeout(cls: type[VectorEnv | Env]) -> None:
    async with serving() as relay:

        def drive() -> float:
            with deprecated(cls.__name__, "close_timeout", "close_timeout_seconds"):
                env = cls(relay.address, close_timeout=CLOSE_TIMEOUT)
            env.reset()
            relay.frozen = True  # the Close is never answered
            start = time.monotonic()
            env.close()
            return time.monotonic() - start

        assert await in_thread(drive) < CLOSE_BOUND


@pytest.mark.parametrize("cls", ADAPTERS)
async def test_adapter_request_timeout_ms(cls: type[VectorEnv | Env]) -> None:
    """The old int milliseconds: 5 -> ``request_timeout_seconds=0.005`` -> 5 ms on the wire."""
    async with serving() as relay:

        def drive() -> None:
            with deprecated(cls.__name__, "request_timeout_ms", "request_timeout_seconds"):
                env = cls(relay.address, request_timeout_ms=5)
            try:
                with pytest.raises(EnvError) as caught:
                    env.reset(options={"sleep": 0.15})
                assert caught.value.code == ErrorCode.TIMEOUT
                assert caught.value.message == "env.reset timed out after 5ms"
            finally:
                env.close()

        await in_thread(drive)


# ---------------------------------------------------------------------------- probe


async def test_probe_token() -> None:
    async with serving(auth_token=TOKEN) as relay:
        refused = await in_thread(lambda: probe(relay.address))
        assert refused.error == "UNAUTHENTICATED: invalid env token"

        def drive() -> Any:
            with deprecated("probe", "token", "auth_token"):
                return probe(relay.address, token=TOKEN)

        result = await in_thread(drive)
        assert result.serving and result.error is None, result


async def test_probe_timeout() -> None:
    async with silent_peer() as address:

        def drive() -> Any:
            with deprecated("probe", "timeout", "timeout_seconds"):
                return probe(address, timeout=0.3)

        result = await in_thread(drive)
    assert not result.serving
    assert result.error == "unreachable: TimeoutError: no answer to Check within 0.3 s"


def test_old_and_new_keyword_together_are_refused() -> None:
    with pytest.raises(TypeError, match="got both timeout= and timeout_seconds="):
        probe("127.0.0.1:1", timeout=1.0, timeout_seconds=1.0)
