"""What a request's header block may hold, decided as the reference's HTTP/2 stack does.

h2 runs with ``validate_inbound_headers=False`` (its checks turn a malformed request
into a *connection* error, where the reference resets only the stream), so the request
header block is checked here, once per stream, before admission and dispatch. The
answers were taken from rlmesh 0.1.0's server on the wire (``tests/reference/test_hostile_headers.py``
compares them case by case):

* a field the HPACK layer cannot represent as an HTTP field -- an empty name, a name
  with anything but lowercase token characters (an uppercase letter, a space, a
  non-ASCII byte), a value with a control character other than tab (NUL, CR, LF,
  DEL), an unknown pseudo-header -- is a **connection** error: GOAWAY(PROTOCOL_ERROR)
  and close;
* a *malformed request* -- a repeated pseudo-header, a pseudo-header after a regular
  field, a response pseudo-header (``:status``), a connection-specific field, ``te``
  other than ``trailers``, a missing ``:method``, ``:scheme`` or ``:path``, an empty
  ``:path`` -- is a **stream** error: RST_STREAM(PROTOCOL_ERROR), nothing dispatched;
  A ``:path`` that does not start with ``/`` (``*``, an absolute URI) and
  ``:method CONNECT`` are malformed too; an empty ``:method`` is a connection error;
* anything else is served: non-ASCII (obs-text) bytes in a value included, and of a
  repeated regular field the first one counts (``grpc-encoding``). The reference does
  not look at ``:method``, ``content-type`` or ``te``, routes on the ``:path`` without
  its query or fragment, and ignores ``grpc-timeout`` altogether (a Join with
  ``grpc-timeout: 1S`` lives on; a Handshake with ``1n`` is answered): grpclib would
  answer 405, 415, 400, UNIMPLEMENTED, DEADLINE_EXCEEDED or UNKNOWN, so
  :func:`for_dispatch` gives grpclib the fields it insists on and none it should not
  act on.

Header values reach us decoded as latin-1 (h2's ``header_encoding``), which maps every
byte to one character: nothing a peer sends can fail to decode, and the bytes are
recovered exactly with ``.encode("latin-1")``.
"""

from __future__ import annotations

import enum
import re

import hpack

__all__ = [
    "ENCODER_TABLE_SIZE",
    "HEADER_ENCODING",
    "HEADER_LIST_LIMIT",
    "CappedEncoder",
    "Verdict",
    "check_request_headers",
    "for_dispatch",
    "header_list_size",
    "header_value",
]

HEADER_ENCODING = "latin-1"
"""h2's ``header_encoding`` for inbound headers: total (every byte decodes)."""

HEADER_LIST_LIMIT = 16384
"""The largest request header list the reference serves (hyper's default), counted as
HTTP/2 counts it (:func:`header_list_size`); a larger one (up to what HPACK decodes
here) is answered ``:status 431`` and its stream reset, the connection kept."""

REQUEST_PSEUDO = frozenset({":method", ":scheme", ":path", ":authority"})

CONNECTION_SPECIFIC = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
)

_BAD_NAME = re.compile(r"[^!#$%&'*+\-.^_`|~0-9a-z]")
"""A character outside RFC 9110's token, or an uppercase letter (HTTP/2 is lowercase)."""

_BAD_VALUE = re.compile(r"[^\t\x20-\x7e\x80-\xff]")
"""A control character but tab (obs-text, 0x80-0xFF, is allowed)."""


class Verdict(enum.Enum):
    """What becomes of a request header block."""

    OK = "ok"
    RESET_STREAM = "reset-stream"  # RST_STREAM(PROTOCOL_ERROR)
    CLOSE_CONNECTION = "close-connection"  # GOAWAY(PROTOCOL_ERROR), close


