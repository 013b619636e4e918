"""The recording core without Minari or PyAV: one lane's episode accumulator (plain data
in, finished or cut episodes out), the space checks, gymnasium-based stacking, and the
bounded writer thread (backpressure, errors, close)."""

from __future__ import annotations

import threading
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from support.recording import put_blocked

from rlmesh_trio._record import (
    BoundedWorker,
    Episode,
    EpisodeAccumulator,
    RecordingError,
    UnsupportedSpaceError,
    check_space,
)
from rlmesh_trio._record._episode import stack

pytestmark = pytest.mark.timeout(60)


def play(
    env: gym.Env[Any, Any], acc: EpisodeAccumulator, seed: int | None, max_steps: int = 10_000
) -> float:
    """One episode of ``env`` with seeded random actions, fed to ``acc``; its return."""
    obs, info = env.reset(seed=seed)
    acc.reset(obs, seed, info)
    env.action_space.seed(seed)
    total = 0.0
    for _ in range(max_steps):
        action = env.action_space.sample()
        obs, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        if acc.step(action, obs, float(reward), terminated, truncated, info) is not None:
            break
    return total


def test_an_episode_goes_to_the_sink_whole_when_the_env_ends_it() -> None:
    env = gym.make("CartPole-v1")
    got: list[Episode] = []
    acc = EpisodeAccumulator(3, env.observation_space, env.action_space, got.append)
    total = play(env, acc, seed=7)
    (episode,) = got
    assert (episode.lane, episode.index, episode.seed, episode.cut) == (3, 0, 7, None)
    assert len(episode.observations) == len(episode.actions) + 1 == len(episode) + 1
    assert episode.total_reward == total
    assert episode.terminations[-1] or episode.truncations[-1]
    assert not any(episode.terminations[:-1]) and not any(episode.truncations[:-1])
    assert episode.infos is None  # record_infos off
    assert not acc.in_episode and acc.episodes_started == 1
    env.close()


def test_what_the_env_writes_again_after_a_step_does_not_change_the_record() -> None:
    space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    got: list[Episode] = []
    acc = EpisodeAccumulator(0, space, space, got.append)
    buffer = np.zeros(3, np.float32)  # an env that hands out one buffer
    acc.reset(buffer, None)
    buffer[:] = 0.5
    acc.step(buffer, buffer, 1.0, False, False)
    buffer[:] = -0.5
    acc.step(buffer, buffer, 1.0, True, False)
    (episode,) = got
    assert [o[0] for o in episode.observations] == [0.0, 0.5, -0.5]
    assert [a[0] for a in episode.actions] == [0.5, -0.5]


def test_a_cut_ends_the_episode_truncated_and_says_why() -> None:
    env = gym.make("CartPole-v1")
    got: list[Episode] = []
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, got.append)
    obs, _ = env.reset(seed=1)
    acc.reset(obs, 1)
    for _ in range(3):
        obs, reward, terminated, truncated, _ = env.step(0)
        assert not (terminated or truncated)
        acc.step(0, obs, float(reward), terminated, truncated)
    episode = acc.cut("lane_fault")
    assert got == [episode]
    assert episode is not None and episode.cut == "lane_fault"
    assert episode.truncations == [False, False, True] and episode.terminations == [False] * 3
    assert acc.cut("server_stop") is None  # nothing open: nothing happens
    with pytest.raises(ValueError, match="unknown cut reason"):
        acc.cut("bored")


def test_a_reset_mid_episode_cuts_it_and_drop_faulted_drops_cuts() -> None:
    space = spaces.Discrete(4)
    kept: list[Episode] = []
    acc = EpisodeAccumulator(0, space, space, kept.append)
    acc.reset(0, 5)
    acc.step(1, 2, 1.0, False, False)
    acc.reset(3, 6)  # the client resets mid-episode
    assert [(e.seed, e.cut, e.truncations) for e in kept] == [(5, "reset", [True])]

    dropped: list[Episode] = []
    acc = EpisodeAccumulator(0, space, space, dropped.append, drop_faulted=True)
    acc.reset(0, None)
    acc.step(1, 2, 1.0, False, False)
    assert acc.cut("session_close") is None
    acc.reset(0, None)
    acc.step(1, 2, 1.0, False, True)  # the env's own end is always kept
    assert [e.cut for e in dropped] == [None] and acc.episodes_dropped == 1


def test_an_episode_without_a_step_is_not_recorded_and_a_stray_step_is_counted() -> None:
    space = spaces.Discrete(2)
    got: list[Episode] = []
    acc = EpisodeAccumulator(0, space, space, got.append)
    acc.reset(0, None)
    assert acc.cut("server_stop") is None and acc.episodes_dropped == 1
    assert acc.step(1, 1, 0.0, False, False) is None
    assert acc.steps_unrecorded == 1 and got == []


def test_infos_are_kept_per_step_when_asked() -> None:
    space = spaces.Discrete(2)
    got: list[Episode] = []
    acc = EpisodeAccumulator(0, space, space, got.append, record_infos=True)
    acc.reset(0, None, {"a": 0})
    acc.step(1, 1, 0.0, False, False, {"a": 1})
    acc.step(1, 1, 0.0, True, False, None)
    assert got[0].infos == [{"a": 0}, {"a": 1}, {}]


