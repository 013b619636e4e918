"""Where and how a client connects: the target address, TLS, the connection's timeouts
and keep-alive, the bearer token's metadata, and request deadlines on the wire."""

from __future__ import annotations

import math
import numbers
import ssl
from dataclasses import dataclass
from fractions import Fraction

from .._address import TcpAddress, UnixAddress, parse_address
from .._credentials import protect_credentials
from .._tls import ABRUPT_END, TlsSetting, client_context, describe_tls_error
from ._errors import (
    ConnectionLostError,
)
from ._grpc import GrpcConnection

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT_SECONDS",
    "DEFAULT_CONNECT_TIMEOUT_SECONDS",
    "DEFAULT_PING_INTERVAL_SECONDS",
    "DEFAULT_PING_TIMEOUT_SECONDS",
    "OLD_CONNECTION_KEYWORDS",
    "ConnectionSettings",
    "Target",
    "check_timeouts",
    "metadata",
    "no_ping_answer",
    "request_timeout_ms",
    "seconds_of_ms",
    "tls_context",
    "tls_failure",
    "transport_failure",
]


@dataclass(frozen=True)
class Target:
    """Where to connect, and the ``:authority`` to send."""

    host: str | None
    port: int | None
    path: str | None

    @classmethod
    def parse(cls, address: str) -> Target:
        parsed = parse_address(address)
        if isinstance(parsed, UnixAddress):
            return cls(None, None, parsed.path)
        assert isinstance(parsed, TcpAddress)
        if parsed.port == 0:
            raise ValueError(f"invalid address {address!r}: port 0 cannot be connected to")
        return cls(parsed.host, parsed.port, None)

    @property
    def authority(self) -> str:
        if self.path is not None:
            return "localhost"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path is not None else f"tcp://{self.authority}"


def tls_context(target: Target, tls: TlsSetting) -> ssl.SSLContext | None:
    """The TLS context to connect to ``target`` with (None: plaintext); TLS is for TCP
    addresses (a unix socket is guarded by its file permissions)."""
    context = client_context(tls)
    if context is not None and target.path is not None:
        raise ValueError(f"tls= is for TCP addresses, not {target} (unix sockets are plaintext)")
    return context


def transport_failure(conn: GrpcConnection, exc: BaseException, what: str) -> str:
    """Why the connection broke, in words: a TLS error said as such, and a TLS session
    that ended (reset or EOF) before the server's first HTTP/2 frame said to be what it
    almost always is (an mTLS server closes a refused client without a TLS alert)."""
    why = describe_tls_error(exc)
    if why is None and conn.tls and not conn.heard_from_server:
        why = ABRUPT_END
    if why is not None:
        return f"{what}: TLS: {why}"
    if not conn.heard_from_server and isinstance(
        exc if isinstance(exc, OSError) else exc.__cause__, ConnectionResetError
    ):
        # A TLS server answers a plaintext client's preface with an alert and closes;
        # closing with our bytes unread resets the connection, and the reset can destroy
        # the alert before we read it.
        return (
            f"{what}: {exc!r}: the server reset the connection before its HTTP/2 "
            "settings (if it serves TLS, connect with tls=...)"
        )
    return f"{what}: {exc!r}"


def tls_failure(target: Target, exc: BaseException) -> ConnectionLostError:
    """A failed TLS handshake (or a TLS error right after it), said plainly."""
    why = describe_tls_error(exc)
    if why is None:
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        why = (
            f"{type(cause).__name__}: {cause} (the server broke off the handshake: it does "
            "not serve TLS here, or refused this client's certificate)"
        )
    return ConnectionLostError(f"TLS handshake with {target} failed: {why}")


DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
DEFAULT_PING_INTERVAL_SECONDS = 10.0
DEFAULT_PING_TIMEOUT_SECONDS = 20.0
DEFAULT_CLOSE_TIMEOUT_SECONDS = 5.0

