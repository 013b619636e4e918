"""The Join driver: one bidi stream around one sans-IO session, on the transport loop.

Requests are cut from the stream's DATA inside the connection's data callback
(:class:`~._reader.RequestReader`: no reader task, no queue), decoded and fed to the
session; the session's actions are performed here (post lane jobs, send replies,
timers, end). A reply is written at once (:class:`~._writer.StreamSender`) when nothing is
queued before it and the flow-control window and the socket take it; otherwise it is
queued for the one writer task, which sends in order, so a slow client never blocks the
loop. Lane replies come back through the server's one
:class:`~rlmesh_trio._bridge.ReplyInbox`, routed to their Join by job id
(:meth:`JoinCall.on_lane_reply`, then :meth:`JoinCall.flush`): the replies of every lane
handled in one wake-up go to the socket in one write. A job posted to several lanes
under one id (a whole-vector op) is posted with one :class:`~rlmesh_trio._bridge.Gather`:
its replies cross once, when the last lane answers (:meth:`JoinCall.on_lane_replies`); a
timer releases every gather of the Join before the session hears of it.

A Join knows nothing of its server but the :class:`JoinContext` the server built once.

Its state (:class:`~._states.JoinState`: open, decoding, not reading, flushing, broken,
closed) changes only through :meth:`JoinCall._move`, checked against
:data:`~._states.JOIN_TABLE`; docs/architecture.md ("A Join stream's states") has the
same table, and a test holds the two equal.

Back-pressure: the reader is paused while more than :data:`REPLY_BACKLOG_BYTES` of
replies wait to be sent (a client that never reads), or :data:`REQUEST_BACKLOG` requests
are queued or in flight, or a big request is being decoded; paused, it acknowledges
nothing, so h2 sends no WINDOW_UPDATE and flow control holds the client. A request
bigger than :data:`OFF_LOOP_DECODE_BYTES` is decoded on the transport's worker thread so
that it cannot stall the other connections.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import h2.exceptions
import outcome
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError
from grpclib.server import Stream

from .._bridge import Gather, ToLoop, Worker
from .._errors import (
    INTERNAL_SERVER_ERROR,
    LaneError,
    RlmeshTrioError,
    WireError,
    grpc_status,
)
from .._jobs import Job, LaneReply, Phases, ReplyFn
from .._logging import RateLimit, report
from .._proto.rlmesh.env import v1 as env_v1
from .._session import (
    Action,
    CancelTimer,
    Done,
    EndStream,
    Post,
    Report,
    Send,
    Session,
    StartTimer,
    Wedged,
)
from .._wire import PREFIX_SIZE, decode_join_request, encode_join_response_framed
from ._connection import Connection, call_of
from ._deadlines import Deadlines
from ._reader import RequestReader
from ._shim import reader_of
from ._states import JoinEvent, JoinState, join_move
from ._writer import StreamSender, reset_if_open, send_framed

if TYPE_CHECKING:
    from .._metrics import ServerMetrics

log = logging.getLogger("rlmesh_trio.transport")

REPLY_BACKLOG_BYTES = 8 << 20
"""Stop reading requests while more reply bytes than this wait to be sent."""

REQUEST_BACKLOG = 1024
"""Stop reading requests while this many are queued or in flight in the session."""

OFF_LOOP_DECODE_BYTES = 1 << 20
"""Requests bigger than this are decoded on the worker thread, not on the loop."""

BIG_MESSAGE_BYTES = 16 << 20
"""After a message this big, the server asks the allocator to give memory back."""

_BROKEN = (ConnectionError, h2.exceptions.H2Error, StreamTerminatedError)

# The states the per-request and per-reply paths compare with, as module constants (an
# enum member read off its class costs a descriptor lookup each time; a tuple is searched
# by identity, a frozenset would call the enum's __hash__).
_OPEN: Final = JoinState.OPEN
_DECODING: Final = JoinState.DECODING
_REPLYING: Final = (JoinState.OPEN, JoinState.DECODING, JoinState.NOT_READING)
"""Replies are still queued and the writer goes on (the requests may have ended)."""
_ATTACHED: Final = (*_REPLYING, JoinState.FLUSHING)
"""Sends and timers are still wanted."""


class JoinRoutes(Protocol):
    """Where a Join's lane jobs go and their replies come back from (the server's
    :class:`~._routes.ReplyRoutes`)."""

    def post(self, lane: int, job: Job, call: JoinCall) -> None:
        """Post a lane job whose reply is to be routed to ``call`` (raises
        ``LaneError`` when the lane refuses it)."""

    def gather(self, job_id: int, lanes: list[int], call: JoinCall) -> Gather:
        """Routes for one job id posted to several lanes for ``call``, and the gather
        whose ``reply`` those posts carry."""

    def post_to(self, lane: int, job: Job, reply: ReplyFn) -> None:
        """Post a lane job with a gather's ``reply`` (raises ``LaneError`` on a
        refusal)."""

    def release(self, gather: Gather) -> list[LaneReply]:
        """End a gather early: the replies it holds, their routes used."""


@dataclass(frozen=True, slots=True, eq=False)
class JoinContext:
    """What a Join needs of its server: built once by the server, shared by its Joins."""

    loop: asyncio.AbstractEventLoop
    new_session: Callable[[], Session]
    """A fresh session for a new stream."""
    num_envs: int
    max_message_bytes: int
    protocols: set[Connection]
    """The server's live connections (to find a stream's)."""
    routes: JoinRoutes
    """Where a Join's lane jobs are posted and their replies routed back."""
    wedged: Callable[[int, Job, float], None] | None
    """The lane engine's ``wedged`` (None: no supervision)."""
    report_limit: RateLimit
    metrics: ServerMetrics | None
    worker: Worker
    to_loop: ToLoop
    big_message_done: Callable[[], None]
    activity: Callable[[JoinCall], None]
    """After every Join event (busy tracking, the idle timer)."""
    reading: Callable[[], bool]
    """Whether Join streams still read requests (false once the drain is over)."""
    left: Callable[[], None] | None = None
    """The client's session ended, called once per Join before its trailers go out (so
    before the client can see the end): the recorders mark the episodes it left open."""


