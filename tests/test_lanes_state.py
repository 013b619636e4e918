"""The lanes' state machine: one table in the code, the same table in the docs, and
every move checked against it."""

from __future__ import annotations

import pytest
from support.doctables import documented_transitions

from rlmesh_trio._errors import LaneDeadError, LaneWedgedError
from rlmesh_trio._lanes._lane import STOP, Incarnation, Lane
from rlmesh_trio._lanes._state import TRANSITIONS, LaneState, LaneStateError, check_transition


def test_the_documented_table_is_the_code_table() -> None:
    documented = documented_transitions("supervision.md", "<!-- lane-transitions", LaneState)
    assert documented - TRANSITIONS == set(), "documented but not allowed by the code"
    assert TRANSITIONS - documented == set(), "allowed by the code but not documented"


def test_every_state_is_reachable_and_every_state_can_stop() -> None:
    reached = {LaneState.STARTING} | {new for _, new in TRANSITIONS}
    assert reached == set(LaneState)
    for state in set(LaneState) - {LaneState.STOPPED}:
        assert (state, LaneState.STOPPED) in TRANSITIONS
    assert not any(old is LaneState.STOPPED for old, _ in TRANSITIONS)


def test_a_move_outside_the_table_is_an_internal_error() -> None:
    for old in LaneState:
        for new in LaneState:
            if (old, new) in TRANSITIONS:
                check_transition(3, old, new)
            else:
                with pytest.raises(
                    LaneStateError, match=f"^lane 3: no transition from {old.value} to {new.value}$"
                ):
                    check_transition(3, old, new)


class _Bookkeeping(Incarnation):
    """An incarnation that is never started (the lane's transitions only spawn them)."""

    __slots__ = ()


def _lane() -> Lane:
    return Lane(0, _Bookkeeping)


def test_transitions_move_the_fields_that_go_with_the_state() -> None:
    lane = _lane()
    first = lane.incarnation
    with lane.lock:
        assert lane.serve() == 0
        assert (lane.state, lane.running, lane.refusal) == (LaneState.SERVING, True, None)
        old = lane.rebuilding()  # serving -> rebuilding: the serving incarnation detaches
        assert old is first and old.detached
        assert lane.incarnation.number == 1 and not lane.incarnation.detached
        assert (lane.state, lane.attempt) == (LaneState.REBUILDING, 1)
        refusal = LaneDeadError("lane 0 could not be rebuilt (attempt 1): boom")
        assert lane.dead(refusal, "RuntimeError: boom") == []
        assert (lane.state, lane.refusal, lane.last_cause) == (
            LaneState.DEAD,
            refusal,
            "RuntimeError: boom",
        )
        failed = lane.rebuilding()  # dead -> rebuilding: the failed one is not detached
        assert not failed.detached and lane.incarnation.number == 2
        assert (lane.refusal, lane.attempt) == (None, 2)
        assert lane.serve() == 2  # the attempts it took; the counter starts over
        assert (lane.attempt, lane.rebuilds) == (0, 1)
        wedge = LaneWedgedError("lane 0 is wedged")
        assert lane.wedged(wedge, take=False) == []
        assert lane.refusal is wedge
        lane.serve()
        assert lane.refusal is None
        lane.stopped()
        with pytest.raises(LaneStateError):
            lane.serve()
    assert lane.state is LaneState.STOPPED


def test_a_disallowed_move_changes_nothing() -> None:
    lane = _lane()
    with lane.lock, pytest.raises(LaneStateError, match="from starting to rebuilding"):
        lane.rebuilding()
    assert lane.state is LaneState.STARTING
    assert lane.incarnation.number == 0 and lane.attempt == 0


def test_wedged_by_the_watchdog_takes_the_running_and_the_queued_jobs() -> None:
    lane = _lane()
    jobs = [(0, object(), print), (1, object(), print)]
    with lane.lock:
        lane.serve()
        lane.begin_job(jobs[0], 0)  # type: ignore[arg-type]
        lane.mailbox.put(jobs[1])  # type: ignore[arg-type]
        taken = lane.wedged(LaneWedgedError("lane 0 is wedged"), take=True)
    assert taken == [jobs[1]] and lane.current is None
    assert lane.mailbox.empty()


