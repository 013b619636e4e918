"""The frame gate of one connection (issue 28), sans-IO: what each frame costs, where a
turn ends, and which limit a flood passes. The same gate on real connections:
tests/reference/test_hostile_floods.py."""

from __future__ import annotations

import contextlib

import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from rlmesh_trio._transport._flood import (
    CLOSED_STREAM_FRAMES_BURST,
    CONTROL_FRAMES_BURST,
    CONTROL_FRAMES_PER_SECOND,
    EMPTY_FRAMES_BURST,
    ENHANCE_YOUR_CALM,
    FRAMES_PER_TURN,
    HEADER_BLOCK_BYTES,
    PREFACE_SIZE,
    RESETS_BURST,
    RESETS_PER_SECOND,
    SERVER_BUDGETS,
    STREAM_CLOSED,
    UNREAD_ANSWERS,
    Bucket,
    FrameGate,
    HeldBlocks,
    ServerBudget,
)

pytestmark = pytest.mark.timeout(30)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
assert len(PREFACE) == PREFACE_SIZE


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Peer:
    """What the gate asks the connection: stream states and our output backlog."""

    def __init__(self) -> None:
        self.highest = 0
        self.open: set[int] = set()
        self.backlog = 0

    def stream_open(self, stream_id: int) -> bool | None:
        if stream_id > self.highest:
            return None
        return stream_id in self.open


def gate(peer: Peer | None = None, clock: Clock | None = None) -> FrameGate:
    peer = peer or Peer()
    new = FrameGate(clock or Clock(), peer.stream_open, lambda: peer.backlog)
    assert new.scan(PREFACE) == PREFACE_SIZE
    return new


def unknown_frame(kind: int, stream_id: int, body: bytes) -> bytes:
    return len(body).to_bytes(3, "big") + bytes([kind, 0]) + stream_id.to_bytes(4, "big") + body


def test_a_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = Bucket(3, 2.0, clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.now = 0.4  # 0.8 of a token
    assert not bucket.take()
    clock.now = 0.5  # one token
    assert bucket.take() and not bucket.take()
    clock.now = 100.0  # never more than the burst
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]


def test_ordinary_traffic_passes_whatever_its_volume() -> None:
    """A call's frames -- HEADERS, DATA, END_STREAM, a WINDOW_UPDATE now and then, a
    keepalive PING -- a thousand calls over ten seconds, cost no budget that matters."""
    clock = Clock()
    peer = Peer()
    g = gate(peer, clock)
    for call in range(1000):
        clock.now = call / 100
        stream_id = 1 + 2 * call
        data = HeadersFrame(stream_id, b"\x82", flags=["END_HEADERS"]).serialize()
        data += DataFrame(stream_id, b"\x00\x00\x00\x00\x02\x08\x01").serialize()
        data += DataFrame(stream_id, b"", flags=["END_STREAM"]).serialize()
        data += WindowUpdateFrame(0, window_increment=7).serialize()
        data += PingFrame(0, opaque_data=b"k" * 8).serialize()
        assert g.scan(data) == len(data)
        peer.highest = stream_id
        assert g.flood is None, call


@pytest.mark.parametrize(
    ("frame", "limit"),
    [
        (DataFrame(1, b"").serialize(), EMPTY_FRAMES_BURST),
        # Padded, all padding: one byte of pad length, three of padding, no data.
        (DataFrame(1, b"", flags=["PADDED"], pad_length=3).serialize(), EMPTY_FRAMES_BURST),
        (ContinuationFrame(1, b"").serialize(), EMPTY_FRAMES_BURST),
        (PingFrame(0, opaque_data=b"p" * 8).serialize(), CONTROL_FRAMES_BURST),
        (PingFrame(0, opaque_data=b"p" * 8, flags=["ACK"]).serialize(), CONTROL_FRAMES_BURST),
        (SettingsFrame(0).serialize(), CONTROL_FRAMES_BURST),
        (WindowUpdateFrame(0, window_increment=1).serialize(), CONTROL_FRAMES_BURST),
        (WindowUpdateFrame(1, window_increment=1).serialize(), CONTROL_FRAMES_BURST),
        (PriorityFrame(1, depends_on=0).serialize(), CONTROL_FRAMES_BURST),
        (unknown_frame(0x10, 0, b"\x00\x00\x00\x01u=1"), CONTROL_FRAMES_BURST),
        (unknown_frame(0xFA, 1, b"x" * 40), CONTROL_FRAMES_BURST),
    ],
    ids=[
        "empty-data",
        "padding-only-data",
        "empty-continuation",
        "ping",
        "ping-ack",
        "settings",
        "window-update-connection",
        "window-update-stream",
        "priority",
        "priority-update",
        "extension",
    ],
)
def test_a_flood_of_frames_that_carry_nothing_passes_its_limit_exactly(
    frame: bytes, limit: int
) -> None:
    peer = Peer()
    peer.highest = 1
    peer.open.add(1)
    g = gate(peer)
    for _ in range(limit):
        g.scan(frame)
        assert g.flood is None
    g.scan(frame)
    assert g.flood is not None and g.flood.code == ENHANCE_YOUR_CALM


