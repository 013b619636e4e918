"""Which streams of a connection are served: grpclib's ``Handler``, subclassed.

:class:`Dispatcher` sees request headers before dispatch: it refuses streams while
stopping or past our MAX_CONCURRENT_STREAMS, refuses compressed or unauthenticated
requests (trailers-only, from tasks of its own: ``cancel``/``close``/``wait_closed`` know
them), remembers the last stream id for GOAWAY, and gives a direct-path call (the Join)
its :class:`~._reader.RequestReader` from its first frame. The handler task grpclib
creates inside ``accept`` finds its connection and h2-level stream in a context variable
(:func:`current_call`; typed for the connection by ``_connection.call_of``). Its
connection (:class:`~._connection.Connection`, known here only as the
:class:`~._reader.ReaderConnection` its readers need) sets the hooks it calls back.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from grpclib.const import Handler as MethodHandler
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Stream
from h2.errors import ErrorCodes

from .._errors import CompressedRequestError, UnauthenticatedError, grpc_status
from .._wire import encode_grpc_message
from ._flood import ADVERTISED_STREAMS
from ._headers import (
    HEADER_LIST_LIMIT,
    Verdict,
    check_request_headers,
    for_dispatch,
    header_list_size,
    header_value,
)
from ._privates import dispatch_events
from ._reader import ReaderConnection, RequestReader

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream

log = logging.getLogger("rlmesh_trio.transport")


class Admission(Protocol):
    """What :class:`Dispatcher` asks the server about each new stream.

    A Protocol, not ``LoopServer`` itself: ``_server.py`` imports this module (it builds
    the dispatcher and reads the connections), so naming it here would be a cycle. The
    server is the only implementation."""

    @property
    def closing(self) -> bool: ...

    def authorized(self, path: str | None, authorization: str | None) -> bool: ...


_CALL: contextvars.ContextVar[tuple[ReaderConnection, H2Stream]] = contextvars.ContextVar("_CALL")
"""The connection and h2-level stream of the call whose handler task this is: set by
:meth:`Dispatcher.accept` around grpclib's ``accept``, which creates the handler task
(a task copies the context it was created in). Public ground: grpclib's server
``Stream`` keeps its h2-level stream in a private attribute."""


def current_call() -> tuple[ReaderConnection, H2Stream]:
    """The connection and h2-level stream of the call this handler task (or a task it
    started) serves."""
    try:
        return _CALL.get()
    except LookupError:
        raise RuntimeError("not inside a request handler's task") from None


def h2_stream(stream: Stream[Any, Any]) -> H2Stream:
    """The h2-level stream of ``stream``, the call this handler task serves."""
    return current_call()[1]


def _count(headers: list[tuple[str, str]], name: str) -> int:
    return sum(1 for key, _ in headers if key == name)


class Dispatcher(GrpclibHandler):
    """One per connection: grpclib's request dispatcher, with our admission checks."""

    def __init__(
        self,
        admission: Admission,
        mapping: dict[str, MethodHandler],  # a MethodTable (_shim.py)
        codec: CodecBase,
        direct_paths: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(mapping, codec, None, dispatch_events())
        self._admission = admission
        self._direct_paths = direct_paths
        self._refusals: dict[H2Stream, asyncio.Task[None]] = {}
        self.owner: ReaderConnection | None = None  # set by the connection
        self.last_stream_id = 0
        # Set by the connection: a header block that is a connection error (GOAWAY);
        # how many streams it has dispatched and not released; a stream refused.
        self.on_connection_error: Callable[[], None] | None = None
        self.streams_in_use: Callable[[], int] = lambda: 0
        self.on_refused: Callable[[], None] = lambda: None

    def accept(
        self, stream: H2Stream, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        if not stream.closable:
            # Reset by the client in the same read as its HEADERS ("Rapid Reset"): no
            # handler, no task, nothing to answer (the frame gate counted the reset).
            release_stream()
            return
        # grpclib registered this stream before calling us: it counts itself.
        if self._admission.closing or self.streams_in_use() > ADVERTISED_STREAMS:
            # After GOAWAY, or past our MAX_CONCURRENT_STREAMS (a client may open more
            # before it read our SETTINGS): "not processed, safe to retry", this stream
            # alone (RFC 9113 §5.1.2, §8.7).
            if stream.closable:  # not already reset by the client
                stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
                self.on_refused()
            release_stream()
            return
        verdict, repeated = check_request_headers(headers)
        if verdict is not Verdict.OK:
            # The reference's answers to a malformed header block (see _headers.py).
            log.debug("malformed request headers: %s", verdict.value)
            if verdict is Verdict.RESET_STREAM:
                if stream.closable:
                    stream.reset_nowait(ErrorCodes.PROTOCOL_ERROR)
                    self.on_refused()
            elif self.on_connection_error is not None:
                self.on_connection_error()
            release_stream()
            return
        if header_list_size(headers) > HEADER_LIST_LIMIT:
            # The reference's answer: 431, then RST_STREAM(PROTOCOL_ERROR); nothing
            # dispatched, the connection kept.
            self.on_refused()
            self._refuse(
                stream,
                answer_and_reset(
                    stream, [(":status", "431")], release_stream, ErrorCodes.PROTOCOL_ERROR
                ),
            )
            return
        if stream.id is not None:
            self.last_stream_id = max(self.last_stream_id, stream.id)
        # With a token, a repeated authorization is refused: which one would count?
        ambiguous = repeated and _count(headers, "authorization") > 1
        headers = for_dispatch(headers, repeated)
        error: Exception | None = None
        # Pseudo-headers are unique here: this :path is the one grpclib dispatches on.
        path = header_value(headers, ":path")
        if not self._admission.authorized(path, header_value(headers, "authorization")) or (
            ambiguous and not self._admission.authorized(path, None)
        ):
            error = UnauthenticatedError()
        else:
            encoding = header_value(headers, "grpc-encoding")
            if encoding is not None and encoding != "identity":
                error = CompressedRequestError(encoding)
        if error is not None:
            code, message = grpc_status(error)
            self._refuse(stream, send_trailers_only(stream, code, message, release_stream))
            return
        owner = self.owner
        assert owner is not None and stream.id is not None
        if path in self._direct_paths:
            # Its DATA goes to a reader of ours from the first frame on (held until the
            # handler starts it), never to grpclib's per-stream buffer.
            reader = RequestReader(owner, stream.id)
            release_stream = reader.releasing(release_stream)
        token = _CALL.set((owner, stream))
        try:
            super().accept(stream, headers, release_stream)
        finally:
            _CALL.reset(token)

    def _refuse(self, stream: H2Stream, answer: Coroutine[Any, Any, None]) -> None:
        """Answer a stream that is not dispatched, in a task of its own (a client reset
        cancels it, see :meth:`cancel`)."""
        task = self.loop.create_task(answer)
        self._refusals[stream] = task
        task.add_done_callback(lambda _: self._refusals.pop(stream, None))

    def cancel(self, stream: H2Stream) -> None:
        task = self._refusals.pop(stream, None)
        if task is not None:
            task.cancel()
            return
        super().cancel(stream)

    def close(self) -> None:
        for task in self._refusals.values():
            task.cancel()
        super().close()

    async def wait_closed(self) -> None:
        refusals = list(self._refusals.values())
        if refusals:
            await asyncio.wait(refusals)
        await super().wait_closed()

    def check_closed(self) -> bool:
        return not self._refusals and super().check_closed()


async def answer_and_reset(
    stream: H2Stream,
    headers: list[tuple[str, str]],
    release_stream: Callable[[], Any],
    reset_code: ErrorCodes = ErrorCodes.NO_ERROR,
) -> None:
    """The only answer a refused stream gets: ``headers`` (end of stream), then
    RST_STREAM(``reset_code``) if the stream is still open, so nothing more of the
    request is read; ``release_stream`` in every case."""
    try:
        await stream.send_headers(headers, end_stream=True)
        if stream.closable:
            stream.reset_nowait(reset_code)
    except Exception:
        log.debug("could not answer a refused stream", exc_info=True)
    finally:
        release_stream()


async def send_trailers_only(
    stream: H2Stream, status: int, message: str, release_stream: Callable[[], Any]
) -> None:
    """A trailers-only response on an h2 stream grpclib has not wrapped (SPEC §1.5, §1.7)."""
    await answer_and_reset(
        stream,
        [
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-accept-encoding", "identity"),
            ("grpc-status", str(Status(status).value)),
            ("grpc-message", encode_grpc_message(message)),
        ],
        release_stream,
    )