@pytest.mark.parametrize(
    ("space", "where"),
    [
        (spaces.Sequence(spaces.Discrete(3)), "observation_space"),
        (
            spaces.Dict({"ok": spaces.Discrete(2), "bad": spaces.Graph(spaces.Box(0, 1), None)}),
            "observation_space['bad']",
        ),
        (
            spaces.Tuple((spaces.Discrete(2), spaces.OneOf((spaces.Discrete(2),)))),
            "observation_space[1]",
        ),
    ],
)
def test_a_space_minari_cannot_store_is_refused_by_name(space: Any, where: str) -> None:
    with pytest.raises(UnsupportedSpaceError) as raised:
        EpisodeAccumulator(0, space, spaces.Discrete(2), lambda e: None)
    message = str(raised.value)
    assert message.startswith(f"{where} is a ") and "Minari 0.5 stores Box" in message


def test_every_space_minari_stores_stacks_into_minaris_form() -> None:
    space = spaces.Dict(
        {
            "box": spaces.Box(0, 255, (2, 3), np.uint8),
            "discrete": spaces.Discrete(5, start=-2),
            "multi": spaces.MultiDiscrete([3, 4]),
            "binary": spaces.MultiBinary(4),
            "text": spaces.Text(8),
            "tuple": spaces.Tuple((spaces.Discrete(2), spaces.Text(4))),
        }
    )
    check_space(space)
    space.seed(0)
    values = [space.sample() for _ in range(5)]
    batch = stack(space, values)
    assert batch["box"].shape == (5, 2, 3) and batch["box"].dtype == np.uint8
    assert batch["discrete"].dtype == np.int64
    assert batch["multi"].shape == (5, 2) and batch["binary"].shape == (5, 4)
    assert batch["text"] == [v["text"] for v in values]  # a list, not a tuple
    assert isinstance(batch["tuple"], tuple) and batch["tuple"][1] == [
        v["tuple"][1] for v in values
    ]
    for i, value in enumerate(values):
        assert np.array_equal(batch["box"][i], value["box"])
        assert batch["discrete"][i] == value["discrete"]


# -- the bounded worker -------------------------------------------------------------


def test_a_slow_writer_makes_put_wait_and_loses_nothing() -> None:
    gate = threading.Event()
    written: list[int] = []

    def write(batch: list[int]) -> int:
        gate.wait(30)
        written.extend(batch)
        return 10 * len(batch)

    batches: list[tuple[int, int]] = []
    worker = BoundedWorker("slow", write, capacity=2, on_batch=lambda n, b: batches.append((n, b)))
    blocked = put_blocked(worker)
    produced = threading.Event()

    def produce() -> None:
        for i in range(20):
            worker.put(i)
        produced.set()

    producer = threading.Thread(target=produce)
    producer.start()
    assert blocked.wait(20)  # the writer holds a batch, the queue is full: put waits
    assert worker.put_waits >= 1 and not produced.is_set()  # blocked, not dropping
    assert worker.depth == 2 and worker.high_water == 2 and worker.items_written == 0
    gate.set()
    assert produced.wait(20)
    producer.join(20)
    worker.close(20)
    assert written == list(range(20))
    assert worker.items_written == worker.items_put == 20 and worker.bytes_written == 200
    assert sum(n for n, _ in batches) == 20 and worker.put_wait_ns > 0
    assert not worker.alive


def test_a_writer_error_is_raised_by_put_and_close() -> None:
    def write(batch: list[int]) -> int:
        if 3 in batch:
            raise OSError("disk full")
        return 0

    worker = BoundedWorker("failing", write, capacity=1)
    for i in range(4):
        worker.put(i)
    worker._thread.join(20)  # the writer's first error ends its thread
    assert worker.error is not None
    with pytest.raises(RecordingError, match="disk full") as raised:
        worker.put(4)
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(RecordingError, match=r"failing failed: .*not written"):
        worker.close(20)
    assert not worker.alive


def test_close_writes_everything_queued_and_put_after_close_is_refused() -> None:
    written: list[int] = []
    worker = BoundedWorker("closing", lambda b: written.extend(b) or 0, capacity=100)
    for i in range(50):
        worker.put(i)
    worker.close(20)
    worker.close(20)  # idempotent
    assert written == list(range(50))
    with pytest.raises(RecordingError, match="closed"):
        worker.put(50)
    with pytest.raises(ValueError, match="capacity"):
        BoundedWorker("bad", lambda b: 0, capacity=0)


def test_a_lingering_writer_batches_and_a_close_does_not_wait_for_it() -> None:
    batches: list[list[int]] = []
    worker = BoundedWorker(
        "lingering", lambda b: batches.append(list(b)) or 0, capacity=8, linger=60.0, batch=3
    )
    for item in range(4):
        worker.put(item)
    worker.put(4)  # the writer took 3 or 4 at once; what is left only the close writes
    worker.close(30)  # the writer stops lingering when closed (not after 60 s)
    assert len(batches[0]) >= 3 and [i for b in batches for i in b] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="linger"):
        BoundedWorker("bad", lambda b: 0, linger=-1.0)