def test_frames_that_make_progress_are_not_empty() -> None:
    g = gate()
    ends = DataFrame(1, b"", flags=["END_STREAM"]).serialize()
    padded_byte = DataFrame(1, b"x", flags=["PADDED"], pad_length=3).serialize()
    ends_block = ContinuationFrame(1, b"", flags=["END_HEADERS"]).serialize()
    for _ in range(EMPTY_FRAMES_BURST * 2):
        g.scan(ends + padded_byte + ends_block)
    assert g.flood is None


def test_rapid_reset_spends_the_reset_budget_whatever_read_the_reset_comes_in() -> None:
    clock = Clock()
    peer = Peer()
    # Streams we answered already (closed on our side: the reset came in a later read
    # than the request, a split-read "Rapid Reset"): the same budget.
    peer.highest = 999
    g = gate(peer, clock)
    for stream_id in range(1, 2 * RESETS_BURST, 2):
        g.scan(RstStreamFrame(stream_id, error_code=8).serialize())
    assert g.flood is None
    g.scan(RstStreamFrame(2 * RESETS_BURST + 1, error_code=8).serialize())
    assert g.flood is not None and "reset by the client" in g.flood.reason
    g = gate(peer, clock)
    pairs = b""
    for index in range(RESETS_BURST):
        stream_id = 1001 + 2 * index
        pairs += HeadersFrame(stream_id, b"\x82", flags=["END_HEADERS"]).serialize()
        pairs += RstStreamFrame(stream_id, error_code=8).serialize()
    pos = 0
    while pos < len(pairs):
        pos += g.scan(pairs[pos:])
    assert g.flood is None  # exactly the burst
    clock.now = 1 / RESETS_PER_SECOND  # one more refilled
    g.scan(RstStreamFrame(5001, error_code=8).serialize())
    assert g.flood is None
    g.scan(RstStreamFrame(5003, error_code=8).serialize())
    assert g.flood is not None and "reset by the client" in g.flood.reason


def test_streams_we_refuse_spend_the_same_budget() -> None:
    g = gate()
    for _ in range(RESETS_BURST):
        g.refused()
    assert g.flood is None
    g.refused()
    assert g.flood is not None and "refused" in g.flood.reason


def test_answers_owed_while_our_output_is_not_read() -> None:
    peer = Peer()
    g = gate(peer)
    ping = PingFrame(0, opaque_data=b"p" * 8).serialize()
    peer.backlog = 17  # the socket takes nothing: our answers pile up
    for _ in range(UNREAD_ANSWERS):
        g.scan(ping)
    assert g.flood is None
    peer.backlog = 0  # the client read: the count starts again
    g.scan(ping)
    peer.backlog = 17
    for _ in range(UNREAD_ANSWERS):
        g.scan(ping)
    assert g.flood is None
    # New streams are answers owed too (a trailers-only refusal, a health reply).
    g.scan(HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize())
    assert g.flood is not None and "does not read" in g.flood.reason


def test_a_turn_ends_after_frames_per_turn_frames_with_their_payload() -> None:
    g = gate()
    big = DataFrame(1, b"d" * 1000).serialize()
    small = WindowUpdateFrame(0, window_increment=1).serialize()
    data = small * (FRAMES_PER_TURN - 1) + big + small * 10
    end = g.scan(data)
    assert end == len(small) * (FRAMES_PER_TURN - 1) + len(big)
    assert g.scan(data[end:]) == len(small) * 10
    assert g.flood is None


