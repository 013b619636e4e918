"""Hostile header blocks (issue 17, findings 1 and 3): what a request's HEADERS may hold.

Each header block is sent as raw bytes (hpack and hyperframe, no HTTP/2 library that
would refuse to send it) to the reference and to ours; the outcome -- a RST_STREAM and
its code, a GOAWAY and its code, or a gRPC status -- must be the same. With a token
configured (ours only: rlmesh 0.1.0's Python server has none, SPEC 1.9) a header block
that repeats a pseudo-header or ``authorization`` is never admitted.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import hpack
import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)
from support import scripts, wire
from support.params import skip_without_ours
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop, pytest.mark.timeout(180)]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEALTH = "/grpc.health.v1.Health/Check"
TOKEN = "t0k-3n"

Header = tuple[bytes, bytes]


def block(path: str = wire.HANDSHAKE, *extra: tuple[str | bytes, str | bytes]) -> list[Header]:
    """A well-formed request header block for ``path``, then ``extra`` fields."""
    fields: list[tuple[str | bytes, str | bytes]] = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]
    return [(_b(k), _b(v)) for k, v in fields]


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def without(name: str, fields: list[Header]) -> list[Header]:
    return [f for f in fields if f[0] != name.encode()]


def insert(at: int, name: str, value: str, fields: list[Header]) -> list[Header]:
    return [*fields[:at], (_b(name), _b(value)), *fields[at:]]


HANDSHAKE_BODY = bytes(wire.client_handshake())

CASES: dict[str, list[Header]] = {
    # Malformed requests: RST_STREAM(PROTOCOL_ERROR), nothing dispatched.
    "repeated :path, health first": insert(2, ":path", HEALTH, block()),
    "repeated :path, health last": insert(3, ":path", HEALTH, block()),
    "repeated :method": insert(1, ":method", "POST", block()),
    "repeated :scheme": insert(2, ":scheme", "https", block()),
    "repeated :authority": insert(4, ":authority", "elsewhere", block()),
    "pseudo-header after a regular one": [*block(), (b":path", _b(wire.HANDSHAKE))],
    ":status in a request": insert(2, ":status", "200", block()),
    "connection-specific field": block(wire.HANDSHAKE, ("connection", "keep-alive")),
    "te other than trailers": [*without("te", block()), (b"te", b"gzip")],
    "no :path": without(":path", block()),
    "no :method": without(":method", block()),
    "no :scheme": without(":scheme", block()),
    "empty :path": block(""),
    # Fields HTTP cannot carry: GOAWAY(PROTOCOL_ERROR) and close.
    "NUL in a value": block(wire.HANDSHAKE, ("x-meta", b"a\x00b")),
    "LF in a value": block(wire.HANDSHAKE, ("x-meta", b"a\nb")),
    "DEL in a value": block(wire.HANDSHAKE, ("x-meta", b"a\x7fb")),
    "uppercase name": block(wire.HANDSHAKE, ("X-Meta", "v")),
    "space in a name": block(wire.HANDSHAKE, ("x meta", "v")),
    "empty name": block(wire.HANDSHAKE, ("", "v")),
    "non-ASCII name": block(wire.HANDSHAKE, ("x-mé".encode(), "v")),
    "unknown pseudo-header": insert(2, ":protocol-x", "v", block()),
    # Served.
    "non-ASCII value (UTF-8)": block(wire.HANDSHAKE, ("x-meta", "café".encode())),
    "non-ASCII value (latin-1)": block(wire.HANDSHAKE, ("x-meta", b"caf\xe9")),
    "non-ASCII authorization": block(wire.HANDSHAKE, ("authorization", "Bearer é".encode())),
    "tab in a value": block(wire.HANDSHAKE, ("x-meta", b"a\tb")),
    "repeated authorization": block(
        wire.HANDSHAKE, ("authorization", "Bearer a"), ("authorization", "Bearer b")
    ),
    "repeated content-type": block(wire.HANDSHAKE, ("content-type", "application/grpc")),
    "repeated grpc-timeout, the first valid": block(
        wire.HANDSHAKE, ("grpc-timeout", "10S"), ("grpc-timeout", "bogus")
    ),
    "unparseable grpc-timeout": block(wire.HANDSHAKE, ("grpc-timeout", "soon")),
    "no content-type": without("content-type", block()),
    "content-type text/plain": [
        *without("content-type", block()),
        (b"content-type", b"text/plain"),
    ],
    "no te": without("te", block()),
    ":method GET": [(b":method", b"GET"), *block()[1:]],
    "no :authority": without(":authority", block()),
    "non-ASCII :path": block(wire.HANDSHAKE + "é"),
    "tab in a tolerated value": block(wire.HANDSHAKE, ("user-agent", b"a\tb")),
}


def _frames(data: bytes) -> list[Frame]:
    frames: list[Frame] = []
    pos = 0
    while pos + 9 <= len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        if pos + 9 + length > len(data):
            break
        frame.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        frames.append(frame)
        pos += 9 + length
    return frames


def exchange(
    port: int,
    fields: list[Header],
    *,
    body: bytes = HANDSHAKE_BODY,
    wait: float = 3.0,
    huffman: bool = True,
) -> tuple[Any, ...]:
    """Send one request with ``fields`` as its header block; the outcome, as a tuple:
    ("reset", code), ("goaway", code, last_stream_id), or ("status", grpc-status)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=wait)
    try:
        data = PREFACE + SettingsFrame(0).serialize()
        data += HeadersFrame(
            1, hpack.Encoder().encode(fields, huffman=huffman), flags=["END_HEADERS"]
        ).serialize()
        payload = struct.pack(">?I", False, len(body)) + body
        data += DataFrame(1, payload, flags=["END_STREAM"]).serialize()
        sock.sendall(data)
        received = b""
        decoder = hpack.Decoder()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
            for frame in _frames(received):
                if isinstance(frame, RstStreamFrame) and frame.stream_id == 1:
                    return ("reset", frame.error_code)
                if isinstance(frame, GoAwayFrame):
                    return ("goaway", frame.error_code, frame.last_stream_id)
                if isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
                    headers = dict(decoder.decode(frame.data))
                    return ("status", headers.get("grpc-status"))
                if isinstance(frame, HeadersFrame):
                    decoder.decode(frame.data)  # keep the dynamic table in step
        return ("nothing",)
    finally:
        sock.close()


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@skip_without_ours
def test_header_blocks_get_the_reference_answer(servers: ServerPool) -> None:
    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    ref, ours = servers.pair("ours", config)
    differences = {}
    for name, fields in CASES.items():
        expected = exchange(port_of(ref.address), fields)
        got = exchange(port_of(ours.address), fields)
        assert expected[0] != "nothing", name  # the reference answers every case
        if got != expected:
            differences[name] = (expected, got)
    assert differences == {}
    assert "Fatal error" not in ours.log() and "Traceback" not in ours.log()


