"""A raw rlmesh-wire-v1 client for tests, and the normalisation that makes replies comparable.

The client is a small gRPC-over-HTTP/2 client on the ``h2`` state machine and an
asyncio loop (run a session with :func:`run`). It sends and receives opaque bytes, so a
test can put anything on the wire (an unknown oneof arm, a malformed body, a
``grpc-encoding`` header) and see exactly what came back, including how a stream ended.
Messages are built and parsed with the generated betterproto2 classes; action leaves
are encoded here by hand, independently of the package's codec.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import socket
import struct
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import betterproto2
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

SERVICE = "/rlmesh.env.v1.EnvService"
HANDSHAKE = f"{SERVICE}/Handshake"
JOIN = f"{SERVICE}/Join"
SHUTDOWN = f"{SERVICE}/Shutdown"

PROTOCOL_GENERATION = "rlmesh-wire-v1"
EDITION = "2026.06"

DEFAULT_TIMEOUT = 10.0
"""Seconds any single wait of the raw client may take before the test fails."""

T = TypeVar("T")


# --------------------------------------------------------------------------- transport


@dataclass(frozen=True)
class Target:
    """Where a server listens: a TCP ``host:port`` or a unix socket path."""

    host: str | None = None
    port: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, address: str) -> Target:
        """``tcp://host:port``, ``host:port`` or ``unix:///path``."""
        if address.startswith("unix://"):
            return cls(path=address[len("unix://") :])
        if "://" not in address:
            address = "tcp://" + address
        parts = urlsplit(address)
        if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
            raise ValueError(f"not a server address: {address!r}")
        return cls(host=parts.hostname, port=parts.port)

    @property
    def authority(self) -> str:
        return "localhost" if self.path is not None else f"{self.host}:{self.port}"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.path is not None:
            return await asyncio.open_unix_connection(self.path)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer


@dataclass(frozen=True)
class CallEnd:
    """How a call ended: a gRPC status (and message), or no status at all.

    ``status`` is the numeric gRPC status (0 = OK) from the trailers (or from a
    trailers-only response); None when the stream was cut without one (RST_STREAM,
    connection closed), and ``detail`` then says how.
    """

    status: int | None
    message: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class UnaryResult:
    end: CallEnd
    reply: bytes | None
    headers: list[tuple[str, str]]
    trailers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        for key, value in [*self.headers, *self.trailers]:
            if key == name:
                return value
        return None


class _Stream:
    """What arrived on one HTTP/2 stream."""

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.headers: list[tuple[str, str]] | None = None
        self.trailers: list[tuple[str, str]] | None = None
        self.data = bytearray()
        self.ended = False  # END_STREAM from the server
        self.reset_code: int | None = None  # RST_STREAM from the server
        self.lost: str | None = None  # the connection went away
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.ended or self.reset_code is not None or self.lost is not None

    def pop_message(self) -> bytes | None:
        """The next complete length-prefixed gRPC message in the buffer, if any."""
        if len(self.data) < 5:
            return None
        compressed, length = struct.unpack(">?I", bytes(self.data[:5]))
        if len(self.data) < 5 + length:
            return None
        body = bytes(self.data[5 : 5 + length])
        del self.data[: 5 + length]
        if compressed:
            raise AssertionError("the server sent a compressed message")
        return body

    def end(self) -> CallEnd:
        for block in (self.trailers, self.headers):
            if block is not None:
                values = dict(block)
                if "grpc-status" in values:
                    message = values.get("grpc-message")
                    return CallEnd(
                        int(values["grpc-status"]), unquote(message) if message else None
                    )
        if self.reset_code is not None:
            return CallEnd(None, detail=f"RST_STREAM error code {self.reset_code}")
        if self.lost is not None:
            return CallEnd(None, detail=self.lost)
        return CallEnd(None, detail="stream ended without grpc-status")


