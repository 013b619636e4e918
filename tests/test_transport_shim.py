"""The Join's direct DATA path (``_transport._h2frames``: ``route_frames``,
``take_plain_data``, ``put_plain_data``) against h2 alone.

The server hands a Join stream's plain DATA frames to its reader without h2's frame
objects and events, keeping h2's flow-control windows and stream bookkeeping exact, and
writes a reply's DATA frames the same way. Here one byte stream from a client -- DATA on
several streams (padded, END_STREAM, empty, over the windows, on unknown or closed
streams, on a stream with a content-length), PING, SETTINGS, WINDOW_UPDATE, PRIORITY,
RST_STREAM, unknown frame types, garbage -- is fed to two h2 server connections built
alike: one takes every byte through h2's ``receive_data`` (the reference behaviour), the
other through ``route_frames`` exactly as ``Connection.data_received`` does, each chunked
its own way. They must deliver the same bytes to the same streams, see the same other
events, end in the same h2 state (windows, stream states, content-length counts), write
the same frames and fail with the same error.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest
from hyperframe.frame import (
    Frame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlmesh_trio._transport import _h2frames, _shim

pytestmark = pytest.mark.timeout(120)

SINK_STREAMS = (1, 3, 5)
"""Streams with a direct reader (5 has a content-length: never the direct path)."""
OTHER_STREAM = 7
"""An open stream without a reader: its DATA goes to grpclib as h2 events."""
STREAMS = (*SINK_STREAMS, OTHER_STREAM)


def _client() -> h2.connection.H2Connection:
    return h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))


def _server() -> h2.connection.H2Connection:
    server = h2.connection.H2Connection(_shim.server_config()[1])
    server.initiate_connection()
    server.data_to_send()
    return server


def _opening() -> bytes:
    """The client's preface, SETTINGS and the HEADERS of every stream."""
    client = _client()
    client.initiate_connection()
    for stream_id in STREAMS:
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/rlmesh.env.v1.EnvService/Join"),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
        ]
        if stream_id == 5:
            headers.append(("content-length", "40"))
        client.send_headers(stream_id, headers)
    return client.data_to_send()


OPENING = _opening()


def _frame(frame: Frame) -> bytes:
    return frame.serialize()


def _data(stream_id: int, body: bytes, flags: set[str], pad: int) -> bytes:
    """A DATA frame (built by hand: any stream id, PADDED with ``pad`` bytes)."""
    bits = (0x1 if "END_STREAM" in flags else 0) | (0x8 if "PADDED" in flags else 0)
    if bits & 0x8:
        body = bytes([pad]) + body + b"\0" * pad
    return _raw(len(body), 0x0, bits, stream_id, body)


def _raw(length: int, frame_type: int, flags: int, stream_id: int, body: bytes) -> bytes:
    header = length.to_bytes(3, "big") + bytes([frame_type, flags]) + stream_id.to_bytes(4, "big")
    return header + body


stream_ids = st.sampled_from((*STREAMS, 9, 2, 0, 0x80000001))
"""Open streams, an idle one, a server-side id, the connection, one with the reserved bit."""