class JoinCall:
    """One Join stream (loop thread only). Its :attr:`state` changes only through
    :meth:`_move`, checked against :data:`~._states.JOIN_TABLE`."""

    def __init__(self, context: JoinContext, stream: Stream[bytes, bytes]) -> None:
        self.context = context
        self.stream = stream
        self.loop = context.loop
        self.state = JoinState.OPEN
        self.session = context.new_session()
        self._left = context.left
        self.deadlines = Deadlines(self.loop, self._on_timer)
        self.outbox: deque[bytes] = deque()
        self.outbox_bytes = 0
        self.direct: list[bytes] = []  # replies of this loop callback, for one DATA frame
        self.posts: list[Post] = []  # lane jobs of this loop callback, posted at its flush
        self.gathers: dict[int, Gather] = {}  # job id -> its lanes' replies, still gathering
        # Three flags that are not the stream's state (each comes and goes in several
        # states, or follows the session, not the stream):
        # inside one read's requests: flush once, at its end (any state; a span of calls);
        self.in_read = False
        # the writer is inside a send (open to flushing: the writer's progress);
        self.sending = False
        # EndStream performed or on_stream_end() called: the session learns the end once,
        # whether it ended the stream itself or the stream ended (broke) under it.
        self.session_told = False
        self.wake_writer = asyncio.Event()
        self.ended = asyncio.Event()  # no more requests: finish the stream
        self.reader: RequestReader | None = None
        self.sender: StreamSender | None = None
        self.status = Status.OK
        self.status_message: str | None = None
        self.metrics = context.metrics
        self.num_envs = context.num_envs

    # -- events into the session

    def on_lane_reply(self, reply: LaneReply) -> None:
        """A lane answered one of this Join's jobs (the server routed it here by job id).
        No flush per reply: the server calls :meth:`flush` once after its batch."""
        self._drive(self.session.on_lane_reply, reply, flush=False)

    def on_lane_replies(self, batch: list[LaneReply]) -> None:
        """A gather's replies: every lane of one job answered (one wake-up of the loop for
        all of them); the session takes them at once, and their actions are performed
        once."""
        self.gathers.pop(batch[0].job_id, None)
        self._drive(self.session.on_lane_replies, batch, flush=False)

    def _on_timer(self, token: int) -> None:
        if self.gathers:
            # A deadline reads which lanes answered: the replies gathered so far go to the
            # session first, and the rest cross one by one from now on.
            self._release_gathers()
        self._drive(self.session.on_timer, token)

    def _release_gathers(self) -> None:
        release = self.context.routes.release
        gathers = list(self.gathers.values())
        self.gathers.clear()
        taken = [reply for gather in gathers for reply in release(gather)]
        if taken:
            self._drive(self._each_reply, taken, flush=False)

    def _each_reply(self, replies: list[LaneReply]) -> list[Action]:
        on_lane_reply = self.session.on_lane_reply
        actions: list[Action] = []
        for reply in replies:
            actions += on_lane_reply(reply)
        return actions

    def _drive(self, event: Callable[..., list[Action]], *args: Any, flush: bool = True) -> None:
        try:
            actions = event(*args)
        except Exception:
            log.exception("the Join session failed on %s", getattr(event, "__name__", event))
            self.fail(Status.INTERNAL, INTERNAL_SERVER_ERROR)
            return
        self.perform(actions)
        if flush and not self.in_read:
            self.flush()

    def _on_read(self, starting: bool) -> None:
        """The connection hands over one read's requests (True), or is done (False): the
        lanes posted meanwhile are woken, and the replies written, once for all of them."""
        self.in_read = starting
        if not starting:
            self.flush()

    def flush(self) -> None:
        """The replies of this loop callback go out now: in one DATA frame when the
        window and the socket take them (several lanes' replies, one h2 send and one
        socket write), else queued, in order, for the writer. The lane jobs of the
        callback are posted first (a refusal is the job's answer, and may add a reply)."""
        if self.posts:
            self._post_all()
        sender = self.sender
        if sender is None:
            return
        direct = self.direct
        if direct:
            payload = direct[0] if len(direct) == 1 else b"".join(direct)
            direct.clear()
            try:
                sent = sender.try_send(payload)
            except _BROKEN as exc:
                log.debug("Join send failed (%r); ending the stream", exc)
                self._break()
                return
            if sent:
                if self.metrics is not None:
                    self.metrics.sent(len(payload))
            else:
                self.outbox.append(payload)
                self.outbox_bytes += len(payload)
                self.wake_writer.set()
                self._update_room()
        sender.flush()

    @property
    def attached(self) -> bool:
        """Sends and timers are still wanted."""
        return self.state in _ATTACHED

    def _move(self, event: JoinEvent) -> JoinState:
        """The one writer of :attr:`state`: ``event`` looked up in
        :data:`~._states.JOIN_TABLE` (a row that keeps the state: nothing to do)."""
        self.state = new = join_move(self.state, event)
        return new

    def perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Post):
                self.posts.append(action)
            elif isinstance(action, Send):
                if self.state in _REPLYING:
                    self._queue(action.response)
            elif isinstance(action, StartTimer):
                if self.attached:
                    self.deadlines.start(action.token, action.seconds)
            elif isinstance(action, Report):
                report(action, self.context.report_limit)
                if self.metrics is not None:
                    self.metrics.report(action)
            elif isinstance(action, Done):
                if self.metrics is not None:
                    self.metrics.done(action)
            elif isinstance(action, CancelTimer):
                self.deadlines.cancel(action.token)
            elif isinstance(action, Wedged):
                wedged = self.context.wedged
                if wedged is not None:
                    wedged(action.lane, action.job, action.seconds)
            elif isinstance(action, EndStream):
                self.session_told = True
                self.finish()
        self._update_room()
        if self.metrics is not None:
            self.metrics.depth(self.session.backlog)
        self.context.activity(self)

    def _post_all(self) -> None:
        """Post this callback's lane jobs, in order. Done at the flush that ends the
        callback, not as each request is read: a lane woken while the loop still holds
        the GIL for the rest of the read would only wait for it."""
        post = self.context.routes.post
        while self.posts:
            posts, self.posts = self.posts, []
            i, count = 0, len(posts)
            while i < count:
                action = posts[i]
                job_id = action.job.id
                j = i + 1
                if action.barrier:  # a serial op's lanes: nothing overtakes
                    while j < count and posts[j].job.id == job_id:
                        j += 1
                if j - i > 1:
                    self._post_gathered(posts[i:j])
                    i = j
                    continue
                i = j
                try:
                    post(action.lane, action.job, self)
                except LaneError as exc:  # the lane refuses: that is the job's answer
                    refusal = LaneReply(job_id, action.lane, outcome.Error(exc), Phases())
                    self._drive(self.session.on_lane_reply, refusal, flush=False)

    def _post_gathered(self, group: list[Post]) -> None:
        """Post one job's lanes with one gather: their replies cross to the loop once. A
        lane's refusal is its answer, gathered like the others'."""
        routes = self.context.routes
        gather, post_to = routes.gather, routes.post_to
        job_id = group[0].job.id
        collected = gather(job_id, [action.lane for action in group], self)
        self.gathers[job_id] = collected
        reply = collected.reply
        for action in group:
            try:
                post_to(action.lane, action.job, reply)
            except LaneError as exc:
                reply(LaneReply(job_id, action.lane, outcome.Error(exc), Phases()))

    def _queue(self, response: env_v1.JoinResponse) -> None:
        try:
            data = encode_join_response_framed(response, self.context.max_message_bytes)
        except RlmeshTrioError as exc:
            log.error("a JoinResponse was refused (%s); ending the stream", exc)
            code, message = grpc_status(exc)
            self.fail(Status(code), message)
            return
        if len(data) >= BIG_MESSAGE_BYTES:
            self.context.big_message_done()
        if self.sender is not None and not self.outbox and not self.sending:
            # The fast path: nothing queued before it, so it may overtake nothing; it is
            # written by the flush() that ends this loop callback.
            self.direct.append(data)
            return
        self.outbox.append(data)
        self.outbox_bytes += len(data)
        self.wake_writer.set()

    def _update_room(self) -> None:
        """Back-pressure: the reader is paused while too much waits, or a request is being
        decoded off the loop."""
        if self.reader is not None:
            self.reader.paused = (
                self.outbox_bytes > REPLY_BACKLOG_BYTES
                or self.session.backlog >= REQUEST_BACKLOG
                or self.state is _DECODING
            )

    def finish(self) -> None:
        """Read no more; flush what is queued, then end the stream (status as set)."""
        self._move(JoinEvent.FINISH)
        if self.reader is not None:
            self.reader.stop()
        self.wake_writer.set()
        self.ended.set()

    def fail(self, status: Status, message: str) -> None:
        if self.status is Status.OK:
            self.status, self.status_message = status, message
        self.finish()

    def _break(self) -> None:
        """The stream is gone (send failed, cancelled): nothing more is sent."""
        self._move(JoinEvent.BREAK)
        if self.reader is not None:
            self.reader.stop()
        self.direct.clear()
        self.outbox.clear()
        self.outbox_bytes = 0
        self.ended.set()

    # -- requests (inside the connection's data callback, or when the reader resumes)

    def _on_message(self, data: bytes | bytearray) -> None:
        if self.state is not _OPEN:
            return
        if self.metrics is not None:
            self.metrics.received(len(data) + PREFIX_SIZE)
        big = len(data) >= BIG_MESSAGE_BYTES
        if len(data) > OFF_LOOP_DECODE_BYTES:
            self._decode_off_loop(data, big)
            return
        try:
            request = decode_join_request(data, num_envs=self.num_envs)
        except WireError as exc:
            self._unreadable(exc)
            return
        finally:
            if big:
                self.context.big_message_done()
            del data  # the request's buffer goes now, not with the next one
        self._drive(self.session.on_request, request)
        del request  # a big request's leaves must not wait here for the next one

    def _decode_off_loop(self, data: bytes | bytearray, big: bool) -> None:
        """Decode on the worker; the reader stays paused (requests stay in order)."""
        self._move(JoinEvent.DECODE_OFF_LOOP)
        self._update_room()
        lanes = self.num_envs
        self.context.worker.submit(
            lambda: decode_join_request(data, num_envs=lanes),
            self.context.to_loop,
            functools.partial(self._decoded, big),
        )

    def _decoded(self, big: bool, result: outcome.Outcome[env_v1.JoinRequest]) -> None:
        if big:  # decoded: soon, the allocator may give the buffer's pages back
            self.context.big_message_done()
        if self._move(JoinEvent.DECODED) is not _OPEN:
            return  # stopped reading (or ended) meanwhile: the request is not read
        if isinstance(result, outcome.Error):
            error = result.error
            if isinstance(error, WireError):
                self._unreadable(error)
            else:
                log.error("decoding a JoinRequest failed: %r", error)
                self._end_reading()
            return
        request = result.unwrap()
        del result
        self._drive(self.session.on_request, request)  # resumes the reader
        del request

    def _unreadable(self, exc: WireError) -> None:
        # Undecodable or over-size: the stream ends with status 0 (SPEC §1.10).
        log.warning("unreadable JoinRequest (%s); ending the Join stream", exc)
        self._end_reading()

    def _end_reading(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.ended.set()

    def _on_reader_end(self, error: WireError | None) -> None:
        """The client half-closed (None) or sent an unreadable message.

        A half-close is the end of the requests, not of the call: what is queued or in
        flight is still answered, then the session ends the stream (as the reference).
        """
        if error is not None:
            log.warning("unreadable JoinRequest (%s); ending the Join stream", error)
            self.ended.set()
            return
        self._drive(self.session.on_half_close)

    # -- the stream

    def _tell_session(self) -> None:
        if not self.session_told:
            self.session_told = True
            self._drive(self.session.on_stream_end)

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request queued or running, nothing left to send."""
        return not (self.session.busy or self.outbox or self.sending or self.direct or self.posts)

    def stop_reading(self) -> None:
        """Read no more requests (server stopping); the stream stays open for replies."""
        self._move(JoinEvent.STOP_READING)
        if self.reader is not None:
            self.reader.stop()

    def _start_reading(self) -> None:
        reader = reader_of(self.stream, self.context.protocols)
        if reader is None:  # the connection is already gone
            self.ended.set()
            return
        self.reader = reader
        reader.start(
            self.context.max_message_bytes, self._on_message, self._on_reader_end, self._on_read
        )

    async def run(self) -> None:
        writer: asyncio.Task[None] | None = None
        try:
            # SPEC §1.3: the 0.1.0 clients wait for the response headers before sending.
            await self.stream.send_initial_metadata()
            connection, raw = call_of(self.stream)
            assert raw.id is not None
            self.sender = StreamSender(connection.output(), raw.id)
            writer = self.loop.create_task(self._write_loop())
            if self.context.reading():
                self._start_reading()
            else:
                self.stop_reading()  # the server's drain is over already
            await self.ended.wait()
            self.stop_reading()
            # Half-close, unreadable request or failed send: the session learns the stream
            # ended (SPEC §7.9); after EndStream it already knows.
            self._tell_session()
            self._tell_left()
            self.finish()  # (flushing already after EndStream; broken after a failed send)
            self.flush()  # (every event already ended with one: a safeguard)
            self.wake_writer.set()
            await writer
            if self.state is JoinState.FLUSHING:
                await self.stream.send_trailing_metadata(
                    status=self.status, status_message=self.status_message
                )
                reset_if_open(self.stream)
                self._move(JoinEvent.CLOSE)
        except _BROKEN as exc:
            log.debug("Join stream broke: %r", exc)
        finally:
            if writer is not None:
                writer.cancel()
            if self.reader is not None:
                self.reader.detach()
            if self.state is not JoinState.CLOSED:  # cancelled or broken before its trailers
                self._break()
                self._move(JoinEvent.CLOSE)
            self.deadlines.close()
            # Cancelled (client reset, disconnect, server cut): the session must know.
            self._tell_session()
            self._tell_left()
            self.context.activity(self)

    def _tell_left(self) -> None:
        left, self._left = self._left, None
        if left is not None:
            left()

    async def _write_loop(self) -> None:
        """The one writer: sends in order what could not be written at once."""
        try:
            while True:
                while self.outbox and self.attached:
                    data = self.outbox.popleft()
                    self.sending = True
                    try:
                        await send_framed(self.stream, data)
                    finally:
                        self.sending = False
                        self.outbox_bytes -= len(data)
                    if self.metrics is not None:
                        self.metrics.sent(len(data))
                    del data
                    if not self.outbox:
                        self._update_room()
                        self.context.activity(self)
                    elif self.outbox_bytes <= REPLY_BACKLOG_BYTES:
                        self._update_room()
                if self.state not in _REPLYING:
                    return
                self.wake_writer.clear()
                await self.wake_writer.wait()
        except _BROKEN as exc:
            log.debug("Join send failed (%r); ending the stream", exc)
            self._break()