def test_frames_split_anywhere_are_read_the_same() -> None:
    """Header, payload and preface cut at every byte: the same counts, the same turn."""
    frames = [
        HeadersFrame(1, b"\x82" * 30, flags=["END_HEADERS"]).serialize(),
        DataFrame(1, b"x" * 300).serialize(),
        DataFrame(1, b"").serialize(),
        PingFrame(0, opaque_data=b"p" * 8).serialize(),
        RstStreamFrame(1, error_code=8).serialize(),
    ]
    stream = PREFACE + b"".join(frames) * 3
    whole = FrameGate(Clock(), Peer().stream_open, lambda: 0)
    assert whole.scan(stream) == len(stream)
    for step in (1, 2, 5, 9, 10, 17):
        split = FrameGate(Clock(), Peer().stream_open, lambda: 0)
        for pos in range(0, len(stream), step):
            piece = stream[pos : pos + step]
            assert split.scan(piece) == len(piece)
        for name in ("_resets", "_empty", "_control"):
            assert getattr(split, name).tokens == getattr(whole, name).tokens, (step, name)
        assert split.flood is None


def test_control_budget_refills() -> None:
    clock = Clock()
    g = gate(clock=clock)
    frame = WindowUpdateFrame(0, window_increment=1).serialize()
    for second in range(20):
        clock.now = float(second)
        for _ in range(int(CONTROL_FRAMES_PER_SECOND) - 1):
            g.scan(frame)
    assert g.flood is None


# -- on a real connection: an error of ours while taking a client's bytes


def _goaway_after_preface(address: str) -> int | None:
    """Send the preface and a SETTINGS frame; the GOAWAY's error code that comes back."""
    import socket

    from hyperframe.frame import Frame, GoAwayFrame

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + SettingsFrame(0).serialize())
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received += chunk
    pos = 0
    while pos + 9 <= len(received):
        frame, length = Frame.parse_frame_header(memoryview(received[pos : pos + 9]))
        if isinstance(frame, GoAwayFrame):
            frame.parse_body(memoryview(received[pos + 9 : pos + 9 + length]))
            return int(frame.error_code)
        pos += 9 + length
    return None


async def test_an_error_of_ours_is_a_goaway_and_one_warning_never_asyncios_fatal_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in taking a client's bytes (here: the gate raising) closes that connection
    with GOAWAY(INTERNAL_ERROR) and logs a rate-limited warning; asyncio's "Fatal error on
    transport" handler never sees it, and the server serves the next connection."""
    import trio

    from rlmesh_trio import ServeOptions, serve_env
    from rlmesh_trio._transport import _flood
    from rlmesh_trio.client import open_endpoint

    real_scan = _flood.FrameGate.scan
    broken = {"on": True}

    def scan(self: FrameGate, data: bytes) -> int:
        if broken["on"]:
            raise RuntimeError("a bug")
        return real_scan(self, data)

    monkeypatch.setattr(_flood.FrameGate, "scan", scan)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            info = await nursery.start(
                lambda task_status: serve_env(
                    "CartPole-v1", num_envs=1, options=ServeOptions(), task_status=task_status
                )
            )
            codes = [
                await trio.to_thread.run_sync(_goaway_after_preface, info.address) for _ in range(3)
            ]
            broken["on"] = False
            async with open_endpoint(info.address) as endpoint:
                await endpoint.reset(seeds=1)
        nursery.cancel_scope.cancel()
    assert codes == [0x2, 0x2, 0x2]  # INTERNAL_ERROR
    messages = [record.getMessage() for record in caplog.records]
    assert not any("Fatal error" in message for message in messages), messages
    warned = [m for m in messages if "input could not be handled" in m]
    assert 1 <= len(warned) <= 3, messages


def test_a_frame_over_our_max_frame_size_is_known_on_its_header() -> None:
    """Its body need not arrive (h2 would wait for all of it): FRAME_SIZE_ERROR, and the
    frames before it are this turn's (their streams count for the GOAWAY)."""
    g = FrameGate(Clock(), Peer().stream_open, lambda: 0, 16_384)
    headers = HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize()
    data = PREFACE + headers + bytes.fromhex("004001000000000001")  # 16,385 bytes announced
    assert g.scan(data) == len(PREFACE) + len(headers)
    assert g.flood is not None and g.flood.code == 0x6
    split = FrameGate(Clock(), Peer().stream_open, lambda: 0, 16_384)
    assert split.scan(data[:-4]) == len(data) - 4  # the header is not whole yet
    assert split.scan(data[-4:]) == 0 and split.flood is not None  # it began before
    fits = FrameGate(Clock(), Peer().stream_open, lambda: 0, 16_384)
    fits.scan(PREFACE + bytes.fromhex("004000000000000001"))  # exactly 16,384
    assert fits.flood is None