def test_the_events_move_the_fields_that_go_with_them() -> None:
    """What the lane thread, the supervisor and the watchdog tell a lane (the only writers
    of its fields besides the transitions: ``tests/test_lanes_fields.py``)."""
    lane = _lane()
    first = lane.incarnation
    job = (0, object(), print)
    with lane.lock:
        lane.serve()
        # a job begins and ends; the stop sentinel begins nothing
        assert lane.begin_job(job, 123)  # type: ignore[arg-type]
        assert (lane.current, lane.since) == (job, 123)
        assert lane.end_job(job)  # type: ignore[arg-type]
        assert lane.current is None
        assert not lane.begin_job(STOP, 456)
        assert (lane.current, lane.since) == (None, 123)
        # policy error: a wedged call that returns serves again; one taken out does not
        lane.begin_job(job, 1)  # type: ignore[arg-type]
        lane.wedged(LaneWedgedError("lane 0 is wedged"), take=False)
        assert lane.end_job(job)  # type: ignore[arg-type]
        assert (lane.state, lane.refusal, lane.wedges) == (LaneState.SERVING, None, 1)
        lane.begin_job(job, 1)  # type: ignore[arg-type]
        lane.wedged(LaneWedgedError("lane 0 is wedged"), take=True)
        assert not lane.end_job(job)  # type: ignore[arg-type]
        assert (lane.state, lane.wedges) == (LaneState.WEDGED, 2)
        lane.serve()
        # a fault, counted; rebuilt only when the policy rebuilds, the reset retried
        assert not lane.fault(job, rebuild=False, retry=False)  # type: ignore[arg-type]
        assert (lane.state, lane.faults) == (LaneState.SERVING, 1)
        assert lane.fault(job, rebuild=True, retry=True)  # type: ignore[arg-type]
        assert (lane.state, lane.faults, lane.retry) == (LaneState.REBUILDING, 2, (job, 1))
        assert first.detached and lane.incarnation.number == 1
        assert lane.take_retry() == (job, 1)
        assert lane.take_retry() is None
        lane.went_down("RuntimeError: boom")
        assert lane.last_cause == "RuntimeError: boom"
        # a fault storm's refusal, lifted when the fresh env is started
        refusal = LaneDeadError("lane 0 faulted 6 times in a row")
        assert lane.hold_off(refusal) == []
        since = lane.since
        lane.build_starts()
        assert lane.refusal is None and lane.since >= since
        lane.serve()
        # a wedge under a rebuild policy takes the job out and rebuilds
        lane.begin_job(job, 7)  # type: ignore[arg-type]
        old = lane.wedged_rebuilding("TimeoutError: env.step timed out after 10ms")
        assert old.number == 1 and old.detached
        assert (lane.state, lane.current, lane.wedges) == (LaneState.REBUILDING, None, 3)
        assert lane.last_cause == "TimeoutError: env.step timed out after 10ms"
        # threads left behind, counted while they run
        lane.thread_abandoned()
        lane.thread_abandoned()
        lane.abandoned_thread_exited()
        assert lane.abandoned == 1
        # a detached thread's end changes nothing; the serving one's death loses the lane
        assert lane.thread_ended(old, died=True) == (False, False)
        assert not lane.given_up
        lane.serve()
        assert lane.thread_ended(lane.incarnation, died=True) == (True, True)
        assert (lane.running, lane.given_up) == (False, True)
    # a rebuilt env proven healthy: the supervisor's proof, used up once read
    assert not lane.take_proof()
    lane.proven_healthy()
    assert lane.take_proof()
    assert not lane.take_proof()


def test_a_job_is_handed_over_ahead_only_to_a_lane_waiting_on_an_empty_mailbox() -> None:
    """Process lanes: ``post`` writes the next job to the child when the lane thread
    waits for it on an empty mailbox (:meth:`Lane.await_job`), at most one job, never
    while jobs are queued (the child's pipe must see jobs in mailbox order), never once the
    lane stops or moves (a transition forgets the offer)."""
    lane = _lane()
    sent: list[object] = []

    def send(job: object) -> bool:
        sent.append(job)
        return True

    first, second = (0, object(), print), (1, object(), print)
    with lane.lock:
        lane.serve()
        lane.await_job(send)  # type: ignore[arg-type]
        lane.post_ahead(first[1])  # type: ignore[arg-type]
        lane.mailbox.put(first)  # type: ignore[arg-type]
        lane.post_ahead(second[1])  # type: ignore[arg-type]  # one job only
        lane.mailbox.put(second)  # type: ignore[arg-type]
    assert sent == [first[1]]
    with lane.lock:
        assert lane.take_ahead(lane.mailbox.get()) is True
        assert lane.take_ahead(lane.mailbox.get()) is False  # the lane thread sends it
        lane.mailbox.put(first)  # type: ignore[arg-type]
        lane.await_job(send)  # type: ignore[arg-type]  # a job is queued: no offer
        assert lane.presend is None
        lane.mailbox.get()
        # a send that declines (a job too big, not a step or a reset) hands nothing over
        lane.await_job(lambda job: False)
        lane.post_ahead(second[1])  # type: ignore[arg-type]
        assert lane.ahead is None and not lane.take_ahead(second)  # type: ignore[arg-type]
        # a transition, or the lane closing, withdraws the offer
        lane.await_job(send)  # type: ignore[arg-type]
        lane.wedged(LaneWedgedError("lane 0 is wedged"), take=False)
        assert lane.presend is None
        lane.serve()
        lane.await_job(send)  # type: ignore[arg-type]
        lane.close_mailbox()
        assert lane.presend is None
        lane.await_job(send)  # type: ignore[arg-type]  # stopping: no offer
        assert lane.presend is None
        assert not lane.take_ahead(STOP)
    assert sent == [first[1]]
