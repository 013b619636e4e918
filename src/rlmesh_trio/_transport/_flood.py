"""What one HTTP/2 connection may cost us: flood limits and per-turn slices (issue 28).

Sans-IO: :class:`FrameGate` reads the client's byte stream at frame boundaries *before*
h2 and grpclib see it (frame headers only: it never holds a payload), counts the frames
that cost us work or memory without carrying any progress, and says where one turn of the
loop stops taking this connection's frames. The connection (:class:`._connection.Connection`)
answers a limit passed with GOAWAY and closes, and hands the rest of a read over in later
turns, so one connection's frames cannot hold the transport thread.

Every limit is a constant here, each with the anchor it follows. The anchors, as their
own documentation describes them: the Rust ``h2`` crate under the reference's tonic
(``max_pending_accept_reset_streams``, ``max_local_error_reset_streams``: streams reset
before the application took them, by the peer or by us), nghttp2 (a token bucket on
stream resets, CVE-2023-44487; a cap on queued control-frame answers, CVE-2019-9512 /
9515; empty DATA and CONTINUATION, CVE-2019-9518) and Go's ``net/http2`` (a cap on queued
control frames; the connection closed with ENHANCE_YOUR_CALM). A limit passed is
answered GOAWAY(ENHANCE_YOUR_CALM) and close, as the reference does.

The values are generous for any real gRPC client (the budgets refill over time): a
client that cancels now and then, pings for keepalive or sends a WINDOW_UPDATE per
message never comes near them; a flood passes them within a few writes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ADVERTISED_STREAMS",
    "CLOSED_STREAM_FRAMES_BURST",
    "CLOSED_STREAM_FRAMES_PER_SECOND",
    "CONTROL_FRAMES_BURST",
    "CONTROL_FRAMES_PER_SECOND",
    "EMPTY_FRAMES_BURST",
    "EMPTY_FRAMES_PER_SECOND",
    "ENHANCE_YOUR_CALM",
    "FRAMES_PER_TURN",
    "FRAME_SIZE_ERROR",
    "HEADER_BLOCKS_HELD_BYTES",
    "HEADER_BLOCK_BYTES",
    "HEADER_BLOCK_SECONDS",
    "PREFACE_SIZE",
    "RESETS_BURST",
    "RESETS_PER_SECOND",
    "SERVER_BUDGETS",
    "STREAMS_HARD_LIMIT",
    "STREAM_CLOSED",
    "UNREAD_ANSWERS",
    "Bucket",
    "Flood",
    "FrameGate",
    "HeldBlocks",
    "ServerBudget",
]

FRAMES_PER_TURN = 128
"""Frames of one connection taken per turn of the transport loop. The rest of a read
waits (the connection stops reading meanwhile) until the loop has served everyone else
once: a read of 256 KiB of 9-byte frames would otherwise hold the loop ~0.3 s. A real
client's read carries a few frames."""

ADVERTISED_STREAMS = 100
"""MAX_CONCURRENT_STREAMS in our SETTINGS (h2's default, the reference's too). A stream
past it is refused alone (RST_STREAM REFUSED_STREAM, RFC 9113 §5.1.2): a client may open
more before it has read our SETTINGS, and its other calls must not pay for that."""

STREAMS_HARD_LIMIT = ADVERTISED_STREAMS + FRAMES_PER_TURN
"""Open streams h2 itself lets in (more is its GOAWAY PROTOCOL_ERROR). At most one turn's
frames reach h2 at once, so streams past :data:`ADVERTISED_STREAMS` are refused by us
before this is ever reached by a client that is merely early."""

RESETS_BURST = 200
"""Streams reset before they were answered -- by the client (RST_STREAM on a stream still
open on our side: "Rapid Reset", CVE-2023-44487) or refused by us -- a connection may
spend at once. The reference closes after about 200 such pairs; nghttp2 keeps a token
bucket on stream resets, the Rust h2 crate counts both kinds."""

RESETS_PER_SECOND = 50.0
"""How fast that budget refills: a client that cancels a call now and then never runs
out of it."""

