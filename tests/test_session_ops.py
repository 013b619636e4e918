"""The session's scheduler, :class:`OpBook`: launch, deliver, retire, the queue's turns.
No session, no lanes: the book alone."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import rlmesh_trio._session
from rlmesh_trio._jobs import StepJob
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._session import Post, StartTimer
from rlmesh_trio._session._actions import Action
from rlmesh_trio._session._ops import OpBook, step_op
from rlmesh_trio._session._plan import StepPlan

STATE = ("pending", "ops", "serial", "outstanding", "tokens")
CHANGES = ("append", "appendleft", "clear", "extend", "pop", "popleft", "remove", "update")


def test_launch_deliver_and_retire_keep_the_barriers() -> None:
    book = OpBook(itertools.count(1))
    plan = StepPlan([0, 1], True, [b""], True)
    op, jobs = step_op(next(book.tokens), "s", plan, 500, 0, False, "vector")
    actions = book.launch(op, jobs)
    assert actions == [StartTimer(1, 0.5), Post(0, jobs[0], True), Post(1, jobs[1], True)]
    assert all(isinstance(job, StepJob) and job.validated for job in jobs)
    assert book.serial is op and book.outstanding == 2 and book.ops == {1: op}
    assert book.deliver(1) is op and book.outstanding == 1 and 1 in book.ops
    book.release(op)
    assert book.serial is None
    assert book.deliver(1) is op and book.outstanding == 0 and not book.ops
    assert book.deliver(1) is None and book.outstanding == -1  # a late reply still counts

    lane = step_op(next(book.tokens), "l", StepPlan([1], False, [b""], False), 0, 0, False, "lane")
    book.launch(*lane)
    book.retire(lane[0], 1)
    assert not book.ops and book.outstanding == -1 and lane[0].remaining == 0


def test_a_serial_request_waits_its_turn_behind_lane_jobs_and_a_close_gets_a_bound() -> None:
    book = OpBook(itertools.count(1))
    book.outstanding = 1  # a lane job is out
    close = book.wait(env_v1.JoinRequest(request_id="c", close=env_v1.CloseEnvsRequest()), 5, 0)
    actions: list[Action] = []
    assert book.turn(2.0, actions) is None
    assert actions == [StartTimer(close.token, 2.0)] and close.close_wait
    book.outstanding = 0
    turn = book.turn(2.0, actions)
    assert turn is not None and turn[0] is close and turn[1] == "close"
    assert not book.pending and book.unqueue(close.token) is None


def test_no_session_module_but_the_book_writes_the_scheduler_state() -> None:
    """The queue, the ops in flight, the barriers and the tokens are the book's to write:
    no other module of the session assigns them, counts them or changes them in place."""
    package = Path(rlmesh_trio._session.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name in ("_ops.py", "_endpoint.py"):  # the endpoint makes the tokens
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in CHANGES
            ):
                targets = [node.func.value]  # e.g. book.pending.append(...)
            for target in targets:
                while isinstance(target, ast.Subscript):
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr in STATE:
                    found.append(f"{path.name}:{node.lineno}: .{target.attr}")
    assert not found, "\n".join(found)