plain = st.builds(  # the direct path's own case
    lambda sid, n: _data(sid, (b"rlmesh" * (n // 6 + 1))[:n], set(), 0),
    st.sampled_from((1, 3, OTHER_STREAM)),
    st.integers(1, 3000),
)
control = st.one_of(
    st.builds(
        lambda opaque: _frame(PingFrame(0, opaque_data=opaque)), st.binary(min_size=8, max_size=8)
    ),
    st.builds(
        lambda window: _frame(
            SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: window})
        ),
        st.integers(0, 1 << 20),
    ),
    st.builds(
        lambda sid, inc: _frame(WindowUpdateFrame(sid, window_increment=inc)),
        st.sampled_from((0, *STREAMS)),
        st.integers(1, 1 << 20),
    ),
    st.builds(
        lambda sid: _frame(PriorityFrame(sid, depends_on=0, stream_weight=16)),
        stream_ids.filter(lambda sid: 0 < sid < 1 << 31),
    ),
    st.builds(lambda sid: _frame(RstStreamFrame(sid, error_code=8)), st.sampled_from(STREAMS)),
    st.builds(lambda n: _data(5, b"c" * n, set(), 0), st.integers(1, 40)),  # content-length
    st.builds(
        lambda sid, body: _raw(len(body), 0xB, 0, sid, body), stream_ids, st.binary(max_size=40)
    ),
    # DATA with flags, empty, big (past the windows), on odd streams.
    st.builds(
        lambda sid, n, flags, pad: _data(sid, b"x" * n, flags, pad),
        st.sampled_from((*STREAMS, *STREAMS, 9, 0x80000001)),
        st.integers(0, 5000),
        st.sets(st.sampled_from(("END_STREAM", "PADDED"))),
        st.integers(0, 255),
    ),
    # Unknown flag bits on DATA (h2 ignores them), the reserved stream-id bit.
    st.builds(
        lambda sid, n, flags: _raw(n, 0x0, flags, sid, b"y" * n),
        stream_ids,
        st.integers(1, 500),
        st.sampled_from((0x02, 0x04, 0x10, 0x20, 0x40, 0x80, 0xF6)),
    ),
)
hostile = st.one_of(
    st.builds(  # a frame over MAX_FRAME_SIZE, whole or only announced
        lambda sid, whole: _raw(20000, 0x0, 0, sid, b"z" * (20000 if whole else 100)),
        stream_ids,
        st.booleans(),
    ),
    st.binary(min_size=1, max_size=30),  # garbage
)
sequences = st.lists(
    st.tuples(st.lists(plain, max_size=4), st.one_of(st.none(), control, control, hostile)),
    min_size=1,
    max_size=8,
).map(lambda groups: [f for run, other in groups for f in (*run, *([other] if other else []))])
"""Runs of plain DATA, each followed by a control frame or an odd DATA, now and then an
attack or nothing."""


@dataclass
class Side:
    """One server connection and everything observable about it."""

    h2c: h2.connection.H2Connection
    stingy: bool
    """Acknowledge nothing (the windows run out) instead of every delivered byte."""
    delivered: dict[int, bytearray] = field(default_factory=dict)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    output: bytearray = field(default_factory=bytearray)
    error: tuple[str, int | None] | None = None

    def deliver(self, stream_id: int, data: bytes, length: int) -> None:
        self.delivered.setdefault(stream_id, bytearray()).extend(data)
        if not self.stingy and length:
            with contextlib.suppress(h2.exceptions.H2Error):
                self.h2c.acknowledge_received_data(length, stream_id)

    def on_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id in SINK_STREAMS:
                assert event.data is not None and event.flow_controlled_length is not None
                self.deliver(event.stream_id, event.data, event.flow_controlled_length)
            else:
                self.events.append(_describe(event))

    def receive(self, data: bytes) -> bool:
        """h2's ``receive_data`` and the events' handling (False: the connection failed)."""
        try:
            events = self.h2c.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.fail(exc)
            return False
        self.on_events(events)
        self.output += self.h2c.data_to_send()
        return True

    def fail(self, exc: Exception) -> None:
        self.output += self.h2c.data_to_send()
        self.error = (type(exc).__name__, getattr(exc, "error_code", None))


class Sink:
    def __init__(self, side: Side, stream_id: int) -> None:
        self.side = side
        self.stream_id = stream_id

    def feed(self, data: bytes, flow_controlled_length: int) -> None:
        self.side.deliver(self.stream_id, data, flow_controlled_length)


def _describe(event: h2.events.Event) -> tuple[Any, ...]:
    name = type(event).__name__
    if isinstance(event, h2.events.DataReceived):
        return (name, event.stream_id, event.data, event.flow_controlled_length)
    if isinstance(event, h2.events.PingReceived):
        return (name, event.ping_data)
    if isinstance(event, h2.events.WindowUpdated):
        return (name, event.stream_id, event.delta)
    return (name, getattr(event, "stream_id", None))


def _state(h2c: h2.connection.H2Connection) -> dict[str, Any]:
    windows = h2c._inbound_flow_control_window_manager
    state: dict[str, Any] = {
        "connection": h2c.state_machine.state,
        "inbound": (windows.current_window_size, windows.max_window_size),
        "outbound": h2c.outbound_flow_control_window,
    }
    for stream_id, stream in sorted(h2c.streams.items()):
        manager = stream._inbound_window_manager
        state[f"stream {stream_id}"] = (
            stream.state_machine.state,
            manager.current_window_size,
            stream.outbound_flow_control_window,
            stream._actual_content_length,
        )
    return state


def _frames_out(data: bytes) -> Counter[bytes]:
    """The frames a side wrote, as a multiset (a direct delivery acknowledges -- and so
    writes its WINDOW_UPDATE -- before h2 would have answered a PING of the same read)."""
    out: Counter[bytes] = Counter()
    pos = 0
    while pos + 9 <= len(data):
        end = pos + 9 + int.from_bytes(data[pos : pos + 3], "big")
        out[bytes(data[pos:end])] += 1
        pos = end
    return out


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def _opened(stingy: bool) -> Side:
    side = Side(_server(), stingy)
    assert side.receive(OPENING)
    side.output.clear()
    side.events.clear()
    return side


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sequences,
    st.lists(st.integers(0, 1 << 16), max_size=12),
    st.lists(st.tuples(st.integers(0, 40), st.sampled_from((0, 0, 0, 1, 5, 9, 100))), max_size=6),
    st.booleans(),
)
def test_direct_path_is_h2(
    sequence: list[bytes],
    cuts_h2: list[int],
    cuts_direct: list[tuple[int, int]],
    stingy: bool,
) -> None:
    stream = b"".join(sequence)
    # The direct side is cut mostly between frames (as reads of small messages are), now
    # and then inside a frame or its header; h2 alone anywhere.
    bounds = [sum(map(len, sequence[:i])) for i in range(len(sequence) + 1)]
    cuts = [bounds[i % len(bounds)] + offset for i, offset in cuts_direct]
    alone = _opened(stingy)
    for chunk in _chunks(stream, cuts_h2):
        if not alone.receive(chunk):
            break

    direct = _opened(stingy)
    sinks = {stream_id: Sink(direct, stream_id) for stream_id in SINK_STREAMS}
    for chunk in _chunks(stream, cuts):
        done = _h2frames.route_frames(
            direct.h2c, chunk, sinks, direct.receive, lambda: direct.error is not None
        )
        direct.output += direct.h2c.data_to_send()
        if not done or direct.error is not None:
            break

    assert direct.error == alone.error
    if alone.error is None:
        assert direct.delivered == alone.delivered
        assert direct.events == alone.events
        assert _state(direct.h2c) == _state(alone.h2c)
        assert _frames_out(direct.output) == _frames_out(alone.output)
    else:
        # h2 drops the events of a read that ends in an error, so each side may have
        # delivered less of its last read (their reads differ): one is a prefix of the
        # other, never something else.
        for stream_id in set(alone.delivered) | set(direct.delivered):
            a, d = alone.delivered.get(stream_id, b""), direct.delivered.get(stream_id, b"")
            assert a.startswith(d) or d.startswith(a)
        shorter = min(len(alone.events), len(direct.events))
        assert direct.events[:shorter] == alone.events[:shorter]
        goaway_alone = [f for f in _frames_out(alone.output) if f[3] == 0x7]
        goaway_direct = [f for f in _frames_out(direct.output) if f[3] == 0x7]
        assert goaway_direct == goaway_alone