@skip_without_ours
def test_non_ascii_values_are_answered_every_time_without_a_traceback(
    servers: ServerPool,
) -> None:
    """Before: the connection dropped without GOAWAY and asyncio logged a traceback per
    request (50 requests: 50 tracebacks). The reference answers them all."""
    server = servers.fresh(
        "ours", ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    )
    fields = block(wire.HANDSHAKE, ("x-meta", "café".encode()))
    outcomes = [exchange(port_of(server.address), fields) for _ in range(50)]
    assert outcomes == [("status", "0")] * 50
    assert "Fatal error" not in server.log() and "Traceback" not in server.log()


def token_server(servers: ServerPool, *extra: str) -> Any:
    return servers.fresh(
        "ours",
        ServerConfig(
            entrypoint=scripts.ENTRYPOINTS["cartpole"],
            num_envs=1,
            allow_remote_shutdown=True,
            ours_args=("--auth-token", TOKEN, *extra),
        ),
        probe=False,
    )


def join_body() -> bytes:
    return bytes(wire.configure())


@skip_without_ours
def test_with_a_token_the_health_path_lends_no_admission(servers: ServerPool) -> None:
    """Finding 1 (critical): the exempt health path first, the real method second, no
    authorization: admitted before (Handshake answered, a Join served, Shutdown
    accepted). Every method, every order: never admitted."""
    server = token_server(servers)
    port = port_of(server.address)
    shutdown = bytes(wire.env_v1.ShutdownRequest())
    for method, body in ((wire.HANDSHAKE, HANDSHAKE_BODY), (wire.JOIN, join_body())):
        for at in (2, 3):
            fields = insert(at, ":path", HEALTH, block(method))
            assert exchange(port, fields, body=body) == ("reset", 1), (method, at)
    for at in (2, 3):
        fields = insert(at, ":path", HEALTH, block(wire.SHUTDOWN))
        assert exchange(port, fields, body=shutdown) == ("reset", 1)
    # The same with the health path the only one: the health check, no token needed.
    assert exchange(port, block(HEALTH), body=b"") == ("status", "0")
    # Without the trick: refused; with the token: served.
    assert exchange(port, block(wire.HANDSHAKE)) == ("status", "16")
    authorized = block(wire.HANDSHAKE, ("authorization", f"Bearer {TOKEN}"))
    assert exchange(port, authorized) == ("status", "0")
    assert server.alive()


@skip_without_ours
def test_with_a_token_a_repeated_authorization_is_refused(servers: ServerPool) -> None:
    server = token_server(servers)
    port = port_of(server.address)
    good, bad = ("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer wrong")
    for fields in ([good, bad], [bad, good], [good, good]):
        assert exchange(port, block(wire.HANDSHAKE, *fields)) == ("status", "16"), fields
    # Other repeated fields do not matter to admission.
    repeated_meta = block(wire.HANDSHAKE, good, ("x-meta", "1"), ("x-meta", "2"))
    assert exchange(port, repeated_meta) == ("status", "0")
    # A non-ASCII authorization is refused, not a dropped connection.
    not_ascii = block(wire.HANDSHAKE, ("authorization", f"Bearer {TOKEN}é".encode()))
    assert exchange(port, not_ascii) == ("status", "16")
    assert "Traceback" not in server.log()


@skip_without_ours
def test_the_token_is_never_logged_even_at_debug(servers: ServerPool) -> None:
    """Finding 4: hpack's DEBUG logger printed ``(b'authorization', b'Bearer ...')``."""
    server = token_server(servers, "--log-level", "debug")
    port = port_of(server.address)
    authorized = block(wire.HANDSHAKE, ("authorization", f"Bearer {TOKEN}"))
    assert exchange(port, authorized) == ("status", "0")
    # Not Huffman-coded, so that a raw header-block dump would show the bytes.
    assert exchange(port, authorized, huffman=False) == ("status", "0")
    log = server.log()  # each record is written before the reply it precedes is sent
    assert "hpack" in log  # debug logging of the HTTP/2 stack was really on
    assert TOKEN not in log
    assert "<redacted>" in log
