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
from typing import Union

__all__ = [
    "ALPN",
    "HANDSHAKE_TIMEOUT",
    "TlsSetting",
    "check_alpn",
    "client_context",
    "describe_tls_error",
    "server_context",
]

ALPN = "h2"
"""The one application protocol offered and accepted."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds the server gives a client to finish the TLS handshake."""

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


def check_alpn(selected: str | None, where: str) -> None:
    """Raise ``ConnectionError`` unless the handshake agreed on ``h2``."""
    if selected != ALPN:
        raise ConnectionError(
            f"{where} did not agree to HTTP/2 over TLS (ALPN {ALPN!r}; it selected "
            f"{selected!r}): it is not a gRPC server, or not one serving TLS here"
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
            reason = str(current.reason or current.strerror or current)
            if reason == "UNEXPECTED_EOF_WHILE_READING" or isinstance(current, ssl.SSLEOFError):
                return (
                    "the server ended the TLS session abruptly (an mTLS server does so when "
                    "the client presents no certificate it trusts)"
                )
            return reason.replace("_", " ").lower()
        current = current.__cause__ or current.__context__
    return None