def test_plain_data_takes_the_direct_path() -> None:
    """The everyday case does bypass h2's frame handling (the property above would also
    hold if nothing ever took the direct path)."""
    side = _opened(stingy=False)
    taken: list[bytes] = []

    def through_h2(data: bytes) -> bool:
        taken.append(data)
        return side.receive(data)

    sinks = {stream_id: Sink(side, stream_id) for stream_id in SINK_STREAMS}
    frames = _data(1, b"a" * 30, set(), 0) + _data(3, b"b" * 20, set(), 0)
    assert _h2frames.route_frames(side.h2c, frames, sinks, through_h2, lambda: False)
    assert taken == []
    assert side.delivered == {1: bytearray(b"a" * 30), 3: bytearray(b"b" * 20)}
    # Padded, END_STREAM, content-length and reader-less streams still go through h2.
    for frame in (
        _data(1, b"c", {"PADDED"}, 3),
        _data(5, b"d" * 40, set(), 0),
        _data(OTHER_STREAM, b"e", set(), 0),
        _data(3, b"f", {"END_STREAM"}, 0),
    ):
        assert _h2frames.route_frames(side.h2c, frame, sinks, through_h2, lambda: False)
    assert len(taken) == 4
    assert side.delivered[1] == b"a" * 30 + b"c"
    assert side.delivered[3] == b"b" * 20 + b"f"
    assert side.delivered[5] == b"d" * 40


def _sending_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    pair = []
    for _ in range(2):
        server = _opened(stingy=False).h2c
        server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
        server.send_headers(3, [(":status", "200")])
        server.data_to_send()
        pair.append(server)
    return pair[0], pair[1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from((1, 3, 5, 9)), st.integers(0, 40000), st.booleans()),
        max_size=12,
    )
)
def test_direct_send_is_h2(sends: list[tuple[int, int, bool]]) -> None:
    """``put_plain_data`` writes the bytes h2's ``send_data`` writes and leaves h2 in the
    same state; where it declines (closed or unknown stream, window, frame size, empty),
    h2's own ``send_data`` is called and raises or sends what it always does."""
    alone, direct = _sending_pair()
    for stream_id, size, end in sends:
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        outcomes = []
        for h2c, fast in ((alone, False), (direct, True)):
            try:
                if not (fast and not end and _h2frames.put_plain_data(h2c, stream_id, payload)):
                    h2c.send_data(stream_id, payload, end_stream=end)
                outcomes.append(None)
            except (h2.exceptions.H2Error, KeyError) as exc:  # h2: KeyError for b"" on 9
                outcomes.append(type(exc).__name__)
        assert outcomes[0] == outcomes[1]
        assert direct.data_to_send() == alone.data_to_send()
        assert _state(direct) == _state(alone)
