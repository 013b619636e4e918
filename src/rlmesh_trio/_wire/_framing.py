"""gRPC message framing, sans-IO: the 5-byte length prefix, the incremental message
cutter, the size limit and the ``grpc-message`` codec -- one implementation for the
server's request reader, the client and the probe.

A gRPC message on an HTTP/2 stream is ``flag (1 byte) | length (4 bytes, big endian) |
message``. The prefix is read and checked first, so that an over-size message is refused
before its body is buffered (SPEC §1.8); and a body is buffered as it arrives, never in
a buffer sized from the prefix alone: the prefix is the peer's claim, and 5 bytes must
not buy 256 MiB of memory.
"""

from __future__ import annotations

import struct
from urllib.parse import quote, unquote

from .._errors import FrameError, MessageTooLarge

__all__ = [
    "PREFIX_SIZE",
    "SMALL_MESSAGE",
    "MessageReader",
    "check_outgoing",
    "decode_grpc_message",
    "encode_grpc_message",
    "frame",
    "parse_prefix",
]

PREFIX_SIZE = 5

SMALL_MESSAGE = 1 << 20
"""Bodies up to this size are collected as a list of pieces and joined once; bigger
ones are appended to one growing ``bytearray`` as they arrive (no join: peak memory is
one copy, and never more than what has arrived)."""

_PREFIX = struct.Struct(">BI")

_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)
"""Printable ASCII but ``%``: what a ``grpc-message`` carries as it is (gRPC's
PROTOCOL-HTTP2: every other byte of the UTF-8 text is percent-encoded)."""


def parse_prefix(prefix: bytes, limit: int) -> int:
    """The body length a message prefix announces.

    Raises :class:`FrameError` for a truncated prefix or a compressed/invalid flag (no
    ``grpc-encoding`` is ever negotiated), :class:`MessageTooLarge` past ``limit``.
    """
    if len(prefix) != PREFIX_SIZE:
        raise FrameError("truncated message prefix")
    flag = prefix[0]
    if flag == 1:
        raise FrameError(
            "protocol error: received message with compressed-flag but no grpc-encoding "
            "was specified"
        )
    if flag != 0:
        raise FrameError(
            f"protocol error: received message with invalid compression flag: {flag} "
            "(valid flags are 0 and 1), while sending request"
        )
    length = int.from_bytes(prefix[1:5], "big")
    if length > limit:
        raise MessageTooLarge(length, limit)
    return length


def frame(message: bytes) -> bytes:
    """``message`` with its (uncompressed) gRPC prefix."""
    return _PREFIX.pack(0, len(message)) + message


def check_outgoing(message: bytes, limit: int) -> None:
    """Raise :class:`MessageTooLarge` ("encoded ...") for a reply over the limit."""
    if len(message) > limit:
        raise MessageTooLarge(len(message), limit, direction="encoded")


def encode_grpc_message(text: str) -> str:
    """A status message as the ``grpc-message`` header carries it (percent-encoded
    UTF-8; printable ASCII but ``%`` as it is)."""
    return quote(text, safe=_GRPC_MESSAGE_SAFE, encoding="utf-8")


def decode_grpc_message(value: str) -> str:
    """A ``grpc-message`` header back to its text (invalid UTF-8 replaced, never an
    error: it comes from the peer)."""
    return unquote(value, encoding="utf-8", errors="replace")


class MessageReader:
    """Cuts one stream's bytes into gRPC messages, as they arrive.

    :meth:`cut` consumes from a chunk and returns ``(message, rest)``: a complete
    message (or None) and what of the chunk is left (or None once all of it was
    consumed); call it again with ``rest``. A chunk that holds exactly one whole small
    message -- the usual case -- costs one slice and no buffer. Raises
    :class:`FrameError` / :class:`MessageTooLarge` on a bad prefix (the reader is then
    unusable). :attr:`mid_message` tells a clean end from a truncated one.
    """

    __slots__ = ("_big", "_length", "_limit", "_pos", "_prefix", "_small")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._prefix = b""  # the prefix so far, while it is incomplete
        self._length = -1  # body length, -1 while reading the prefix
        self._small: list[bytes | memoryview] = []
        self._big: bytearray | None = None  # a big body so far, grown as it arrives
        self._pos = 0

    @property
    def mid_message(self) -> bool:
        """Part of a message has been consumed and the rest has not come yet."""
        return self._length >= 0 or bool(self._prefix)

    def clear(self) -> None:
        """Drop what was buffered of a message."""
        self._prefix = b""
        self._length = -1
        self._small.clear()
        self._big = None
        self._pos = 0

    def cut(
        self, data: bytes | memoryview
    ) -> tuple[bytes | bytearray | None, bytes | memoryview | None]:
        """Consume from ``data``: (a complete message or None, the unconsumed rest or None)."""
        if self._length < 0:
            if not self._prefix and len(data) >= PREFIX_SIZE:
                length = parse_prefix(bytes(data[:PREFIX_SIZE]), self._limit)
                if len(data) == PREFIX_SIZE + length and length <= SMALL_MESSAGE:
                    return bytes(data[PREFIX_SIZE:]), None  # the usual case
                data = memoryview(data)[PREFIX_SIZE:]
            else:
                need = PREFIX_SIZE - len(self._prefix)
                self._prefix += bytes(data[:need])
                data = memoryview(data)[need:] if len(data) > need else b""
                if len(self._prefix) < PREFIX_SIZE:
                    return None, None
                length = parse_prefix(self._prefix, self._limit)
                self._prefix = b""
            self._length = length
            self._pos = 0
            if length > SMALL_MESSAGE:
                # Not bytearray(length): the prefix's length is a claim. The body grows
                # as it arrives.
                self._big = bytearray()
            if length == 0:
                return self._finish(), data if len(data) else None
            if not len(data):
                return None, None
        return self._take(data)

    def _take(
        self, data: bytes | memoryview
    ) -> tuple[bytes | bytearray | None, bytes | memoryview | None]:
        need = self._length - self._pos
        piece = data if len(data) <= need else memoryview(data)[:need]
        taken = len(piece)
        if self._big is not None:
            self._big += piece
        else:
            self._small.append(bytes(piece) if isinstance(piece, memoryview) else piece)
        self._pos += taken
        rest = memoryview(data)[taken:] if len(data) > taken else None
        if self._pos < self._length:
            return None, rest
        return self._finish(), rest

    def _finish(self) -> bytes | bytearray:
        self._length = -1
        if self._big is not None:
            message: bytes | bytearray = self._big
            self._big = None
            return message
        message = b"".join(self._small)
        self._small.clear()
        return message