def test_time_spent_full_earns_nothing() -> None:
    """A bucket that sat full for a while has its burst, not more (a connection idle for
    2 s before a flood got 200 extra empty frames past its limit)."""
    clock = Clock()
    bucket = Bucket(10, 100.0, clock)
    clock.now = 2.0  # full all along
    taken = 0
    while bucket.take():
        taken += 1
    assert taken == 10


# ---- header blocks bounded in bytes and time; frames on closed streams (issue 43) -------


def _fed(g: FrameGate, data: bytes) -> None:
    pos = 0
    while pos < len(data) and g.flood is None:
        pos += g.scan(data[pos:])


def test_an_unfinished_header_block_is_bounded_in_bytes() -> None:
    """HEADERS then CONTINUATION frames that never end the block: h2 bounds their count
    (64), not their bytes; the gate closes the connection past HEADER_BLOCK_BYTES."""
    g = gate()
    fragment = b"\x00" * 16_000
    frames = HeadersFrame(1, fragment).serialize()  # no END_HEADERS
    for _ in range(HEADER_BLOCK_BYTES // 16_000 - 1):
        frames += ContinuationFrame(1, fragment).serialize()
    _fed(g, frames)
    assert g.flood is None and g.block_since is not None
    _fed(g, ContinuationFrame(1, fragment).serialize())
    assert g.flood is not None and g.flood.code == ENHANCE_YOUR_CALM
    assert "header block of more than" in g.flood.reason


def test_a_finished_block_releases_what_it_held_and_a_real_request_is_nothing() -> None:
    held = HeldBlocks(cap=100_000)
    g = FrameGate(Clock(), Peer().stream_open, lambda: 0, server=ServerBudget(Clock(), held))
    _fed(g, PREFACE)
    _fed(g, HeadersFrame(1, b"\x00" * 16_000).serialize())
    _fed(g, ContinuationFrame(1, b"\x00" * 14_000).serialize())
    assert held.held == 30_000
    _fed(g, ContinuationFrame(1, b"\x00" * 1_000, flags=["END_HEADERS"]).serialize())
    assert held.held == 0 and g.block_since is None and g.flood is None
    for stream_id in range(3, 2001, 2):  # a thousand ordinary requests
        _fed(g, HeadersFrame(stream_id, b"\x82" * 200, flags=["END_HEADERS"]).serialize())
    assert held.held == 0 and g.flood is None


def test_unfinished_blocks_are_capped_over_every_connection() -> None:
    """Each connection under its own limit, together past the server's: the one whose
    block would pass the cap is closed; a closed connection gives its bytes back."""
    held = HeldBlocks(cap=HEADER_BLOCK_BYTES * 3)
    gates = []
    for _ in range(3):
        g = FrameGate(Clock(), Peer().stream_open, lambda: 0, server=ServerBudget(Clock(), held))
        _fed(g, PREFACE)
        for _ in range(4):
            _fed(
                g, (HeadersFrame if _ == 0 else ContinuationFrame)(1, b"\x00" * 16_000).serialize()
            )
        gates.append(g)
    assert all(g.flood is None for g in gates) and held.held == 3 * 64_000
    late = FrameGate(Clock(), Peer().stream_open, lambda: 0, server=ServerBudget(Clock(), held))
    _fed(late, PREFACE)
    _fed(late, HeadersFrame(1, b"\x00" * 16_000).serialize())
    assert late.flood is not None and "too many unfinished header blocks" in late.flood.reason
    assert held.held == 3 * 64_000
    gates[0].close()
    assert held.held == 2 * 64_000


def test_a_header_block_unfinished_past_its_time_is_a_flood() -> None:
    clock = Clock()
    g = gate(clock=clock)
    clock.now = 10.0
    _fed(g, HeadersFrame(1, b"\x00" * 10).serialize())
    assert g.block_since == 10.0
    g.block_overdue(9.0)  # an older block's timer: nothing
    assert g.flood is None
    g.block_overdue(10.0)
    assert g.flood is not None and "unfinished after" in g.flood.reason


def test_frames_on_closed_streams_are_counted_and_headers_there_close_at_once() -> None:
    clock = Clock()
    peer = Peer()
    peer.highest = 99  # streams 1..99 known, all closed
    g = gate(peer, clock)
    frames = b"".join(
        DataFrame(1, b"x", flags=["END_STREAM"]).serialize()
        for _ in range(CLOSED_STREAM_FRAMES_BURST)
    )
    _fed(g, frames)
    assert g.flood is None
    _fed(g, DataFrame(3, b"x", flags=["END_STREAM"]).serialize())
    assert g.flood is not None and "on closed streams" in g.flood.reason
    g = gate(peer, clock)
    _fed(g, HeadersFrame(5, b"\x82", flags=["END_HEADERS", "END_STREAM"]).serialize())
    assert g.flood is not None and g.flood.code == STREAM_CLOSED


def test_calls_cut_off_by_their_connection_log_one_line_not_a_traceback_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpclib logs "Server error" with a traceback for every handler a GOAWAY or a reset
    cut off: under a flood, hundreds. The filter makes them a few rate-limited one-line
    INFO records; a handler's own error keeps its traceback."""
    import logging
    import sys

    import h2.exceptions
    from grpclib.exceptions import StreamTerminatedError

    from rlmesh_trio._transport import _quiet

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            try:
                raise exc
            except BaseException as inner:
                raise RuntimeError("while sending trailers") from inner
        except RuntimeError:
            info = sys.exc_info()
        return logging.LogRecord("grpclib.server", logging.ERROR, "x", 1, "Server error", (), info)

    quiet = _quiet.QuietCallEnds()
    monkeypatch.setattr(_quiet, "_CALL_ENDS", _quiet.RateLimit(burst=3, window=60.0))
    cut = [record(StreamTerminatedError("Connection lost")) for _ in range(50)]
    cut += [record(h2.exceptions.ProtocolError("Invalid input in state ConnectionState.CLOSED"))]
    kept = [r for r in cut if quiet.filter(r)]
    assert len(kept) == 3
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in kept)
    assert "ended with its connection" in kept[0].getMessage()
    own = record(ValueError("a bug in a handler"))
    assert quiet.filter(own) and own.exc_info is not None and own.levelno == logging.ERROR


