"""A Join stream's state machine: one table in the code, the same table in
docs/architecture.md, and every move of ``JoinCall`` checked against it (the reader's own
table is tested with the reader, in ``test_transport_reader.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import outcome
import pytest
from support.doctables import documented_table

from rlmesh_trio._logging import RateLimit
from rlmesh_trio._transport._join import JoinCall, JoinContext
from rlmesh_trio._transport._states import (
    JOIN_TABLE,
    JOIN_TRANSITIONS,
    JoinEvent,
    JoinState,
    TransportStateError,
    join_move,
)

pytestmark = pytest.mark.timeout(60)


def test_the_documented_table_is_the_code_table() -> None:
    documented = documented_table("architecture.md", "<!-- join-transitions", JoinState, JoinEvent)
    assert documented == JOIN_TABLE


def test_every_state_is_reachable_and_every_stream_can_close() -> None:
    reached = {JoinState.OPEN} | {new for _, new in JOIN_TRANSITIONS}
    assert reached == set(JoinState)
    assert not any(old is JoinState.CLOSED for old, _ in JOIN_TRANSITIONS)
    # Every live state can break (a cancelled call), and a broken stream can only close.
    for state in set(JoinState) - {JoinState.BROKEN, JoinState.CLOSED}:
        assert (state, JoinState.BROKEN) in JOIN_TRANSITIONS
    assert {new for old, new in JOIN_TRANSITIONS if old is JoinState.BROKEN} == {JoinState.CLOSED}
    # Nothing goes back to reading once reading is over.
    over = {JoinState.NOT_READING, JoinState.FLUSHING, JoinState.BROKEN, JoinState.CLOSED}
    assert not any(old in over and new not in over for old, new in JOIN_TRANSITIONS)


def test_an_event_outside_the_table_is_an_internal_error() -> None:
    for state in JoinState:
        for event in JoinEvent:
            if (state, event) in JOIN_TABLE:
                assert join_move(state, event) is JOIN_TABLE[state, event]
            else:
                with pytest.raises(
                    TransportStateError,
                    match=f"^Join stream: no {event.value} from {state.value}$",
                ):
                    join_move(state, event)


def test_every_event_that_can_come_anywhere_is_a_row_in_every_state_it_can() -> None:
    """The events a stream may meet late (a decode ending, the drain, a session's end, a
    failed send) have a row in every state from theirs on: nothing is passed over by a
    check beside the table."""
    late = {JoinEvent.DECODED, JoinEvent.STOP_READING, JoinEvent.FINISH, JoinEvent.BREAK}
    after = {
        JoinEvent.DECODED: {JoinState.DECODING, JoinState.NOT_READING},
        JoinEvent.STOP_READING: {JoinState.OPEN, JoinState.DECODING, JoinState.NOT_READING},
        JoinEvent.FINISH: {JoinState.OPEN, JoinState.DECODING, JoinState.NOT_READING},
        JoinEvent.BREAK: set(JoinState) - {JoinState.CLOSED},
    }
    for event in late:
        for state in after[event] | {JoinState.FLUSHING, JoinState.BROKEN, JoinState.CLOSED}:
            assert (state, event) in JOIN_TABLE, (state, event)


class _Session:
    """A session with nothing in flight that records the requests it is fed."""

    busy = False
    backlog = 0

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def on_request(self, request: Any) -> list[Any]:
        self.requests.append(request)
        return []

    def on_stream_end(self) -> list[Any]:
        return []


class _Worker:
    """The transport's worker thread, as a list of the jobs it was given."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def submit(self, job: Any, to_loop: Any, done: Any) -> None:
        self.jobs.append(done)


def _call(worker: _Worker | None = None) -> JoinCall:
    """A JoinCall whose stream is never run: its state calls need neither a loop nor a
    stream (no reader is attached before the handler starts one)."""
    context = JoinContext(
        loop=cast(Any, None),
        new_session=cast(Any, _Session),
        num_envs=4,
        max_message_bytes=1 << 20,
        protocols=set(),
        routes=cast(Any, None),  # (nothing is posted)
        wedged=None,
        report_limit=RateLimit(),
        metrics=None,
        worker=cast(Any, worker),
        to_loop=cast(Any, None),
        big_message_done=lambda: None,
        activity=lambda call: None,
        reading=lambda: True,
    )
    return JoinCall(context, cast(Any, SimpleNamespace()))


def test_the_calls_move_through_the_table_and_name_where_they_change_nothing() -> None:
    call = _call()
    assert call.state is JoinState.OPEN and call.attached
    call.stop_reading()  # the server drains
    assert call.state is JoinState.NOT_READING and call.attached
    call.stop_reading()  # the handler, once the requests ended
    assert call.state is JoinState.NOT_READING
    call.finish()
    assert call.state is JoinState.FLUSHING and call.ended.is_set()
    call.finish()  # a failure after EndStream: the stream ends already
    call.stop_reading()
    assert call.state is JoinState.FLUSHING and call.attached
    call.outbox.append(b"queued")
    call._break()  # the send failed
    assert call.state is JoinState.BROKEN and not call.attached
    assert not call.outbox and call.outbox_bytes == 0
    call._break()
    call.finish()  # a late session event
    call.stop_reading()
    assert call.state is JoinState.BROKEN


def test_a_big_request_decodes_in_its_own_state() -> None:
    """open -> decoding -> open; a request decoded after the stream stopped reading is
    dropped and moves nothing."""
    worker = _Worker()
    call = _call(worker)
    session = cast(_Session, call.session)
    call._decode_off_loop(b"big", False)
    assert call.state is JoinState.DECODING and len(worker.jobs) == 1
    worker.jobs.pop()(outcome.Value("request"))
    assert call.state is JoinState.OPEN and session.requests == ["request"]
    call._decode_off_loop(b"big", False)
    call.stop_reading()  # the server drains meanwhile
    assert call.state is JoinState.NOT_READING
    worker.jobs.pop()(outcome.Value("late"))
    assert call.state is JoinState.NOT_READING and session.requests == ["request"]


def test_an_illegal_move_raises_and_changes_nothing() -> None:
    call = _call(_Worker())
    call.finish()
    with pytest.raises(TransportStateError, match="no decode_off_loop from flushing"):
        call._decode_off_loop(b"big", False)  # only an open stream reads requests
    assert call.state is JoinState.FLUSHING
    with pytest.raises(TransportStateError, match="no close from open"):
        _call(_Worker())._move(JoinEvent.CLOSE)
    assert call.state is JoinState.FLUSHING
