"""TLS settings for both sides: the server's context (TLS, and mTLS with a client CA) and
the clients' (system trust, a CA file, or the caller's own :class:`ssl.SSLContext`).

gRPC over TLS is HTTP/2 negotiated by ALPN (``h2``), TLS 1.2 or newer (RFC 9113 §9.2).
Only the standard library's :mod:`ssl` is used; the I/O layers (asyncio on the server,
``trio.SSLStream`` and :meth:`ssl.SSLContext.wrap_socket` on the clients) run it.
"""

from __future__ import annotations

import os
import ssl
import threading
import weakref
from collections.abc import Callable
from typing import Union

__all__ = [
    "ALPN",
    "HANDSHAKE_TIMEOUT",
    "RELOAD_INTERVAL",
    "ReloadingServerContext",
    "TlsSetting",
    "check_alpn",
    "client_context",
    "client_context_from_files",
    "describe_tls_error",
    "server_context",
]

ALPN = "h2"
"""The one application protocol offered and accepted."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds the server gives a client to finish the TLS handshake."""

RELOAD_INTERVAL = 10.0
"""Seconds between two looks at the server's TLS files (a renewed certificate is served
from the next handshake on)."""

_lock = threading.Lock()
_configured: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()

TlsSetting = Union[bool, str, "os.PathLike[str]", ssl.SSLContext, None]
"""A client's ``tls=``: ``None``/``False`` plaintext, ``True`` the system's trust store,
a CA file path (PEM), or an :class:`ssl.SSLContext` (client certificates through it)."""


def _readable(label: str, path: object) -> str:
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"{label} must be a file path, got {type(path).__name__}")
    name = os.fspath(path)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{label} must be a non-empty file path, got {path!r}")
    if not os.path.isfile(name):
        raise ValueError(f"{label} {name!r}: no such file")
    if not os.access(name, os.R_OK):
        raise ValueError(f"{label} {name!r}: not readable")
    return name


def server_context(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """The server's context: ``cert_file`` (PEM, the chain) and ``key_file``, ALPN ``h2``,
    TLS >= 1.2; with ``client_ca_file`` a client must present a certificate signed by
    that CA, or the handshake fails (``CERT_REQUIRED``). Raises ``ValueError`` naming
    the file that cannot be used."""
    cert = _readable("tls_cert_file", cert_file)
    key = _readable("tls_key_file", key_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"tls_cert_file {cert!r} / tls_key_file {key!r}: cannot load the certificate "
            f"and its key: {exc}"
        ) from None
    if client_ca_file is not None:
        ca = _readable("tls_client_ca_file", client_ca_file)
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"tls_client_ca_file {ca!r}: cannot load it: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols([ALPN])
    return context


_Stamp = tuple[tuple[int, int, int] | None, ...]


def _stamp(paths: tuple[str, ...]) -> _Stamp:
    """What changes when a file is rewritten or a symlink swapped (a Secret update)."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class ReloadingServerContext:
    """The server's context, and a newer one once the files change (:meth:`check`).

    The listening socket keeps :attr:`context`; its SNI callback (called for every
    handshake, with or without a server name) moves the connection to the newest
    context, so a renewed certificate (or client CA) is used from the next handshake
    on. Connections already open keep theirs. Files that no longer load are reported
    and the previous context stays.
    """

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        client_ca_file: str | None = None,
        *,
        on_problem: Callable[[str], None] | None = None,
        on_reload: Callable[[], None] | None = None,
    ) -> None:
        self._files = (cert_file, key_file, client_ca_file)
        self._paths = tuple(p for p in self._files if p is not None)
        self._stamp = _stamp(self._paths)
        self.context = server_context(cert_file, key_file, client_ca_file)
        self.current = self.context
        self.reloads = 0
        self._on_problem = on_problem
        self._on_reload = on_reload
        self.context.sni_callback = self._pick

    def _pick(self, connection: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        if self.current is not self.context:
            connection.context = self.current

    def check(self) -> bool:
        """Reload if the files changed since the last look; True when it did."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        cert, key, ca = self._files
        assert cert is not None and key is not None
        try:
            fresh = server_context(cert, key, ca)
        except ValueError as exc:
            if self._on_problem is not None:
                self._on_problem(str(exc))
            return False
        fresh.sni_callback = None
        self.current = fresh
        self.reloads += 1
        if self._on_reload is not None:
            self._on_reload()
        return True


def client_context(tls: TlsSetting) -> ssl.SSLContext | None:
    """The context a client connects with (None: plaintext).

    ``True``: :func:`ssl.create_default_context` (the system's trust store, hostname
    checked); a path: the same, trusting that CA file instead; an
    :class:`ssl.SSLContext`: used as given (its verification settings and client
    certificate are the caller's), with ALPN set to ``h2``. The server's certificate is
    checked against the address's host: a DNS name against its DNS SANs, an IP address
    against its IP SANs.
    """
    if tls is None or tls is False:
        return None
    if tls is True:
        context = ssl.create_default_context()
    elif isinstance(tls, ssl.SSLContext):
        context = tls
    elif isinstance(tls, str | os.PathLike):
        ca = _readable("tls CA file", tls)
        try:
            context = ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"tls CA file {ca!r}: cannot load it: {exc}") from None
    else:
        raise TypeError(
            "tls must be None, a bool, a CA file path or an ssl.SSLContext, "
            f"not {type(tls).__name__}"
        )
    with _lock:  # a context shared by threads (a fleet's probes) is set up once
        if context not in _configured:
            if context.minimum_version < ssl.TLSVersion.TLSv1_2:
                context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.set_alpn_protocols([ALPN])
            _configured.add(context)
    return context


def client_context_from_files(
    ca_file: str | None, cert_file: str | None, key_file: str | None, *, flags: str
) -> ssl.SSLContext:
    """A client context trusting ``ca_file`` (None: the system's CAs), presenting
    ``cert_file`` / ``key_file`` when given (mTLS); ``ValueError`` naming ``flags``
    (the command line's) when the certificate cannot be loaded."""
    if (cert_file is None) != (key_file is None):
        raise ValueError(f"{flags} go together")
    context = client_context(ca_file or True)
    assert context is not None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except OSError as exc:  # ssl.SSLError too
            raise ValueError(f"{flags}: cannot load them: {exc}") from None
    return context


def check_alpn(selected: str | None, where: str) -> None:
    """Raise ``ConnectionError`` unless the handshake agreed on ``h2``."""
    if selected != ALPN:
        raise ConnectionError(
            f"{where} did not agree to HTTP/2 over TLS (ALPN {ALPN!r}; it selected "
            f"{selected!r}): it is not a gRPC server, or not one serving TLS here"
        )


ABRUPT_END = (
    "the server ended the TLS session abruptly (an mTLS server does so when the client "
    "presents no certificate it trusts)"
)


def describe_tls_error(exc: BaseException) -> str | None:
    """The :class:`ssl.SSLError` behind ``exc`` (itself, its cause or context), in words;
    None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLError):
            if isinstance(current, ssl.SSLCertVerificationError):
                return f"certificate verification failed: {current.verify_message}"
            reason = str(getattr(current, "reason", None) or current.strerror or current)
            if reason == "UNEXPECTED_EOF_WHILE_READING" or isinstance(current, ssl.SSLEOFError):
                return ABRUPT_END
            return reason.replace("_", " ").lower()
        current = current.__cause__ or current.__context__
    return None