class _GracefulH2Connection(h2.connection.H2Connection):
    """``h2`` closes the whole connection on any GOAWAY it receives, and then rejects the
    frames that follow. A graceful GOAWAY (NO_ERROR) still lets the streams already
    open finish, and gRPC servers send exactly that at shutdown: keep the connection
    usable for them, so their replies and trailers are not lost."""

    def _receive_goaway_frame(self, frame: Any) -> Any:
        state = self.state_machine.state
        result = super()._receive_goaway_frame(frame)
        if frame.error_code == 0:
            self.state_machine.state = state
        return result


class WireClient:
    """One HTTP/2 (h2c, prior knowledge) connection; ``async with WireClient(addr) as c``.

    A hand-written gRPC client on the ``h2`` state machine: it records every header
    block, message, trailer, RST_STREAM and GOAWAY exactly as the server sent them,
    so a test can see things a gRPC library hides (messages buffered before a
    RST_STREAM, a stream cut without trailers, early response headers).
    """

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.address = address
        self.target = Target.parse(address)
        self.timeout = timeout
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed: str | None = None
        self._streams: dict[int, _Stream] = {}
        self._conn = _GracefulH2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._window = asyncio.Event()

    async def __aenter__(self) -> WireClient:
        reader, writer = await asyncio.wait_for(self.target.open(), self.timeout)
        self._writer = writer
        self._conn.initiate_connection()
        self._flush()
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._writer is not None:
            if self.closed is None:
                with contextlib.suppress(Exception):
                    self._conn.close_connection()
                    self._flush()
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._writer = None
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
            self._reader_task = None

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data and self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    self._lose("connection closed by the server")
                    return
                for event in self._conn.receive_data(chunk):
                    self._dispatch(event)
                self._flush()
        except (OSError, h2.exceptions.ProtocolError) as exc:
            self._lose(f"connection lost: {exc!r}")

    def _lose(self, why: str) -> None:
        self.closed = why
        for stream in self._streams.values():
            if not stream.finished:
                stream.lost = why
            stream.changed.set()
        self._window.set()

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
            return
        if isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window.set()
            return
        stream_id = getattr(event, "stream_id", None)
        stream = self._streams.get(stream_id) if stream_id else None
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            stream.headers = [(str(k), str(v)) for k, v in event.headers]
        elif isinstance(event, h2.events.TrailersReceived):
            stream.trailers = [(str(k), str(v)) for k, v in event.headers]
        elif isinstance(event, h2.events.DataReceived):
            stream.data += event.data
            self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset):
            stream.reset_code = int(event.error_code)
        stream.changed.set()

    async def _wait(self, stream: _Stream, ready: Any, timeout: float | None) -> None:
        """Wait until ``ready()`` holds (or the stream is finished); fail after ``timeout``."""

        async def loop() -> None:
            while not ready() and not stream.finished:
                stream.changed.clear()
                await stream.changed.wait()

        await asyncio.wait_for(loop(), self.timeout if timeout is None else timeout)

    def _open(self, path: str, extra_headers: Sequence[tuple[str, str]] = ()) -> _Stream:
        if self.closed is not None:
            raise ConnectionError(self.closed)
        stream_id = self._conn.get_next_available_stream_id()
        self._streams[stream_id] = stream = _Stream(stream_id)
        self._conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", self.target.authority),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
                ("user-agent", "rlmesh-trio-tests"),
                *extra_headers,
            ],
        )
        self._flush()
        return stream

    async def _send(
        self, stream: _Stream, payload: bytes, *, end: bool = False, compressed: bool = False
    ) -> None:
        # A memoryview: slicing a big message frame by frame must not copy the rest.
        data = memoryview(struct.pack(">?I", compressed, len(payload)) + payload)
        while data:
            if self.closed is not None:
                raise ConnectionError(self.closed)
            window = min(
                self._conn.local_flow_control_window(stream.id), self._conn.max_outbound_frame_size
            )
            if window <= 0:
                self._window.clear()
                await asyncio.wait_for(self._window.wait(), self.timeout)
                continue
            chunk, data = data[:window], data[window:]
            self._conn.send_data(stream.id, bytes(chunk), end_stream=end and not data)
            self._flush()
            if self._writer is not None and len(data) > (1 << 20):
                await self._writer.drain()  # a big message: let the socket take it
        if self._writer is not None:
            await self._writer.drain()

    async def unary(
        self,
        method: str,
        payload: bytes,
        *,
        extra_headers: Sequence[tuple[str, str]] = (),
        compressed: bool = False,
    ) -> UnaryResult:
        """Call a unary method with raw bytes; report the reply, status and headers."""
        stream = self._open(method, extra_headers)
        await self._send(stream, payload, end=True, compressed=compressed)
        await self._wait(stream, lambda: False, None)
        reply = stream.pop_message()
        return UnaryResult(stream.end(), reply, stream.headers or [], stream.trailers or [])

    async def stream_call(
        self,
        method: str,
        payloads: Sequence[bytes],
        *,
        extra_headers: Sequence[tuple[str, str]] = (),
    ) -> tuple[CallEnd, list[bytes]]:
        """A client-streaming or bidi call: send every payload (END_STREAM on the last),
        then wait for the call to end; its status and every message it sent back."""
        stream = self._open(method, extra_headers)
        for index, payload in enumerate(payloads):
            try:
                await self._send(stream, payload, end=index == len(payloads) - 1)
            except h2.exceptions.StreamClosedError:
                break  # the server answered (and reset the stream) before it was all sent
        if not payloads:
            self._conn.end_stream(stream.id)
            self._flush()
        await self._wait(stream, lambda: False, None)
        replies = []
        while (reply := stream.pop_message()) is not None:
            replies.append(reply)
        return stream.end(), replies

    async def handshake(
        self, request: env_v1.HandshakeRequest | None = None
    ) -> env_v1.HandshakeResponse:
        """A Handshake as the 0.1.0 clients send it (or ``request``); fails on non-OK."""
        if request is None:
            request = client_handshake()
        result = await self.unary(HANDSHAKE, bytes(request))
        if result.end.status != 0 or result.reply is None:
            raise AssertionError(f"Handshake failed: {result.end}")
        return env_v1.HandshakeResponse.parse(result.reply)

    async def shutdown(self, reason: str = "") -> env_v1.ShutdownResponse:
        request = env_v1.ShutdownRequest(base=core_v1.ShutdownRequest(reason=reason))
        result = await self.unary(SHUTDOWN, bytes(request))
        if result.end.status != 0 or result.reply is None:
            raise AssertionError(f"Shutdown failed: {result.end}")
        return env_v1.ShutdownResponse.parse(result.reply)

    def join(self, extra_headers: Sequence[tuple[str, str]] = ()) -> JoinStream:
        """A Join stream: ``async with client.join() as join: ...``."""
        return JoinStream(self, extra_headers)


