"""Hostile header blocks (issue 17, findings 1 and 3): what a request's HEADERS may hold.

Each header block is sent as raw bytes (hpack and hyperframe, no HTTP/2 library that
would refuse to send it) to the reference and to ours; the outcome -- a RST_STREAM and
its code, a GOAWAY and its code, or a gRPC status -- must be the same. With a token
configured (ours only: rlmesh 0.1.0's Python server has none, SPEC 1.9) a header block
that repeats a pseudo-header or ``authorization`` is never admitted.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import time
import urllib.parse
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
from support import h2raw, scripts, wire
from support.params import skip_without_ours
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop, pytest.mark.timeout(180)]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEALTH = "/grpc.health.v1.Health/Check"
TOKEN = "t0k-3n"

Header = tuple[bytes, bytes]


def block(path: str = wire.HANDSHAKE, *extra: tuple[str | bytes, str | bytes]) -> list[Header]:
    """A well-formed request header block for ``path``, then ``extra`` fields."""
    fields: list[tuple[str | bytes, str | bytes]] = [*h2raw.request_fields(path), *extra]
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
    ":path without a leading slash": block(wire.HANDSHAKE[1:]),
    ":path *": block("*"),
    ":path as an absolute URI": block("http://localhost" + wire.HANDSHAKE),
    ":method CONNECT": [(b":method", b"CONNECT"), *block()[1:]],
    # Fields HTTP cannot carry: GOAWAY(PROTOCOL_ERROR) and close.
    "NUL in a value": block(wire.HANDSHAKE, ("x-meta", b"a\x00b")),
    "LF in a value": block(wire.HANDSHAKE, ("x-meta", b"a\nb")),
    "DEL in a value": block(wire.HANDSHAKE, ("x-meta", b"a\x7fb")),
    "uppercase name": block(wire.HANDSHAKE, ("X-Meta", "v")),
    "space in a name": block(wire.HANDSHAKE, ("x meta", "v")),
    "empty name": block(wire.HANDSHAKE, ("", "v")),
    "non-ASCII name": block(wire.HANDSHAKE, ("x-mé".encode(), "v")),
    "unknown pseudo-header": insert(2, ":protocol-x", "v", block()),
    "empty :method": [(b":method", b""), *block()[1:]],
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
    # grpc-timeout is not looked at: a deadline already past is no error either.
    "grpc-timeout 1n": block(wire.HANDSHAKE, ("grpc-timeout", "1n")),
    "grpc-timeout 0S": block(wire.HANDSHAKE, ("grpc-timeout", "0S")),
    "grpc-timeout 1u": block(wire.HANDSHAKE, ("grpc-timeout", "1u")),
    # The :path is routed without its query or fragment.
    ":path with a query": block(wire.HANDSHAKE + "?x=1"),
    ":path with an empty query": block(wire.HANDSHAKE + "?"),
    ":path with a fragment": block(wire.HANDSHAKE + "#f"),
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
    # A header list over 16 KiB (as HTTP/2 counts it): 431 and a reset, the connection
    # kept; under it, served.
    "one 16.3 KB field": block(wire.HANDSHAKE, ("x-big", "a" * 16300)),
    "two 8 KB fields": block(wire.HANDSHAKE, ("x-a", "a" * 8200), ("x-b", "b" * 8200)),
    "1000 small fields": block(wire.HANDSHAKE, *[(f"x-{i}", "v") for i in range(1000)]),
    "one 15 KB field": block(wire.HANDSHAKE, ("x-big", "a" * 15000)),
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
    payload: bytes | None = None,
    words: bool = False,
    wait: float = 3.0,
    huffman: bool = True,
) -> tuple[Any, ...]:
    """Send one request with ``fields`` as its header block and ``body`` as its message
    (or ``payload`` as its DATA, prefix included, as it is); the outcome, as a tuple:
    ("reset", code), ("goaway", code, last_stream_id), or ("status", grpc-status), with
    ``words`` also the grpc-message, percent-decoded (the reference encodes a space,
    grpclib does not)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=wait)
    try:
        data = PREFACE + SettingsFrame(0).serialize()
        data += HeadersFrame(
            1, hpack.Encoder().encode(fields, huffman=huffman), flags=["END_HEADERS"]
        ).serialize()
        if payload is None:
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
                    status = headers.get("grpc-status")
                    if not words:
                        return ("status", status)
                    return ("status", status, urllib.parse.unquote(headers.get("grpc-message", "")))
                if isinstance(frame, HeadersFrame):
                    decoder.decode(frame.data)  # keep the dynamic table in step
        return ("nothing",)
    finally:
        sock.close()