EMPTY_FRAMES_BURST = 1000
"""Frames that carry nothing (DATA without a byte of data and without END_STREAM, a
zero-length CONTINUATION that does not end its header block), at once. Each costs a
pass through h2 for nothing (CVE-2019-9518); no client needs them. The reference answers
after a few thousand."""

EMPTY_FRAMES_PER_SECOND = 100.0
"""How fast that budget refills."""

CONTROL_FRAMES_BURST = 10_000
"""Control frames (PING, SETTINGS, WINDOW_UPDATE, PRIORITY, and frame types HTTP/2 does
not define, which are ignored, RFC 9113 §5.5) at once. Go's net/http2 caps its queued
control frames at 10,000; a client sends one per message at most."""

CONTROL_FRAMES_PER_SECOND = 2_000.0
"""How fast that budget refills."""

UNREAD_ANSWERS = 1000
"""Frames that make us answer (PING, SETTINGS, a new stream's HEADERS) taken while our
output is not being read -- the socket does not take our bytes and they pile up in the
transport's buffer (CVE-2019-9512 / 9515: nghttp2 caps such queued answers at 1,000).
Reset whenever the buffer is empty again."""

HEADER_BLOCK_BYTES = 64 << 10
"""Bytes of one header block (a HEADERS frame and its CONTINUATION frames, as sent:
HPACK-encoded) a connection may send before it ends the block. h2 holds every fragment
until the block ends and bounds their count only (64 frames: up to 1 MiB a connection,
held by a client that never ends the block); a real gRPC request's headers are a few
hundred bytes, and our decoded-size answer (431) stops at 16 KiB. The reference closes
after about 12 frames of 16 KiB."""

HEADER_BLOCK_SECONDS = 5.0
"""Seconds a header block may stay unfinished (a client ends one in a write or two)
before the connection is closed."""

HEADER_BLOCKS_HELD_BYTES = 8 << 20
"""Bytes of unfinished header blocks the whole server holds at once (over every
connection): past it, the connection whose block would pass it is closed."""

CLOSED_STREAM_FRAMES_BURST = 1000
"""DATA frames on streams already closed on our side, at once. Each makes
h2 work and may be answered (RST_STREAM STREAM_CLOSED) to a client that need not read;
a real client sends a few, in the moment before it learns the stream ended."""

CLOSED_STREAM_FRAMES_PER_SECOND = 100.0
"""How fast that budget refills."""

STREAM_CLOSED = 0x5
"""The GOAWAY error code of HEADERS on a stream already closed (RFC 9113 §5.1): the
connection is closed before its header block is decoded, as the reference does."""

ENHANCE_YOUR_CALM = 0xB
"""The GOAWAY error code of a limit passed (RFC 9113 §7)."""

FRAME_SIZE_ERROR = 0x6
"""The GOAWAY error code of a frame header announcing more than our MAX_FRAME_SIZE: known
on the header, before its body (h2 would wait for the whole body first; the reference
answers on the header)."""

PREFACE_SIZE = 24
"""``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``: checked by h2, skipped here."""

_HEADER = struct.Struct(">HBBBL")  # length as 16 + 8 bits, type, flags, stream id
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
_END_STREAM = 0x1
_ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_STREAM_ID_MASK = 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Flood:
    """A limit passed: GOAWAY with ``code`` and close; ``reason`` for the log."""

    code: int
    reason: str