def check_request_headers(headers: list[tuple[str, str]]) -> tuple[Verdict, bool]:
    """The verdict on a request header block, and whether a regular field repeats.

    ``headers`` are as h2 decoded them (see :data:`HEADER_ENCODING`), in wire order.
    """
    malformed = False
    repeated = False
    seen_regular = False
    pseudo: set[str] = set()
    regular: set[str] = set()
    for name, value in headers:
        if _BAD_VALUE.search(value) is not None:
            return Verdict.CLOSE_CONNECTION, repeated
        if name.startswith(":"):
            if name not in REQUEST_PSEUDO:
                if name != ":status":
                    return Verdict.CLOSE_CONNECTION, repeated
                malformed = True
            elif seen_regular or name in pseudo:
                malformed = True
            pseudo.add(name)
            continue
        if not name or _BAD_NAME.search(name) is not None:
            return Verdict.CLOSE_CONNECTION, repeated
        seen_regular = True
        if name in regular:
            repeated = True
        regular.add(name)
        if name in CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
            malformed = True
    if not malformed:
        for name in (":method", ":scheme", ":path"):
            if name not in pseudo:
                malformed = True
    if not malformed:
        method = header_value(headers, ":method")
        if not method:
            return Verdict.CLOSE_CONNECTION, repeated
        path = header_value(headers, ":path")
        if not path or path[0] != "/" or method == "CONNECT":
            malformed = True
    return (Verdict.RESET_STREAM if malformed else Verdict.OK), repeated


def for_dispatch(headers: list[tuple[str, str]], repeated: bool) -> list[tuple[str, str]]:
    """``headers`` (checked :attr:`Verdict.OK`) as grpclib should see them: the first
    field of each repeated name (what the reference reads; grpclib reads the last),
    ``:method POST``, a gRPC ``content-type``, ``te: trailers``, the ``:path`` without
    its query or fragment, no ``grpc-timeout``. The list is returned as it is when
    nothing needs changing (the 0.1.0 clients' headers, SPEC 1.4)."""
    method = content_type = te = path = None
    timeout = False
    for name, value in headers:
        if name == ":method":
            method = value
        elif name == ":path":
            path = value
        elif name == "content-type" and content_type is None:
            content_type = value
        elif name == "te" and te is None:
            te = value
        elif name == "grpc-timeout":
            timeout = True
    grpc_type = content_type is not None and (
        content_type == "application/grpc" or content_type == "application/grpc+proto"
    )
    plain_path = path is not None and "?" not in path and "#" not in path
    if (
        not repeated
        and method == "POST"
        and grpc_type
        and te is not None
        and not timeout
        and plain_path
    ):
        return headers
    seen: set[str] = set()
    kept: list[tuple[str, str]] = []
    for name, value in headers:
        if name in seen:
            continue
        seen.add(name)
        if name == ":method":
            value = "POST"
        elif name == "content-type" and not grpc_type:
            value = "application/grpc"
        elif name == "grpc-timeout":
            continue
        elif name == ":path" and not plain_path:
            value = re.split(r"[?#]", value, maxsplit=1)[0]
        kept.append((name, value))
    if content_type is None:
        kept.append(("content-type", "application/grpc"))
    if te is None:
        kept.append(("te", "trailers"))
    return kept


def header_list_size(headers: list[tuple[str, str]]) -> int:
    """RFC 9113's size of a header list: each field's name and value lengths plus 32."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


def header_value(headers: list[tuple[str, str]], name: str) -> str | None:
    """The first field named ``name`` (what the reference reads), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


ENCODER_TABLE_SIZE = 4096
"""Bytes of HPACK dynamic table our encoder uses at most, whatever the client's
SETTINGS_HEADER_TABLE_SIZE allows (RFC 7541 §4.2: an encoder may use less; the change is
signalled in the next header block). h2 sizes it to the client's setting, up to 2**32-1:
every distinct value we send (a ``grpc-message`` echoing a client's service name) then
stays indexed for the connection's life, and hpack searches the table linearly on every
header it encodes."""


class CappedEncoder(hpack.Encoder):
    """h2's HPACK encoder with its dynamic table capped at :data:`ENCODER_TABLE_SIZE`."""

    @property
    def header_table_size(self) -> int:
        return int(self.header_table.maxsize)

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # (hpack's own setter: the table resized, the change signalled in the next block)
        self.header_table.maxsize = min(value, ENCODER_TABLE_SIZE)
        if self.header_table.resized:
            self.table_size_changes.append(self.header_table.maxsize)