OLD_CONNECTION_KEYWORDS = {
    "token": "auth_token",
    "connect_timeout": "connect_timeout_seconds",
    "ping_interval": "ping_interval_seconds",
    "ping_timeout": "ping_timeout_seconds",
    "close_timeout": "close_timeout_seconds",
}
"""The connection keywords of 0.1 (deprecated, removed in 0.2) and their new names."""


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """How a client connects to each endpoint: the bearer token, TLS and the
    connection's timeouts. :func:`~rlmesh_trio.client.open_endpoint` and every adapter
    (``VectorEnv``, ``Env``, SB3's ``RemoteVecEnv``) take them as keywords, documented
    in their signatures, and pass this one value on. Nothing is checked here: the
    timeouts where a connection is made (:meth:`check`, after the address), the token
    and ``tls`` when the connection is built, each with the error it always had."""

    auth_token: str | None = None
    tls: TlsSetting = None
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS
    ping_interval_seconds: float = DEFAULT_PING_INTERVAL_SECONDS
    ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS
    close_timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS

    def check(self, *, closing: bool = True) -> None:
        """Every timeout a number of seconds > 0 (``ValueError`` naming the first that is
        not); ``closing=False`` leaves out the close timeout (a connection that only
        Handshakes never closes a session)."""
        timeouts = {
            "connect_timeout_seconds": self.connect_timeout_seconds,
            "ping_interval_seconds": self.ping_interval_seconds,
            "ping_timeout_seconds": self.ping_timeout_seconds,
        }
        if closing:
            timeouts["close_timeout_seconds"] = self.close_timeout_seconds
        check_timeouts(**timeouts)


def check_timeouts(**timeouts: float) -> None:
    """Every one of the connection's timeouts must be a number > 0 (and finite)."""
    for name, value in timeouts.items():
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


def no_ping_answer(interval: float, timeout: float) -> str:
    """Why a connection whose keep-alive PING went unanswered was given up."""
    return (
        f"no answer to a keep-alive PING (sent after {interval:g} s of silence) "
        f"within {timeout:g} s"
    )


def metadata(auth_token: str | None) -> list[tuple[str, str]]:
    """The ``authorization: Bearer`` header for ``auth_token`` (none for None)."""
    if auth_token is None:
        return []
    if (
        not isinstance(auth_token, str)
        or not auth_token
        or any(c in auth_token for c in "\r\n\x00")
    ):
        raise ValueError("auth_token must be a non-empty string without line breaks")
    protect_credentials(auth_token)  # hpack's DEBUG lines would print the header
    return [("authorization", f"Bearer {auth_token}")]


def request_timeout_ms(seconds: float | None) -> int:
    """The wire's ``timeout_ms`` for ``request_timeout_seconds`` (0: no deadline).

    Converted as rlmesh 0.1.0's ``RemoteEnv`` converts its ``request_timeout_seconds``
    (measured on its wire): rounded to the nanosecond, then whole milliseconds, the rest
    dropped (2.5 -> 2500, 0.0015 -> 1, 0.0019999999 -> 2). None and 0 mean no deadline.
    A positive value under one millisecond is refused: the reference would send 0, no
    deadline at all, the opposite of what was asked.
    """
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"request_timeout_seconds must be a number, not {type(seconds).__name__}")
    value = float(seconds)
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"request_timeout_seconds must be >= 0, got {seconds!r}")
    ms = round(Fraction(value) * 1_000_000_000) // 1_000_000
    if value and ms < 1:
        raise ValueError(
            f"request_timeout_seconds={seconds!r} is under the wire's 1 ms resolution "
            "(0 or None: no deadline)"
        )
    return int(ms)


def seconds_of_ms(ms: int | None) -> float | None:
    """The deprecated ``request_timeout_ms`` as ``request_timeout_seconds``."""
    return None if ms is None else int(ms) / 1000
