"""The episode book (SPEC §7.7-§7.9): scripts of lane results in, episode records out.
No session, no lanes: the book alone, on a counting wall clock."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rlmesh_trio._session
from rlmesh_trio._codec import to_meta_map
from rlmesh_trio._jobs import StepResult
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._session._episodes import Ended, EpisodeBook


def obs(x: float) -> list[bytes]:
    return [np.asarray([x], dtype=np.float32).tobytes()]


def step(
    x: float = 0.5, reward: float = 1.0, term: bool = False, trunc: bool = False
) -> StepResult:
    return StepResult(
        observation=obs(x),
        reward=reward,
        terminated=term,
        truncated=trunc,
        info=to_meta_map({"x": x}),
        action_warning=None,
        obs_warning=None,
    )


def make_book(num_envs: int = 2, *, keep: bool = False) -> EpisodeBook:
    clock = itertools.count(100, 100)  # 100, 200, ...: each reading is distinct
    return EpisodeBook(num_envs, lambda: next(clock), keep_observations=keep)


def summary(record: env_v1.EpisodeMetadata) -> tuple[Any, ...]:
    """What a table row names of a record: (id, lane, steps, reward, terminated, truncated)."""
    return (
        record.episode_id,
        record.env_index,
        record.step_count,
        record.cumulative_reward,
        record.terminated,
        record.truncated,
    )


def play(book: EpisodeBook, script: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Run ``script`` on ``book``; return a summary of every episode a step ended."""
    ended: list[tuple[Any, ...]] = []
    for event, lane, *args in script:
        if event == "reset":
            book.reset(lane, args[0], None, obs(0.0))
        elif event == "step":
            done = book.step(lane, step(*args))
            if done is not None:
                ended.append(summary(done.record(to_meta_map({}))))
        else:
            assert event == "fault"
            book.fault(lane)
    return ended


# Each row: a script; the episodes its steps ended; then take_interrupted(); then close().
TABLE = [
    pytest.param([], [], [], [], id="nothing"),
    pytest.param(
        [("step", 0, 0.5, 1.0, True)],
        [],
        [],
        [],
        id="an idle lane's step records nothing",
    ),
    pytest.param(
        [("reset", 0, "a"), ("step", 0), ("step", 0, 0.5, 2.0, True)],
        [("a", 0, 2, 3.0, True, False)],
        [],
        [],
        id="terminated",
    ),
    pytest.param(
        [("reset", 1, "b"), ("step", 1, 0.5, 0.5, False, True)],
        [("b", 1, 1, 0.5, False, True)],
        [],
        [],
        id="truncated",
    ),
    pytest.param(
        [("reset", 0, "a"), ("step", 0), ("reset", 0, "a2"), ("step", 0)],
        [],
        [("a", 0, 1, 1.0, False, True)],
        [("a2", 0, 1, 1.0, False, True)],
        id="a reset interrupts the running episode",
    ),
    pytest.param(
        [("reset", 0, "a"), ("reset", 1, "b"), ("step", 1), ("fault", 1), ("step", 1)],
        [],
        [("b", 1, 1, 1.0, False, True)],
        [("a", 0, 0, 0.0, False, True)],
        id="a fault interrupts; the lane then steps idle",
    ),
    pytest.param(
        [("fault", 0), ("reset", 1, "b"), ("step", 1, 0.5, 1.0, True), ("step", 1)],
        [("b", 1, 1, 1.0, True, False)],
        [],
        [],
        id="a fault on an idle lane and a step after the end record nothing",
    ),
    pytest.param(
        [("reset", 1, "b"), ("reset", 0, "a"), ("reset", 1, "b2"), ("fault", 0)],
        [],
        [("b", 1, 0, 0.0, False, True), ("a", 0, 0, 0.0, False, True)],
        [("b2", 1, 0, 0.0, False, True)],
        id="interrupted in the order they happened",
    ),
]


@pytest.mark.parametrize(("script", "ended", "interrupted", "closed"), TABLE)
def test_book_table(
    script: list[tuple[Any, ...]],
    ended: list[tuple[Any, ...]],
    interrupted: list[tuple[Any, ...]],
    closed: list[tuple[Any, ...]],
) -> None:
    book = make_book()
    assert play(book, script) == ended
    assert [summary(r) for r in book.take_interrupted()] == interrupted
    assert book.take_interrupted() == []  # taken once
    assert [summary(r) for r in book.close()] == closed
    assert book.close() == []  # nothing runs after a close
    assert book.running(0) is None and book.running(1) is None


def test_close_puts_the_interrupted_first_then_running_in_lane_order() -> None:
    book = make_book(3)
    play(book, [("reset", 2, "c"), ("reset", 0, "a"), ("reset", 0, "a2"), ("step", 2)])
    final = book.close()
    assert [(r.episode_id, r.env_index) for r in final] == [("a", 0), ("a2", 0), ("c", 2)]
    # The running ones end at one reading of the clock, after every earlier one.
    assert final[1].end_timestamp_ns == final[2].end_timestamp_ns > final[0].end_timestamp_ns


def test_an_ended_episode_carries_its_seed_times_and_final_info() -> None:
    book = make_book()
    book.reset(1, "e", 7, obs(0.0))
    ended = book.step(1, step(reward=2.5, term=True))
    assert isinstance(ended, Ended)
    info = to_meta_map({"final": 1})
    record = ended.record(info)
    assert record.seed == 7 and record.episode_id == "e" and record.env_index == 1
    assert record.start_timestamp_ns == 100 and record.end_timestamp_ns == 200
    assert record.final_info == info
    assert (record.step_count, record.cumulative_reward) == (1, 2.5)


@pytest.mark.parametrize("keep", [False, True])
def test_last_observations_are_kept_only_when_asked_and_a_fault_forgets_them(keep: bool) -> None:
    book = make_book(keep=keep)
    assert book.last_observation(0) is None
    book.reset(0, "a", None, obs(1.0))
    assert book.last_observation(0) == (obs(1.0) if keep else None)
    book.step(0, step(x=2.0))
    book.step(1, step(x=3.0))  # an idle lane's observation is kept all the same
    assert book.last_observation(0) == (obs(2.0) if keep else None)
    assert book.last_observation(1) == (obs(3.0) if keep else None)
    book.fault(0)
    assert book.last_observation(0) is None
    assert book.last_observation(1) == (obs(3.0) if keep else None)


def test_drop_forgets_episodes_and_interrupted_but_not_last_observations() -> None:
    book = make_book(keep=True)
    play(book, [("reset", 0, "a"), ("reset", 0, "a2"), ("reset", 1, "b")])
    book.drop()
    assert book.take_interrupted() == []
    assert book.close() == []
    assert book.last_observation(0) == obs(0.0)


def test_the_session_keeps_no_episode_accounts_of_its_own() -> None:
    """Both of the session's step paths go through the book: no module of the session but
    the book makes an Episode, counts into one or keeps last observations."""
    package = Path(rlmesh_trio._session.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "_episodes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Episode":
                found.append(f"{path.name}:{node.lineno}: Episode(...)")
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
                if node.target.attr in ("steps", "reward"):
                    found.append(f"{path.name}:{node.lineno}: .{node.target.attr} +=")
            elif isinstance(node, ast.Attribute) and node.attr in ("_last_obs", "_episodes"):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, "\n".join(found)
