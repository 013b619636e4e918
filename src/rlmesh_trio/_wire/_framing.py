"""gRPC message framing (the 5-byte length prefix) and the message size limit.

A gRPC message on an HTTP/2 stream is ``flag (1 byte) | length (4 bytes, big endian) |
message``. The prefix is read and checked first, so that an over-size message is refused
before its body is buffered (SPEC §1.8).
"""

from __future__ import annotations

from .._errors import FrameError, MessageTooLarge

__all__ = ["PREFIX_SIZE", "check_outgoing", "parse_prefix"]

PREFIX_SIZE = 5


def parse_prefix(prefix: bytes, limit: int) -> int:
    """The body length a message prefix announces.

    Raises :class:`FrameError` for a truncated prefix or a compressed/invalid flag (no
    ``grpc-encoding`` is ever negotiated), :class:`MessageTooLarge` past ``limit``.
    """
    if len(prefix) != PREFIX_SIZE:
        raise FrameError("truncated message prefix")
    flag = prefix[0]
    if flag == 1:
        raise FrameError("compressed message but no grpc-encoding was negotiated")
    if flag != 0:
        raise FrameError(f"invalid compression flag {flag}")
    length = int.from_bytes(prefix[1:5], "big")
    if length > limit:
        raise MessageTooLarge(length, limit)
    return length


def check_outgoing(message: bytes, limit: int) -> None:
    """Raise :class:`MessageTooLarge` ("encoded ...") for a reply over the limit."""
    if len(message) > limit:
        raise MessageTooLarge(len(message), limit, direction="encoded")
