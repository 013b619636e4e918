"""grpclib's seam: the raw codec, the method table, the server's configuration, unary
reads and trailers-only answers, a Join's reader found, reflection's servicers.

Every private name of grpclib and h2 this package uses is listed, with why and its
fallback, in :mod:`._privates` (``tests/test_transport_privates.py`` fails on one that is
not). The connection's own classes (grpclib's ``H2Protocol`` and ``Handler``
subclassed) are in :mod:`._connection` and :mod:`._dispatch`; a Join's input is read by
its :class:`~._reader.RequestReader` (inside the connection's data callback,
acknowledged to h2 only as it is consumed), its output written by :mod:`._writer`. What
this module builds on, by public names:

* The direct DATA path (issue 20, :mod:`._h2frames`) takes a Join's plain DATA frames and
  queues its replies past h2's frame objects, changing exactly what h2 would; it needs
  h2's privates and is checked once per process (:func:`._privates.direct_data_path`):
  h2's public API is the fallback. ``tests/test_transport_shim.py`` feeds the same byte
  streams to h2 alone and to this path and compares everything observable.
* Server reflection (:mod:`._reflection`) uses grpclib's servicers
  (:func:`reflection_servicers`), with our own descriptor pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import h2.config
from grpclib.config import Configuration
from grpclib.const import Handler as MethodHandler
from grpclib.encoding.base import CodecBase
from grpclib.server import Stream

from .._errors import UNEXPECTED_EOF, FrameError
from .._wire import PREFIX_SIZE, SMALL_MESSAGE, parse_prefix
from ._connection import Connection, call_of
from ._dispatch import h2_stream
from ._headers import HEADER_ENCODING
from ._privates import library_version, server_configuration

if TYPE_CHECKING:
    from ._reader import RequestReader

log = logging.getLogger("rlmesh_trio.transport")

CHUNK = 1 << 20
"""Bytes read from grpclib's stream buffer at a time for a big message."""


class RawCodec(CodecBase):
    """Messages cross grpclib as bytes: the transport encodes and decodes them itself."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if not isinstance(message, bytes):
            raise TypeError(f"expected bytes, got {type(message).__name__}")
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class MethodTable(dict[str, MethodHandler]):
    """grpclib's method table, answering unknown paths with our own handler.

    grpclib's own answer omits ``content-type`` from the trailers-only response; the
    reference (and strict clients) have it.
    """

    def __init__(self, methods: dict[str, MethodHandler], fallback: MethodHandler) -> None:
        super().__init__(methods)
        self._fallback = fallback

    def get(self, key: str, default: Any = None) -> MethodHandler:
        return super().get(key, self._fallback)


def server_config() -> tuple[Configuration, h2.config.H2Configuration]:
    """grpclib's server configuration, and the h2 settings grpclib's Server uses."""
    h2_config = h2.config.H2Configuration(
        client_side=False,
        header_encoding=HEADER_ENCODING,  # total: a non-ASCII byte cannot fail to decode
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
    return server_configuration(), h2_config


async def read_message(stream: Stream[Any, Any], limit: int) -> bytes | bytearray | None:
    """Read one length-prefixed message; None when the client half-closed.

    The prefix is read first, so an over-size message is refused before its body is
    buffered (:class:`~rlmesh_trio._errors.MessageTooLarge`); a big body is appended to
    one ``bytearray`` as it arrives (no buffer is ever sized from the declared length). Raises :class:`~rlmesh_trio._errors.FrameError` for a
    truncated or compressed message.
    """
    raw = h2_stream(stream)
    try:
        prefix = await raw.recv_data(PREFIX_SIZE)
        if not prefix:
            return None
        length = parse_prefix(prefix, limit)
        if length <= SMALL_MESSAGE:
            data: bytes | bytearray = await raw.recv_data(length)
            if len(data) != length:
                raise FrameError(UNEXPECTED_EOF)
            return data
        # Grown as the body arrives, never sized from the prefix: a prefix that lies
        # about its length costs nothing until the bytes themselves come.
        buffer = bytearray()
        while len(buffer) < length:
            chunk = await raw.recv_data(min(CHUNK, length - len(buffer)))
            if not chunk:
                raise FrameError(UNEXPECTED_EOF)
            buffer += chunk
            del chunk
        return buffer
    except AssertionError as exc:  # grpclib's Buffer: EOF inside a message
        raise FrameError(UNEXPECTED_EOF) from exc


def reflection_servicers(service_names: tuple[str, ...], pool: Any) -> tuple[Any, Any]:
    """grpclib's reflection servicers (v1, v1alpha) answering from ``pool``; None for
    one whose privates are not there (listed in :mod:`._privates`), with a warning."""
    from grpclib.reflection.service import ServerReflection as V1

    classes: list[Any] = [V1, None]
    try:
        from grpclib.reflection._deprecated import ServerReflection as V1Alpha

        classes[1] = V1Alpha
    except ImportError:
        log.warning(
            "grpclib %s has no grpclib.reflection._deprecated: grpc.reflection.v1alpha "
            "is not served",
            library_version("grpclib"),
        )
    servicers: list[Any] = []
    for cls in classes:
        servicer = None
        if cls is not None:
            try:
                servicer = cls(_service_names=service_names)
                if not hasattr(servicer, "_pool"):
                    raise AttributeError("_pool")
                # grpclib 0.4.9 takes ``_pool=`` too, 0.4.8 does not; both keep it here.
                servicer._pool = pool
            except (TypeError, AttributeError) as exc:
                log.warning(
                    "grpclib %s's reflection servicer is not what we expect (%s): "
                    "reflection is not served",
                    library_version("grpclib"),
                    exc,
                )
                servicer = None
        servicers.append(servicer)
    return servicers[0], servicers[1]


def reader_of(stream: Stream[Any, Any], connections: set[Connection]) -> RequestReader | None:
    """The reader :class:`~._dispatch.Dispatcher` made for ``stream`` (a direct path's call), None
    once its connection is gone."""
    connection, raw = call_of(stream)
    if connection not in connections or raw.id is None:
        return None
    return connection.readers.get(raw.id)