class JoinStream:
    """The client side of one Join stream, message by message.

    ``recv`` returns None once the server ended the stream, and :attr:`end` then says
    how; messages that arrived before the end are always delivered first. Leaving the
    ``async with`` block resets the stream (RST_STREAM CANCEL) if it is still open.
    """

    def __init__(self, client: WireClient, extra_headers: Sequence[tuple[str, str]] = ()) -> None:
        self.extra_headers = tuple(extra_headers)
        self.client = client
        self.end: CallEnd | None = None
        self._stream: _Stream | None = None

    async def __aenter__(self) -> JoinStream:
        self._stream = self.client._open(JOIN, self.extra_headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cancel()

    @property
    def stream(self) -> _Stream:
        assert self._stream is not None, "use JoinStream as an async context manager"
        return self._stream

    @property
    def response_headers(self) -> list[tuple[str, str]] | None:
        return self.stream.headers

    async def headers(self, timeout: float | None = None) -> list[tuple[str, str]]:
        """Wait for the response headers (SPEC §1.3: sent before any request)."""
        stream = self.stream
        await self.client._wait(stream, lambda: stream.headers is not None, timeout)
        if stream.headers is None:
            raise AssertionError(f"stream finished without headers: {stream.end()}")
        return stream.headers

    async def send(self, request: env_v1.JoinRequest | bytes) -> bool:
        """Send one request; False if the stream was already closed for sending."""
        data = request if isinstance(request, bytes) else bytes(request)
        try:
            await self.client._send(self.stream, data)
        except h2.exceptions.StreamClosedError:
            return False
        return True

    async def send_data(self, data: bytes) -> None:
        """Raw DATA bytes on the stream, no gRPC framing (to send a lying length prefix)."""
        self.client._conn.send_data(self.stream.id, data)
        self.client._flush()

    async def recv_raw(self, timeout: float | None = None) -> bytes | None:
        stream = self.stream
        message = stream.pop_message()
        if message is not None:
            return message
        if self.end is not None:
            return None
        box: list[bytes] = []

        def ready() -> bool:
            popped = stream.pop_message()
            if popped is not None:
                box.append(popped)
            return bool(box)

        await self.client._wait(stream, ready, timeout)
        if box:
            return box[0]
        popped = stream.pop_message()
        if popped is not None:
            return popped
        self.end = stream.end()
        return None

    async def recv(self, timeout: float | None = None) -> env_v1.JoinResponse | None:
        """The next reply, or None when the server ended the stream (see :attr:`end`)."""
        raw = await self.recv_raw(timeout)
        return None if raw is None else env_v1.JoinResponse.parse(raw)

    async def call(self, request: env_v1.JoinRequest | bytes) -> env_v1.JoinResponse:
        """Send one request and return its reply (fails if the stream ends instead)."""
        if not await self.send(request):
            raise AssertionError(f"stream closed before the request was sent: {self.stream.end()}")
        reply = await self.recv()
        if reply is None:
            raise AssertionError(f"stream ended instead of replying: {self.end}")
        return reply

    async def wait_end(self, timeout: float | None = None) -> CallEnd:
        """Wait until the server ends the stream; fails if a reply arrives instead."""
        raw = await self.recv_raw(timeout)
        if raw is not None:
            raise AssertionError(
                f"expected the stream to end, got {env_v1.JoinResponse.parse(raw)}"
            )
        assert self.end is not None
        return self.end

    async def half_close(self) -> None:
        """END_STREAM from the client (what ``rlmesh.run`` does at the end)."""
        self.client._conn.end_stream(self.stream.id)
        self.client._flush()

    async def cancel(self) -> None:
        """RST_STREAM(CANCEL) from the client, unless the stream is already closed."""
        if self._stream is None or self.client.closed is not None:
            return
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.client._conn.reset_stream(self.stream.id, h2.errors.ErrorCodes.CANCEL)
            self.client._flush()


@contextlib.asynccontextmanager
async def joined(
    address: str, *first: env_v1.JoinRequest, timeout: float = DEFAULT_TIMEOUT
) -> AsyncIterator[JoinStream]:
    """A connection to ``address`` and one Join on it, each of ``first`` sent and answered.

    ``async with wire.joined(address, wire.reset(seeds=[1, 2])) as join: ...`` is the
    set-up most tests start from; the replies to ``first`` are dropped (a test that looks
    at one sends it itself), and the connection is ``join.client``.
    """
    async with WireClient(address, timeout=timeout) as client, client.join() as join:
        for request in first:
            await join.call(request)
        yield join


async def probe_handshake(address: str, timeout: float) -> env_v1.HandshakeResponse:
    """Handshake until the server answers, retrying connection failures within ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.01
    while True:
        try:
            async with WireClient(address, timeout=max(0.5, deadline - loop.time())) as client:
                return await client.handshake()
        except (TimeoutError, OSError, AssertionError):
            if loop.time() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one scripted asyncio session to completion (from a sync test)."""
    return asyncio.run(coro)


# --------------------------------------------------------------------------- messages


def client_handshake(
    generation: str = PROTOCOL_GENERATION, *, with_base: bool = True
) -> env_v1.HandshakeRequest:
    """The Handshake the 0.1.0 clients send (SPEC §6.1), minus the host details."""
    if not with_base:
        return env_v1.HandshakeRequest()
    return env_v1.HandshakeRequest(
        base=core_v1.HandshakeRequest(
            protocol_generation=generation,
            peer_info=core_v1.PeerInfo(
                component="rlmesh-env",
                package_version="0.1.0",
                language="python",
                os="linux",
                arch="x86_64",
            ),
            supported_workflow_editions=[EDITION],
            preferred_workflow_edition=EDITION,
        )
    )


def configure(edition: str = EDITION, request_id: str = "") -> env_v1.JoinRequest:
    return env_v1.JoinRequest(
        configure=env_v1.ConfigureEnvRequest(selected_workflow_edition=edition),
        request_id=request_id,
    )


def reset(
    *,
    seeds: Sequence[int] = (),
    env_indices: Sequence[int] = (),
    episode_ids: Sequence[str] = (),
    options: Mapping[str, Any] | None = None,
    timeout_ms: int = 0,
    request_id: str = "",
) -> env_v1.JoinRequest:
    return env_v1.JoinRequest(
        reset=env_v1.ResetRequest(
            seeds=list(seeds),
            options=None if options is None else meta_map(options),
            timeout_ms=timeout_ms,
            env_indices=list(env_indices),
            episode_ids=list(episode_ids),
        ),
        request_id=request_id,
    )


def step(
    leaves: Sequence[bytes] | None,
    *,
    env_indices: Sequence[int] = (),
    episode_ids: Sequence[str] = (),
    timeout_ms: int = 0,
    request_id: str = "",
) -> env_v1.JoinRequest:
    return env_v1.JoinRequest(
        step=env_v1.StepRequest(
            action=None if leaves is None else spaces_v1.SpaceValue(leaves=list(leaves)),
            timeout_ms=timeout_ms,
            env_indices=list(env_indices),
            episode_ids=list(episode_ids),
        ),
        request_id=request_id,
    )


def render(env_indices: Sequence[int] = (), *, request_id: str = "") -> env_v1.JoinRequest:
    return env_v1.JoinRequest(
        render=env_v1.RenderRequest(env_indices=list(env_indices)), request_id=request_id
    )


def close(reason: str = "", *, request_id: str = "") -> env_v1.JoinRequest:
    return env_v1.JoinRequest(close=env_v1.CloseEnvsRequest(reason=reason), request_id=request_id)


def meta_value(value: Any) -> spaces_v1.MetaValue:
    """A Python value as a MetaValue (SPEC §5.1), for reset options."""
    if value is None:
        return spaces_v1.MetaValue()
    if isinstance(value, bool):
        return spaces_v1.MetaValue(bool=value)
    if isinstance(value, int):
        return spaces_v1.MetaValue(integer=value)
    if isinstance(value, float):
        return spaces_v1.MetaValue(number=value)
    if isinstance(value, str):
        return spaces_v1.MetaValue(text=value)
    if isinstance(value, bytes):
        return spaces_v1.MetaValue(bytes=value)
    if isinstance(value, list | tuple):
        return spaces_v1.MetaValue(list=spaces_v1.MetaList(items=[meta_value(v) for v in value]))
    if isinstance(value, Mapping):
        return spaces_v1.MetaValue(map=meta_map(value))
    raise TypeError(f"no MetaValue for {type(value).__name__}")


def meta_map(values: Mapping[str, Any]) -> spaces_v1.MetaMap:
    return spaces_v1.MetaMap(entries={k: meta_value(v) for k, v in values.items()})


def from_meta_value(value: spaces_v1.MetaValue) -> Any:
    """A MetaValue back as plain Python (None for the empty MetaValue)."""
    kind, inner = betterproto2.which_one_of(value, "kind")
    if kind == "list":
        assert inner is not None
        return [from_meta_value(v) for v in inner.items]
    if kind == "map":
        return from_meta_map(inner)
    if kind == "":
        return None
    return inner


def from_meta_map(values: spaces_v1.MetaMap | None) -> dict[str, Any]:
    if values is None:
        return {}
    return {k: from_meta_value(v) for k, v in values.entries.items()}


# --------------------------------------------------------------------------- action leaves


def i64(values: Iterable[int]) -> bytes:
    """Discrete / MultiDiscrete leaf slab."""
    values = list(values)
    return struct.pack(f"<{len(values)}q", *values)


def f32(values: Iterable[float]) -> bytes:
    values = list(values)
    return struct.pack(f"<{len(values)}f", *values)


def u8(values: Iterable[int]) -> bytes:
    """MultiBinary / uint8 / bool leaf slab."""
    return bytes(values)


def text_slab(texts: Sequence[str]) -> bytes:
    """The Text leaf in slab form: count, lengths, bodies (SPEC §3.4)."""
    bodies = [t.encode() for t in texts]
    return struct.pack(f"<{1 + len(bodies)}Q", len(bodies), *map(len, bodies)) + b"".join(bodies)


def nested_action(rows: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """Leaves of ``NestedEnv``'s Dict action for ``len(rows)`` lanes (keys in sorted order)."""
    return [
        u8(b for row in rows for b in row["buttons"]),
        i64(int(row["fire"]) for row in rows),
        f32(x for row in rows for x in row["move"]),
        text_slab([str(row["say"]) for row in rows]),
    ]


# --------------------------------------------------------------------------- normalisation

TIMING_SUFFIX = "_ns"
UNORDERED_FIELDS = frozenset({"completed_episodes", "final_episodes", "interrupted_episodes"})


def plain(value: Any, *, drop: frozenset[str] = frozenset()) -> Any:
    """A decoded message as comparable plain data.

    Drops every ``*_ns`` field (timings and timestamps) and the fields named in
    ``drop``; sorts the episode lists whose order the server does not define (SPEC
    AMBIGUITIES 10); maps stay dicts (their wire order is hash order); enums become
    their names; unset message fields stay None, so presence is compared too.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for field in dataclasses.fields(value):
            name = field.name
            if name.endswith(TIMING_SUFFIX) or name in drop:
                continue
            item = plain(getattr(value, name), drop=drop)
            if name in UNORDERED_FIELDS and isinstance(item, list):
                item = sorted(item, key=repr)
            out[name] = item
        return out
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        return [plain(v, drop=drop) for v in value]
    if isinstance(value, dict):
        # A map entry without a value and one with an empty message value are the same
        # thing in protobuf (the default instance): an empty MetaValue, i.e. None.
        return {k: None if _empty(v) else plain(v, drop=drop) for k, v in value.items()}
    return value


def _empty(value: Any) -> bool:
    """A message with no field set (as a map value, equal to an absent value)."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and all(
            getattr(value, f.name) in (None, 0, "", b"", [], {}) for f in dataclasses.fields(value)
        )
    )


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """Where two plain values first differ (``None`` if they are equal), for messages."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in [*want, *(k for k in got if k not in want)]:
            if key not in got or key not in want:
                return f"{path}.{key}: present on one side only"
            found = first_difference(want[key], got[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(want, list | tuple) and isinstance(got, list | tuple):
        for i, (a, b) in enumerate(zip(want, got, strict=False)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        if len(want) != len(got):
            return f"{path}: length {len(want)} != {len(got)}"
        return None
    if want != got:
        return f"{path or '$'}: reference {_short(want)} != peer {_short(got)}"
    return None


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def assert_same(reference: Any, peer: Any) -> None:
    """``peer == reference``, failing with the path of the first difference."""
    difference = first_difference(reference, peer)
    assert difference is None, difference
    assert peer == reference


def timing_fields(reply: env_v1.JoinResponse) -> list[str]:
    """Names of the timing fields a reply carries (SPEC §8)."""
    return sorted(
        f.name
        for f in dataclasses.fields(reply)
        if f.name.endswith(TIMING_SUFFIX) and getattr(reply, f.name) is not None
    )


def reply_kind(reply: env_v1.JoinResponse) -> str:
    return betterproto2.which_one_of(reply, "kind")[0]