class Bucket:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` per second."""

    __slots__ = ("_clock", "_last", "burst", "rate", "tokens")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = float(burst)
        self._clock = clock
        self._last = clock()

    def take(self) -> bool:
        """Spend one token; False when there is none left. Time spent full earns
        nothing: a connection idle for a minute has its burst, not a minute's worth."""
        now = self._clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self._last) * self.rate)
        self._last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class HeldBlocks:
    """The bytes of unfinished header blocks over every connection of a server (loop
    thread only): the server-wide cap, :data:`HEADER_BLOCKS_HELD_BYTES`."""

    __slots__ = ("cap", "held")

    def __init__(self, cap: int = HEADER_BLOCKS_HELD_BYTES) -> None:
        self.cap = cap
        self.held = 0

    def hold(self, size: int) -> bool:
        """Hold ``size`` bytes more; False (nothing held) when the cap would be passed."""
        if self.held + size > self.cap:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size


RATE_FLOOR_SECONDS = 0.25
"""The shortest time a connection's rate is measured over (its frames since its
window began, over at least this): a flooder is known by its first tenth of a second,
a new connection's few opening frames do not read as a rate."""

SERVER_BUDGETS = {
    # kind: (burst, per second) over every connection of a server
    "reset": (2 * RESETS_BURST, 5 * RESETS_PER_SECOND),
    "empty": (2 * EMPTY_FRAMES_BURST, 5 * EMPTY_FRAMES_PER_SECOND),
    "control": (2 * CONTROL_FRAMES_BURST, 5 * CONTROL_FRAMES_PER_SECOND),
    "closed": (2 * CLOSED_STREAM_FRAMES_BURST, 5 * CLOSED_STREAM_FRAMES_PER_SECOND),
}
"""The same kinds of frames, counted over every connection of the server: two
connections' bursts, five connections' rates in full (what one transport loop serves
while it answers others: at ~25 µs a control frame in h2, 10,000 a second are a quarter
of a core). Past the server's, a connection
that spends more than its share (the server's rate over the connections open) is closed,
GOAWAY(ENHANCE_YOUR_CALM); one that spends less (a bystander) is not. Many connections
each under its own limits (the attack of issue 43: 100-200 connections at 90 % of every
rate) otherwise add up to more than one transport loop can serve while answering
others."""


class ServerBudget:
    """What every connection of one server spends together (loop thread only): the
    :data:`SERVER_BUDGETS` buckets, the connections open, and the bytes of unfinished
    header blocks (:class:`HeldBlocks`)."""

    __slots__ = ("blocks", "buckets", "connections", "rates")

    def __init__(self, clock: Callable[[], float], blocks: HeldBlocks | None = None) -> None:
        self.buckets = {
            kind: Bucket(burst, rate, clock) for kind, (burst, rate) in SERVER_BUDGETS.items()
        }
        self.rates = {kind: rate for kind, (_burst, rate) in SERVER_BUDGETS.items()}
        self.blocks = HeldBlocks() if blocks is None else blocks
        self.connections = 0

    def take(self, kind: str) -> bool:
        return self.buckets[kind].take()

    def share(self, kind: str) -> float:
        """A connection's fair share of the server's rate for ``kind``, per second."""
        return self.rates[kind] / max(1, self.connections)


class FrameGate:
    """One connection's frame counter and turn slicer (loop thread only).

    ``stream_open(stream_id)``: None for a stream h2 has not seen yet (a new one), else
    whether it is still open on our side (a reset of it throws away work);
    ``output_backlog()``: bytes of ours the transport holds because
    the socket does not take them; ``max_frame_size``: our SETTINGS_MAX_FRAME_SIZE.
    """

    __slots__ = (
        "_block_bytes",
        "_clock",
        "_closed",
        "_control",
        "_counted",
        "_empty",
        "_head",
        "_held_blocks",
        "_max_frame_size",
        "_output_backlog",
        "_preface",
        "_rate",
        "_resets",
        "_server",
        "_skip",
        "_stream_open",
        "_unread",
        "_window",
        "block_since",
        "excised",
        "flood",
    )

    def __init__(
        self,
        clock: Callable[[], float],
        stream_open: Callable[[int], bool | None],
        output_backlog: Callable[[], int],
        max_frame_size: int = 16_384,
        server: ServerBudget | None = None,
    ) -> None:
        self._max_frame_size = max_frame_size
        self._clock = clock
        self._closed = Bucket(CLOSED_STREAM_FRAMES_BURST, CLOSED_STREAM_FRAMES_PER_SECOND, clock)
        budget = ServerBudget(clock) if server is None else server
        budget.connections += 1
        self._server: ServerBudget | None = budget
        self._held_blocks = budget.blocks
        self._window = clock()
        self._counted = 0  # budgeted frames since self._window
        self._rate = 0.0  # budgeted frames per second, over the last whole window
        self._block_bytes = 0
        self.block_since: float | None = None
        """When the header block under way started (None: none is): the connection
        closes it past :data:`HEADER_BLOCK_SECONDS` (:meth:`block_overdue`)."""
        self._resets = Bucket(RESETS_BURST, RESETS_PER_SECOND, clock)
        self._empty = Bucket(EMPTY_FRAMES_BURST, EMPTY_FRAMES_PER_SECOND, clock)
        self._control = Bucket(CONTROL_FRAMES_BURST, CONTROL_FRAMES_PER_SECOND, clock)
        self._stream_open = stream_open
        self._output_backlog = output_backlog
        self._unread = 0
        self._preface = PREFACE_SIZE
        self._head = bytearray()  # a frame header split between reads
        self._skip = 0  # payload bytes of the current frame still to come
        self.flood: Flood | None = None
        """Set once a limit is passed (by :meth:`scan` or :meth:`refused`)."""
        self.excised: tuple[int, int] | None = None
        """(stream id, bytes): :meth:`scan` stopped before a frame that must not reach h2
        (a PRIORITY frame making its stream depend on itself); the connection drops those
        bytes, resets the stream and scans on."""

    def block_overdue(self, started: float) -> None:
        """The connection's timer: the header block that started at ``started`` is still
        unfinished past :data:`HEADER_BLOCK_SECONDS`."""
        if self.flood is None and self.block_since == started:
            self.flood = Flood(
                ENHANCE_YOUR_CALM, f"a header block unfinished after {HEADER_BLOCK_SECONDS} s"
            )

    def close(self) -> None:
        """The connection is gone: what its unfinished header block held is released,
        and it no longer counts among the server's connections."""
        self._end_block()
        if self._server is not None:  # (once)
            self._server.connections -= 1
            self._server = None

    def _spend(self, own: Bucket, kind: str, reason: str) -> None:
        """One frame of ``kind``: from this connection's budget (past it: ``reason``),
        then from the server's (past it, a connection over its share is closed)."""
        if not own.take():
            self.flood = Flood(ENHANCE_YOUR_CALM, reason)
            return
        now = self._clock()
        elapsed = now - self._window
        if elapsed >= 1.0:
            self._rate = self._counted / elapsed
            self._window, self._counted, elapsed = now, 0, 0.0
        self._counted += 1
        server = self._server
        if (
            server is not None
            and not server.take(kind)
            and max(self._rate, self._counted / max(elapsed, RATE_FLOOR_SECONDS))
            > server.share(kind)
        ):
            self.flood = Flood(
                ENHANCE_YOUR_CALM,
                f"the server's budget of {kind} frames is spent, and this connection "
                f"sends more than its share",
            )

    def _end_block(self) -> None:
        if self._block_bytes:
            self._held_blocks.release(self._block_bytes)
        self._block_bytes = 0
        self.block_since = None

    def _block(self, length: int, ends: bool) -> None:
        """A fragment of a header block (a HEADERS or CONTINUATION frame) of ``length``."""
        if self.block_since is None and not ends:
            self.block_since = self._clock()
        if self._block_bytes + length > HEADER_BLOCK_BYTES:
            self.flood = Flood(
                ENHANCE_YOUR_CALM, f"a header block of more than {HEADER_BLOCK_BYTES} bytes"
            )
        elif not ends:
            if self._held_blocks.hold(length):
                self._block_bytes += length
            else:
                self.flood = Flood(
                    ENHANCE_YOUR_CALM, "the server holds too many unfinished header blocks"
                )
        if ends or self.flood is not None:
            self._end_block()

    def refused(self) -> None:
        """We reset a stream before answering it (refused, malformed): one reset spent."""
        if self.flood is None:
            self._spend(self._resets, "reset", "too many streams refused")

    def scan(self, data: bytes) -> int:
        """Count the frames of ``data`` (the next bytes of the connection) and return how
        much of it is this turn's: everything, or up to the end of the
        :data:`FRAMES_PER_TURN`-th frame header met (with what of its payload is there).
        At a limit passed (:attr:`flood` set) it stops and returns where the frame that
        passed it starts in ``data`` (0 if it started in an earlier read): what comes
        before it may still be handed on.
        """
        size = len(data)
        pos = 0
        frames = 0
        while pos < size:
            if self._preface:
                taken = min(self._preface, size - pos)
                self._preface -= taken
                pos += taken
                continue
            if self._skip:
                taken = min(self._skip, size - pos)
                self._skip -= taken
                pos += taken
                continue
            start = pos
            if self._head or size - pos < 9:
                start = 0 if self._head else pos
                need = 9 - len(self._head)
                self._head += data[pos : pos + need]
                pos += min(need, size - pos)
                if len(self._head) < 9:
                    return pos
                high, low, kind, flags, stream_id = _HEADER.unpack(self._head)
                self._head.clear()
            else:
                high, low, kind, flags, stream_id = _HEADER.unpack_from(data, pos)
                pos += 9
            length = high << 8 | low
            if length > self._max_frame_size:
                self.flood = Flood(FRAME_SIZE_ERROR, f"a frame of {length} bytes announced")
                return start
            first = data[pos] if length and pos < size else -1
            self._frame(kind, flags, stream_id & _STREAM_ID_MASK, length, first)
            if self.flood is not None:
                return start
            if kind == _PRIORITY and self._depends_on_itself(data, start, pos, length, stream_id):
                # RFC 9113 §5.3.1: a stream error, not the connection's (h2 would close
                # it): cut out here, the stream reset by the connection.
                self.excised = (stream_id & _STREAM_ID_MASK, 9 + length)
                return start
            self._skip = length
            frames += 1
            if frames >= FRAMES_PER_TURN:
                taken = min(self._skip, size - pos)
                self._skip -= taken
                return pos + taken
        return pos

    @staticmethod
    def _depends_on_itself(data: bytes, start: int, pos: int, length: int, stream_id: int) -> bool:
        """A whole PRIORITY frame of this read (header and body) naming its own stream."""
        if length != 5 or start != pos - 9 or pos + 5 > len(data):
            return False  # (split over reads, or malformed: left to h2)
        depends_on = int.from_bytes(data[pos : pos + 4], "big") & _STREAM_ID_MASK
        return stream_id != 0 and depends_on == stream_id & _STREAM_ID_MASK

    def _frame(self, kind: int, flags: int, stream_id: int, length: int, first: int) -> None:
        if kind == _DATA:
            if self._stream_open(stream_id) is False:  # (h2 answers: count, not serve)
                self._on_closed_stream("DATA")
                return
            if flags & _END_STREAM:
                return
            # Padded: the first byte is the pad length; all padding is no data either.
            empty = length == 0 or (flags & _PADDED and first >= 0 and first + 1 >= length)
            if empty:
                self._spend(self._empty, "empty", "too many empty DATA frames")
            return
        if kind == _HEADERS:
            state = self._stream_open(stream_id)
            if state is False:  # closed: before h2 decodes the block
                self.flood = Flood(STREAM_CLOSED, "HEADERS on a closed stream")
                return
            self._block(length, bool(flags & _END_HEADERS))
            if state is None and self.flood is None:  # a new stream (not trailers)
                self._answer_owed()
            return
        if kind == _RST_STREAM:
            # Every reset counts, whatever read it comes in: of a stream opened in this
            # read (h2 has not seen it yet: the classic "Rapid Reset"), of one still
            # open, or of one we answered already (the client read the answer in
            # between: a split-read "Rapid Reset" threw away the same work).
            self._spend(self._resets, "reset", "too many streams reset by the client")
            return
        if kind == _CONTINUATION:
            if length == 0 and not flags & _END_HEADERS:
                self._spend(self._empty, "empty", "too many empty CONTINUATION frames")
                if self.flood is not None:
                    return
            self._block(length, bool(flags & _END_HEADERS))
            return
        if kind in (_PUSH_PROMISE, _GOAWAY):
            return  # h2's answer (PROTOCOL_ERROR; the peer is leaving)
        self._spend(self._control, "control", "too many control frames")
        if self.flood is not None:
            return
        if kind in (_PING, _SETTINGS) and not flags & _ACK:
            self._answer_owed()

    def _on_closed_stream(self, what: str) -> None:
        self._spend(self._closed, "closed", f"too many {what} frames on closed streams")

    def _answer_owed(self) -> None:
        """A frame we must answer: count it while our answers are not being read."""
        if not self._output_backlog():
            self._unread = 0
            return
        self._unread += 1
        if self._unread > UNREAD_ANSWERS:
            self.flood = Flood(ENHANCE_YOUR_CALM, "the client does not read our answers")