UNARY_BODIES = {
    "compressed flag, no grpc-encoding": b"\x01" + struct.pack(">I", 2) + b"\x0a\x00",
    "compression flag 2": b"\x02" + struct.pack(">I", 2) + b"\x0a\x00",
    "truncated message": struct.pack(">?I", False, 10) + b"\x0a\x00",
    "no message": b"",
    "a length over 256 MiB": struct.pack(">?I", False, 256 * 1024 * 1024 + 64),
}
# A unary request is read to its end: each message after the first is read and decoded as
# the first is (the reference answers the error of one that cannot be), then dropped.
_ONE = struct.pack(">?I", False, len(HANDSHAKE_BODY)) + HANDSHAKE_BODY
UNARY_BODIES_FOLLOWED = {
    **UNARY_BODIES,
    "two messages": _ONE * 2,
    "three messages": _ONE * 3,
    "an empty second message": _ONE + struct.pack(">?I", False, 0),
    "one stray byte": _ONE + b"\x00",
    "a cut second prefix": _ONE + b"\x00\x00",
    **{f"a second message, {name}": _ONE + body for name, body in UNARY_BODIES.items()},
    "a second message protobuf cannot read": _ONE + struct.pack(">?I", False, 3) + b"\xff" * 3,
}


@skip_without_ours
def test_unreadable_unary_messages_get_the_reference_status_and_words(
    servers: ServerPool,
) -> None:
    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    ref, ours = servers.pair("ours", config)
    differences = {}
    for name, payload in UNARY_BODIES_FOLLOWED.items():
        expected = exchange(port_of(ref.address), block(), payload=payload, words=True)
        got = exchange(port_of(ours.address), block(), payload=payload, words=True)
        assert expected[0] == "status", (name, expected)
        assert expected[1] != "0" or name not in UNARY_BODIES, (name, expected)
        if got != expected:
            differences[name] = (expected, got)
    assert differences == {}


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
def test_a_join_outlives_its_grpc_timeout_header(servers: ServerPool) -> None:
    """The reference does not look at ``grpc-timeout``: a Join sent with 200 ms is
    served past it (a deadline ended it with DEADLINE_EXCEEDED before)."""
    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    ref, ours = servers.pair("ours", config)

    async def session(address: str) -> tuple[str, str]:
        async with (
            wire.WireClient(address) as client,
            client.join(extra_headers=[("grpc-timeout", "200m")]) as join,
        ):
            first = await join.call(wire.reset(seeds=[1]))
            await asyncio.sleep(0.6)  # the header's deadline is what is tested: let it pass
            second = await join.call(wire.step([wire.i64([1])]))
            await join.call(wire.close())  # ended by the server: the next Join is admitted
            await join.wait_end()
            return wire.reply_kind(first), wire.reply_kind(second)

    for server in (ref, ours):
        assert asyncio.run(session(server.address)) == ("reset", "step"), server


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


@skip_without_ours
def test_a_health_check_is_answered_at_its_first_message(servers: ServerPool) -> None:
    """The health check (the reference has none) does not wait for its request's end:
    a probe that never half-closes is answered SERVING all the same."""
    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    server = servers.get("ours", config)
    with h2raw.Connection(server.address) as conn:
        conn.start()
        conn.send(h2raw.headers(1, h2raw.HEALTH_CHECK) + h2raw.data(1, h2raw.grpc_message(b"")))
        assert conn.wait_answered([1], 10.0)
        assert conn.stream(1).status == 0
        assert conn.stream(1).messages() == [b"\x08\x01"]  # SERVING


@skip_without_ours
def test_a_unary_call_waiting_for_its_request_holds_no_stop(servers: ServerPool) -> None:
    """A Handshake whose request never ends (a message, no END_STREAM; or headers only)
    waits for it, as the reference's does. A stop does not wait for it: before, the
    drain and then the close timeout did (here 30 s + 30 s)."""
    config = ServerConfig(
        entrypoint=scripts.ENTRYPOINTS["cartpole"],
        num_envs=1,
        drain_timeout_seconds=30.0,
        close_timeout_seconds=30.0,
    )
    server = servers.fresh("ours", config)
    with h2raw.Connection(server.address) as conn:
        conn.start()
        message = h2raw.grpc_message(HANDSHAKE_BODY)
        conn.send(
            h2raw.headers(1, wire.HANDSHAKE)
            + h2raw.data(1, message)
            + h2raw.headers(3, wire.HANDSHAKE)
            + h2raw.ping(b"is-read!")
        )
        assert conn.read_until(lambda: conn.reader.last_ping_ack == b"is-read!", 10.0)
        assert not conn.stream(1).ended and not conn.stream(3).ended  # both wait
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(20.0) == 0, server.log()
        assert time.monotonic() - started < 20.0
    server.stop()