def test_many_connections_under_their_own_limits_spend_the_servers_budget() -> None:
    """Issue 43, row 3: connections each at 90 % of its own control-frame rate, together
    far past the server's: once the server's budget is spent, those sending more than
    their share are closed; a bystander that sends a few frames is never."""
    clock = Clock()
    server = ServerBudget(clock)
    attackers = []
    for _ in range(150):
        g = FrameGate(clock, Peer().stream_open, lambda: 0, server=server)
        _fed(g, PREFACE)
        attackers.append(g)
    bystander = FrameGate(clock, Peer().stream_open, lambda: 0, server=server)
    _fed(bystander, PREFACE)
    per_tick = int(CONTROL_FRAMES_PER_SECOND * 0.9 / 10)  # 90 % of the rate, in 0.1 s
    ping = PingFrame(0, opaque_data=b"\0" * 8).serialize()
    for tick in range(100):  # 10 s
        clock.now = tick / 10
        for g in attackers:
            if g.flood is None:
                _fed(g, ping * per_tick)
        _fed(bystander, WindowUpdateFrame(0, window_increment=1).serialize())
    closed = [g for g in attackers if g.flood is not None]
    # what is left fits in the server's rate: about twenty such connections
    survivors = len(attackers) - len(closed)
    _, server_rate = SERVER_BUDGETS["control"]
    assert survivors * per_tick * 10 <= server_rate, survivors
    assert len(closed) >= 120, len(closed)
    assert all("more than its share" in g.flood.reason for g in closed if g.flood)
    assert bystander.flood is None
    # one connection alone, at the same 90 %, is never closed
    alone = ServerBudget(clock)
    g = FrameGate(clock, Peer().stream_open, lambda: 0, server=alone)
    _fed(g, PREFACE)
    for tick in range(100, 200):
        clock.now = tick / 10
        _fed(g, ping * per_tick)
    assert g.flood is None


def test_a_priority_frame_making_its_stream_depend_on_itself_is_cut_out() -> None:
    """RFC 9113 §5.3.1: a stream error. The gate stops before the frame and names it,
    so that the connection resets that stream alone (h2 would close the connection)."""
    g = gate()
    before = HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize()
    bad = PriorityFrame(1, depends_on=1, stream_weight=15).serialize()
    ok = PriorityFrame(3, depends_on=1, stream_weight=15).serialize()
    data = before + bad + ok
    end = g.scan(data)
    assert end == len(before) and g.excised == (1, len(bad)) and g.flood is None
    g.excised = None
    assert g.scan(data[end + len(bad) :]) == len(ok) and g.excised is None
