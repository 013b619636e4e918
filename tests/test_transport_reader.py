"""The Join's in-callback request reader (``_transport._reader.RequestReader``), sans IO.

The reader cuts gRPC messages out of a stream's DATA as h2 delivers it and acknowledges
received bytes to h2 only once they are consumed; while paused or stopped it consumes
nothing, so no WINDOW_UPDATE can go out. Here it runs against a fake h2 connection that
counts acknowledgements; the end-to-end behaviour (a saturated session stops the
client) is in ``test_transport_service.py``.
"""

from __future__ import annotations

import itertools
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh_trio._errors import FrameError, MessageTooLarge, WireError
from rlmesh_trio._transport import _reader
from rlmesh_trio._transport._reader import RequestReader
from rlmesh_trio._transport._states import (
    READER_TABLE,
    READER_TRANSITIONS,
    ReaderEvent,
    ReaderState,
    TransportStateError,
    reader_move,
)
from rlmesh_trio._wire import _framing

pytestmark = pytest.mark.timeout(60)

LIMIT = 4 << 20


@pytest.fixture(autouse=True)
def ack_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Acknowledge each consumed chunk at once, so the tests can count exactly; the
    batching itself is tested on its own below."""
    monkeypatch.setattr(_reader, "ACK_BATCH", 0)


class FakeH2:
    def __init__(self) -> None:
        self.acked = 0

    def acknowledge_received_data(self, size: int, stream_id: int) -> None:
        assert stream_id == 1
        self.acked += size


class Harness:
    def __init__(self, *, limit: int = LIMIT) -> None:
        self.h2 = FakeH2()
        self.flushes = 0
        grpclib_connection = SimpleNamespace(is_closing=lambda: False, flush=self._flush)
        self.connection = SimpleNamespace(
            readers={}, connection=grpclib_connection, _h2=lambda: self.h2
        )
        self.limit = limit
        self.messages: list[bytes] = []
        self.ends: list[WireError | None] = []
        self.pause_after: set[int] = set()  # message indexes after which to pause
        self.reader = RequestReader(self.connection, 1)  # type: ignore[arg-type]

    def start(self) -> None:
        self.reader.start(self.limit, self._on_message, self.ends.append)

    def _flush(self) -> None:
        self.flushes += 1

    def _on_message(self, data: bytes | bytearray) -> None:
        self.messages.append(bytes(data))
        if len(self.messages) - 1 in self.pause_after:
            self.reader.paused = True


def frame(message: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(message)) + message


def test_messages_split_anywhere_are_cut_out_in_order() -> None:
    messages = [b"", b"a", b"hello world", bytes(range(256)) * 3, b"z"]
    stream = b"".join(frame(m) for m in messages)
    for size in (1, 2, 4, 5, 6, 7, 13, len(stream)):
        h = Harness()
        h.start()
        for pos in range(0, len(stream), size):
            h.reader.feed(stream[pos : pos + size], len(stream[pos : pos + size]))
        h.reader.end()
        assert h.messages == messages, size
        assert h.ends == [None]
        assert h.h2.acked == len(stream)
        assert h.reader.buffered == 0


def test_a_big_message_is_read_into_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_framing, "SMALL_MESSAGE", 100)  # the cutter's (rlmesh_trio._wire)
    got: list[Any] = []
    h = Harness()
    h.reader.start(LIMIT, got.append, h.ends.append)
    body = bytes(range(256)) * 10
    stream = frame(body) + frame(b"after")
    for pos in range(0, len(stream), 333):
        h.reader.feed(stream[pos : pos + 333], 333)
    assert isinstance(got[0], bytearray) and got[0] == body
    assert got[1] == b"after"


def test_paused_consumes_and_acknowledges_nothing_until_resumed() -> None:
    h = Harness()
    h.pause_after = {0}
    h.start()
    first, second, third = frame(b"one"), frame(b"two"), frame(b"three")
    h.reader.feed(first + second, len(first + second) + 7)  # 7 bytes of padding
    assert h.messages == [b"one"] and h.reader.paused
    assert h.h2.acked == 0  # the chunk is not consumed whole: nothing acknowledged
    h.reader.feed(third, len(third))
    h.reader.end()
    assert h.messages == [b"one"] and h.h2.acked == 0 and h.ends == []
    assert h.reader.buffered == len(second + third)
    flushes = h.flushes
    h.reader.paused = False
    assert h.messages == [b"one", b"two", b"three"]
    assert h.h2.acked == len(first + second) + 7 + len(third)
    assert h.ends == [None]
    assert h.flushes > flushes  # the WINDOW_UPDATE goes out at once


def test_stop_keeps_data_unacknowledged_and_reports_no_end() -> None:
    h = Harness()
    h.start()
    h.reader.feed(frame(b"a"), 6)
    h.reader.stop()
    h.reader.feed(frame(b"b"), 6)
    h.reader.end()
    assert h.messages == [b"a"] and h.h2.acked == 6 and h.ends == []
    flushes = h.flushes
    h.reader.detach()  # the call is over: what was kept is given back to the window
    assert h.h2.acked == 12
    assert h.flushes > flushes  # at once, not with whatever the peer sends next
    assert h.connection.readers == {}


def test_closed_acknowledges_and_drops_what_still_comes() -> None:
    h = Harness()
    h.start()
    assert h.connection.readers == {1: h.reader}
    h.reader.close()
    h.reader.feed(frame(b"late"), 9)
    assert h.messages == [] and h.h2.acked == 9


def test_data_that_came_before_the_handler_started_is_held_then_comes_first() -> None:
    """The reader takes the stream's DATA from its first frame (grpclib's buffer never
    sees it) and holds it, unacknowledged, until the Join handler starts it."""
    h = Harness()
    assert h.connection.readers == {1: h.reader}
    early = frame(b"early")
    h.reader.feed(early[:3], 3)
    h.reader.feed(early[3:], len(early) - 3 + 2)  # 2 bytes of padding
    assert h.messages == [] and h.h2.acked == 0
    h.start()
    assert h.messages == [b"early"] and h.h2.acked == len(early) + 2
    h.reader.feed(frame(b"later"), 10)
    assert h.messages == [b"early", b"later"]


def test_a_half_close_before_the_handler_started_ends_the_stream_after_its_data() -> None:
    h = Harness()
    h.reader.feed(frame(b"x"), 6)
    h.reader.end()
    assert h.ends == []
    h.start()
    assert h.messages == [b"x"] and h.ends == [None]


def test_a_stream_released_before_it_was_started_gives_its_window_back() -> None:
    h = Harness()
    released: list[bool] = []
    release = h.reader.releasing(lambda: released.append(True))
    h.reader.feed(frame(b"never read"), 15)
    release()
    assert released == [True] and h.h2.acked == 15 and h.connection.readers == {}
    h.reader.feed(frame(b"late"), 9)  # dropped, acknowledged
    assert h.h2.acked == 24 and h.messages == []


@pytest.mark.parametrize(
    ("data", "error", "text"),
    [
        (frame(b"abc", flag=1), FrameError, "compressed-flag"),
        (frame(b"abc", flag=7), FrameError, "invalid compression flag: 7"),
        (struct.pack(">BI", 0, LIMIT + 1), MessageTooLarge, str(LIMIT + 1)),
        (frame(b"abcdef")[:-2], FrameError, "truncated message"),
        (b"\x00\x00", FrameError, "truncated message"),
    ],
)
def test_unreadable_input_ends_once_and_gives_the_window_back(
    data: bytes, error: type[Exception], text: str
) -> None:
    h = Harness()
    h.start()
    h.reader.feed(frame(b"ok") + data, len(frame(b"ok") + data))
    h.reader.end()
    assert h.messages == [b"ok"]
    assert len(h.ends) == 1 and isinstance(h.ends[0], error), h.ends
    assert text in str(h.ends[0])
    assert h.h2.acked == len(frame(b"ok") + data)
    h.reader.feed(b"more", 4)  # after the end: acknowledged, dropped
    assert h.h2.acked == len(frame(b"ok") + data) + 4 and h.messages == [b"ok"]


def test_a_failing_handler_ends_the_reader_instead_of_the_connection() -> None:
    h = Harness()

    def boom(data: bytes | bytearray) -> None:
        raise RuntimeError("bug")

    h.reader.start(LIMIT, boom, h.ends.append)
    h.reader.feed(frame(b"a") + frame(b"b"), 12)
    assert len(h.ends) == 1 and isinstance(h.ends[0], FrameError)
    assert h.h2.acked == 12


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=20),
    pads=st.lists(st.integers(min_value=0, max_value=3), min_size=40, max_size=40),
    pauses=st.sets(st.integers(min_value=0, max_value=11)),
    small=st.sampled_from([0, 50, 1 << 20]),
)
def test_any_chunking_and_pausing_delivers_everything_once(
    messages: list[bytes], cuts: list[int], pads: list[int], pauses: set[int], small: int
) -> None:
    old = _framing.SMALL_MESSAGE
    _framing.SMALL_MESSAGE = small  # 0 and 50 send most bodies down the big-buffer path
    try:
        h = Harness()
        h.pause_after = pauses
        h.start()
        stream = b"".join(frame(m) for m in messages)
        points = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
        fed_flow = 0
        for i, (a, b) in enumerate(itertools.pairwise(points)):
            acked_before = h.h2.acked
            was_paused = h.reader.paused
            flow = b - a + pads[i % len(pads)]
            fed_flow += flow
            h.reader.feed(stream[a:b], flow)
            if was_paused:
                assert h.h2.acked == acked_before  # paused: no WINDOW_UPDATE
            assert h.h2.acked <= fed_flow
            if h.reader.paused and i % 2:
                h.reader.paused = False  # resume sometimes between chunks
        h.reader.end()
        while h.reader.paused:
            h.reader.paused = False
        assert h.messages == messages
        assert h.ends == [None]
        assert h.h2.acked == fed_flow
        assert h.reader.buffered == 0
    finally:
        _framing.SMALL_MESSAGE = old


def test_acknowledgements_are_batched_and_none_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_reader, "ACK_BATCH", 100)
    h = Harness()
    h.start()
    one = frame(b"x" * 25)  # 30 bytes
    h.reader.feed(one, 30)
    h.reader.feed(one, 30)
    h.reader.feed(one, 30)
    assert h.h2.acked == 0  # 90 consumed: under the batch
    h.reader.feed(one, 30)
    assert h.h2.acked == 120  # the batch went out whole
    h.pause_after = {4}
    h.reader.feed(one, 30)
    assert h.reader.paused and h.h2.acked == 150  # pausing holds nothing consumed back
    h.reader.paused = False
    h.reader.feed(one, 30)
    h.reader.end()
    assert h.h2.acked == 180 and h.ends == [None]
    assert len(h.messages) == 6


# -- the reader's state table (_transport/_states.py)


def test_every_reader_state_is_reachable_and_ends_done() -> None:
    reached = {ReaderState.HOLDING} | {new for _, new in READER_TRANSITIONS}
    assert reached == set(ReaderState)
    for state in set(ReaderState) - {ReaderState.DONE}:
        assert (state, ReaderState.DONE) in READER_TRANSITIONS
    assert not any(old is ReaderState.DONE for old, _ in READER_TRANSITIONS)


def test_a_reader_event_outside_the_table_is_an_internal_error() -> None:
    for state in ReaderState:
        for event in ReaderEvent:
            if (state, event) in READER_TABLE:
                assert reader_move(state, event) is READER_TABLE[state, event]
            else:
                with pytest.raises(
                    TransportStateError,
                    match=f"^request reader: no {event.value} from {state.value}$",
                ):
                    reader_move(state, event)


def test_a_reader_life_moves_through_its_table() -> None:
    h = Harness()
    assert h.reader.state is ReaderState.HOLDING
    h.start()
    assert h.reader.state is ReaderState.READING
    h.reader.paused = True
    h.reader.paused = True  # level-triggered: still paused
    assert h.reader.state is ReaderState.PAUSED and h.reader.paused
    h.reader.paused = False
    assert h.reader.state is ReaderState.READING and not h.reader.paused
    h.reader.paused = False  # not paused: nothing to resume
    h.reader.paused = True
    h.reader.stop()
    assert h.reader.state is ReaderState.STOPPED and not h.reader.paused
    h.reader.paused = True  # stopped: reads nothing either way
    h.reader.paused = False
    h.reader.stop()
    assert h.reader.state is ReaderState.STOPPED
    h.reader.close()
    assert h.reader.state is ReaderState.DONE
    h.reader.stop()  # the Join stops its reader on every way out: done stays done
    h.reader.paused = True
    h.reader.detach()  # closed again
    assert h.reader.state is ReaderState.DONE and h.connection.readers == {}


def test_the_reported_end_is_done() -> None:
    h = Harness()
    h.start()
    h.reader.feed(frame(b"a"), 6)
    h.reader.end()
    assert h.ends == [None] and h.reader.state is ReaderState.DONE


@pytest.mark.parametrize(
    ("act", "move"),
    [
        (lambda r: r.stop(), "stop from holding"),
        (lambda r: setattr(r, "paused", True), "pause from holding"),
    ],
    ids=["stop", "pause"],
)
def test_an_unstarted_reader_refuses_to_be_stopped_or_paused_loudly(act: Any, move: str) -> None:
    """The Join starts its reader before it can stop or pause it: either call before
    that is a bug, and says so instead of being passed over."""
    h = Harness()
    with pytest.raises(TransportStateError, match=f"no {move}$"):
        act(h.reader)
    assert h.reader.state is ReaderState.HOLDING


def test_a_closed_reader_cannot_be_started() -> None:
    h = Harness()
    h.reader.close()
    with pytest.raises(TransportStateError, match=r"no start from done$"):
        h.start()
    h.reader.feed(frame(b"late"), 9)  # a refused move changes nothing: still dropped
    assert h.reader.state is ReaderState.DONE
    assert h.messages == [] and h.h2.acked == 9
