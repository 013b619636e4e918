"""How the Trio client joins: :func:`open_endpoint` connects to one endpoint, or gathers
one from a list of addresses (or ``RLMESH_TRIO_ADDRESS``) by :mod:`._gather`'s rule,
passing over the endpoints that are taken or unreachable; each one tried is connected,
Handshaken and joined (:class:`._endpoint.Endpoint`) within the connect timeout.
(:mod:`._joining` does the same for the blocking adapters.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import trio
from gymnasium.vector import AutoresetMode

from .._deprecation import renamed_kwargs
from .._tls import TlsSetting
from ._endpoint import Endpoint
from ._errors import ConnectionLostError, EndpointError
from ._gather import Gathering, addresses_of, passed_over
from ._pool import autoreset_mode_of
from ._settings import (
    DEFAULT_CLOSE_TIMEOUT_SECONDS,
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_PING_INTERVAL_SECONDS,
    DEFAULT_PING_TIMEOUT_SECONDS,
    OLD_CONNECTION_KEYWORDS,
    ConnectionSettings,
    Target,
    tls_context,
)

__all__ = ["open_endpoint"]


@renamed_kwargs(**OLD_CONNECTION_KEYWORDS)
@contextlib.asynccontextmanager
async def open_endpoint(
    address: str | Sequence[str] | None = None,
    *,
    num_envs: int | None = None,
    auth_token: str | None = None,
    tls: TlsSetting = None,
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
    ping_interval_seconds: float = DEFAULT_PING_INTERVAL_SECONDS,
    ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS,
    close_timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS,
    batch_size: int | None = None,
    autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
) -> AsyncIterator[Endpoint]:
    """Connect to ``address`` (``tcp://host:port``, ``host:port``, ``port``,
    ``unix:///path``), Handshake (generation and edition check, the contract), open the
    Join and configure it; yield the :class:`Endpoint`; close it on exit.

    ``auth_token``: sent as ``authorization: Bearer <token>`` on every call.
    ``tls``: None/False plaintext (default); ``True`` TLS trusting the system's CAs; a
    CA file path (PEM) to trust instead; or an :class:`ssl.SSLContext` (a client
    certificate for mTLS goes through it: ``load_cert_chain``). ALPN must agree on
    ``h2``; the server's certificate is checked against the address's host (a DNS name
    against its DNS SANs, an IP address against its IP SANs). TCP addresses only.
    ``connect_timeout_seconds`` bounds connecting, the Handshake and the Join's
    configure. While requests wait, a PING goes out after ``ping_interval_seconds`` of
    silence and the connection is declared lost if it is not answered within
    ``ping_timeout_seconds`` (a vanished server never hangs a caller).
    ``close_timeout_seconds`` bounds :meth:`Endpoint.aclose`. Raises
    :class:`ConnectionLostError`, :class:`RpcError` (e.g. ``UNAUTHENTICATED: invalid env
    token``, FAILED_PRECONDITION for a second Join) or :class:`HandshakeError`.

    The 0.1 keywords ``token``, ``connect_timeout``, ``ping_interval``,
    ``ping_timeout`` and ``close_timeout`` still work (deprecated, removed in 0.2).

    ``batch_size`` (1..num_envs, default num_envs) and ``autoreset_mode`` (NEXT_STEP
    default, SAME_STEP, DISABLED) shape :meth:`Endpoint.send` / :meth:`Endpoint.recv`,
    the EnvPool-style stepping of the lanes that are ready (docs/client.md).

    ``address`` None reads ``RLMESH_TRIO_ADDRESS``. A list of addresses (or a string
    of comma-separated ones) joins the first endpoint in list order that admits this
    client (one whose Join session is taken, or that cannot be reached, is passed
    over) and, with ``num_envs``, serves exactly that many lanes; when none does,
    :class:`EndpointsUnavailableError` names each and why. ``num_envs`` with one
    address is checked too (``ValueError``).
    """
    settings = ConnectionSettings(
        auth_token=auth_token,
        tls=tls,
        connect_timeout_seconds=connect_timeout_seconds,
        ping_interval_seconds=ping_interval_seconds,
        ping_timeout_seconds=ping_timeout_seconds,
        close_timeout_seconds=close_timeout_seconds,
    )
    addresses = addresses_of(address)
    if num_envs is not None and (
        isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1
    ):
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
    gathering = Gathering(addresses, num_envs)
    for each in addresses:
        stack = contextlib.AsyncExitStack()
        try:
            ep = await stack.enter_async_context(
                _open_one(each, settings, batch_size=batch_size, autoreset_mode=autoreset_mode)
            )
        except EndpointError as exc:
            why = passed_over(exc) if len(addresses) > 1 else None
            if why is None:
                raise
            gathering.refused(each, why)
            continue
        if num_envs is not None and ep.num_envs != num_envs:
            await stack.aclose()
            if len(addresses) == 1:
                raise ValueError(f"num_envs={num_envs}, but {each} serves {ep.num_envs} lanes")
            gathering.refused(each, f"serves {ep.num_envs} lanes, {num_envs} wanted")
            continue
        async with stack:
            yield ep
        return
    gathering.check()
    raise AssertionError("unreachable: no endpoint taken, yet nothing refused")


@contextlib.asynccontextmanager
async def _open_one(
    address: str,
    settings: ConnectionSettings,
    *,
    batch_size: int | None,
    autoreset_mode: str | AutoresetMode,
) -> AsyncIterator[Endpoint]:
    """One endpoint at ``address``: connected, Handshaken and joined within the connect
    timeout, yielded, closed on exit."""
    target = Target.parse(address)
    mode = autoreset_mode_of(autoreset_mode)
    settings.check()
    connect_timeout_seconds = settings.connect_timeout_seconds
    endpoint = Endpoint(
        target,
        settings,
        tls=tls_context(target, settings.tls),
        batch_size=batch_size,
        autoreset_mode=mode,
    )
    single: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect_timeout_seconds):
                    await endpoint._start(nursery)
            except trio.TooSlowError:
                await endpoint.aclose()
                nursery.cancel_scope.cancel()
                raise ConnectionLostError(
                    f"no session with {target} within "
                    f"connect_timeout_seconds={connect_timeout_seconds:g}"
                ) from None
            except BaseException:
                await endpoint.aclose()
                nursery.cancel_scope.cancel()
                raise
            try:
                yield endpoint
            finally:
                await endpoint.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The reader task never raises: a group holds the caller's own exception (or
        # the startup error). Hand it over as itself, not wrapped by our nursery.
        if len(group.exceptions) != 1:
            raise
        single = group.exceptions[0]
    if single is not None:
        raise single
