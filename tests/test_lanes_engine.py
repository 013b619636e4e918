"""The lane engine (``rlmesh_trio._lanes``): threads, mailboxes, wire work, contract, teardown.

Fake envs block on ``threading.Event``/``threading.Barrier`` so "stuck" and "concurrent"
are deterministic; replies are bridged into Trio with ``TrioToken.run_sync_soon``. Every
test ends with no thread carrying a lane name and no new thread except idle Trio cache
workers (autouse fixture below).
"""

from __future__ import annotations

import gc
import io
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import outcome
import pytest
import trio
from gymnasium import spaces
from PIL import Image
from support.lanes import engine as lane_engine

from rlmesh_trio._errors import (
    ActionError,
    ContractMismatchError,
    LaneBrokenError,
    LaneClosedError,
    LaneError,
    PolicyViolation,
)
from rlmesh_trio._jobs import (
    CallJob,
    Job,
    LaneReply,
    Phases,
    RenderJob,
    RenderResult,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
)
from rlmesh_trio._lanes import LANE_TEARDOWN_TIMEOUT, LANE_THREAD_PREFIX, LaneEngine
from rlmesh_trio._lanes._work import LaneWork
from rlmesh_trio._png import encode_png
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._session import batch_infos, fold_phases

GOLDENS = Path(__file__).parent / "goldens"
SAFETY = 30.0
"""Upper bound for any wait on a thread in these tests (a hang fails, never blocks CI)."""


# --------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(autouse=True)
def _no_threads_left_behind() -> Any:
    before = set(threading.enumerate())
    yield
    lane_threads = [t.name for t in threading.enumerate() if t.name.startswith(LANE_THREAD_PREFIX)]
    assert lane_threads == []
    new = [t for t in threading.enumerate() if t not in before]
    # Trio keeps finished workers in its thread cache for a while (idle daemon threads
    # named "Trio thread N", holding nothing); anything else would be a leak.
    assert all(t.daemon and t.name.startswith("Trio thread") for t in new), new


def lane_of_current_thread() -> int:
    """The lane index, read from the lane thread's name (``rlmesh-trio-lane-<i>``)."""
    name = threading.current_thread().name
    assert name.startswith(LANE_THREAD_PREFIX), name
    return int(name[len(LANE_THREAD_PREFIX) :])


class ProbeEnv(gym.Env[Any, Any]):
    """A small deterministic env that records which thread did what."""

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(
        self,
        *,
        action_space: spaces.Space[Any] | None = None,
        observation_space: spaces.Space[Any] | None = None,
        render_mode: str | None = None,
        step_sleep: float = 0.0,
        observation: Any = None,
        close_hook: Callable[[], object] | None = None,
    ) -> None:
        self.action_space = action_space if action_space is not None else spaces.Discrete(3)
        self.observation_space = (
            observation_space if observation_space is not None else spaces.Discrete(3)
        )
        self.render_mode = render_mode
        self.step_sleep = step_sleep
        self.observation = observation
        self.close_hook = close_hook
        self.made_on = threading.get_ident()
        self.made_on_name = threading.current_thread().name
        self.calls: list[tuple[str, int]] = []
        self.close_threads: list[int] = []
        self.closed = threading.Event()

    def _obs(self, default: Any) -> Any:
        return default if self.observation is None else self.observation

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.calls.append(("reset", threading.get_ident()))
        return self._obs(1), {"seed": seed, "options": options or {}}

    def step(self, action: Any) -> tuple[Any, Any, Any, bool, dict[str, Any]]:
        self.calls.append(("step", threading.get_ident()))
        if self.step_sleep:
            time.sleep(self.step_sleep)  # the env's own work (releases the GIL)
        if isinstance(self.action_space, spaces.Discrete):
            a = int(action)
            return self._obs(a), np.float32(a + 0.5), np.bool_(a == 2), False, {"action": a}
        return self._obs(0), 0.0, False, True, {"action": np.asarray(action).tolist()}

    def render(self) -> Any:
        self.calls.append(("render", threading.get_ident()))
        if self.render_mode != "rgb_array":
            return None
        frame = np.zeros((4, 6, 3), dtype=np.uint8)
        frame[..., 0] = 255
        frame[1, 2] = (0, 255, 0)
        return frame

    def close(self) -> None:
        self.close_threads.append(threading.get_ident())
        self.closed.set()
        if self.close_hook is not None:
            self.close_hook()


class Built:
    """A make_env that records every env it built (in lane order)."""

    def __init__(self, build: Callable[[int], gym.Env[Any, Any]] | None = None) -> None:
        self.build = build if build is not None else (lambda lane: ProbeEnv())
        self.envs: dict[int, Any] = {}
        self.calls = 0

    def __call__(self) -> gym.Env[Any, Any]:
        lane = lane_of_current_thread()
        self.calls += 1
        env = self.build(lane)
        self.envs[lane] = env
        return env


class Replies:
    """Reply callbacks that record every call and wake the test in Trio."""

    def __init__(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.calls: dict[object, list[tuple[LaneReply, str]]] = {}
        self.events: dict[object, trio.Event] = {}

    def to(self, key: object) -> Callable[[LaneReply], None]:
        self.calls[key] = []
        event = self.events[key] = trio.Event()

        def reply(r: LaneReply) -> None:
            self.calls[key].append((r, threading.current_thread().name))
            with suppress(trio.RunFinishedError):
                self.token.run_sync_soon(event.set)

        return reply

    async def get(self, key: object) -> LaneReply:
        with trio.fail_after(SAFETY):
            await self.events[key].wait()
        return self.calls[key][0][0]

    def count(self, key: object) -> int:
        return len(self.calls[key])


@asynccontextmanager
async def serving(
    make_env: Callable[[], gym.Env[Any, Any]], num_envs: int = 1, **kwargs: Any
) -> AsyncIterator[LaneEngine]:
    engine = lane_engine(make_env, num_envs, **kwargs)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(SAFETY):
            await nursery.start(engine.run)
        try:
            yield engine
        finally:
            engine.close()


async def call(
    engine: LaneEngine, replies: Replies, lane: int, job: Callable[..., Job]
) -> LaneReply:
    key = object()
    engine.post(lane, job(), replies.to(key))
    r = await replies.get(key)
    assert replies.count(key) == 1
    return r


async def wait_lane_threads_gone() -> None:
    """For an abandoned lane released by the test: no event tells when Trio renamed its
    worker back, so poll for that, bounded in real time, on a worker thread (so it also
    works under the fake clock, where a Trio timeout would fire at once)."""

    def wait() -> bool:
        deadline = time.monotonic() + SAFETY
        while any(t.name.startswith(LANE_THREAD_PREFIX) for t in threading.enumerate()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    assert await trio.to_thread.run_sync(wait)


async def wait_closed(env: Any) -> None:
    """Wait (bounded in real time) until ``env.close()`` ran on some thread."""
    assert await trio.to_thread.run_sync(env.closed.wait, SAFETY)


def discrete_leaves(*actions: int) -> list[bytes]:
    return [np.asarray(actions, dtype="<i8").tobytes()]


# --------------------------------------------------------------------------------------
# 1. threads: one per lane, env built and used on it


@pytest.mark.parametrize("num_envs", [1, 3])
async def test_each_lane_builds_and_uses_its_env_on_its_own_named_thread(num_envs: int) -> None:
    built = Built()
    replies = Replies()
    async with serving(built, num_envs) as engine:
        assert built.calls == num_envs
        for lane in range(num_envs):
            r = await call(
                engine,
                replies,
                lane,
                lambda: CallJob(
                    fn=lambda e: (threading.get_ident(), threading.current_thread().name, e)
                ),
            )
            ident, name, env = r.outcome.unwrap()
            assert name == f"rlmesh-trio-lane-{lane}"
            assert env is built.envs[lane]
            assert env.made_on == ident
            assert env.made_on_name == name
            assert engine.alive(lane)
    idents = {env.made_on for env in built.envs.values()}
    assert len(idents) == num_envs
    assert all(env.close_threads == [env.made_on] for env in built.envs.values())


async def test_lanes_run_concurrently_without_a_shared_lock() -> None:
    # Every lane's job waits at one barrier: it only opens if all lanes are inside at once.
    barrier = threading.Barrier(4, timeout=SAFETY)
    replies = Replies()
    async with serving(Built(), 4) as engine:
        for lane in range(4):
            engine.post(lane, CallJob(fn=lambda env: barrier.wait()), replies.to(lane))
        results = [await replies.get(lane) for lane in range(4)]
    assert sorted(r.outcome.unwrap() for r in results) == [0, 1, 2, 3]
    assert [r.lane for r in results] == [0, 1, 2, 3]


async def test_a_slow_lane_does_not_delay_another_lane() -> None:
    release = threading.Event()
    replies = Replies()
    async with serving(Built(), 2) as engine:
        engine.post(0, CallJob(fn=lambda env: release.wait(SAFETY)), replies.to("slow"))
        fast = await call(engine, replies, 1, lambda: CallJob(fn=lambda env: "fast"))
        assert fast.outcome.unwrap() == "fast"
        assert replies.count("slow") == 0
        release.set()
        assert (await replies.get("slow")).outcome.unwrap() is True


# --------------------------------------------------------------------------------------
# 2. mailbox: order, queue_ns, exactly one reply, tracebacks


async def test_jobs_of_one_lane_run_in_arrival_order_and_queue_ns_is_the_wait() -> None:
    replies = Replies()
    gate = threading.Event()
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()
    order: list[int] = []

    def first(env: Any) -> None:
        token.run_sync_soon(started.set)
        gate.wait(SAFETY)
        order.append(0)

    async with serving(Built(), 1) as engine:
        engine.post(0, CallJob(fn=first), replies.to(0))
        for i in range(1, 20):
            engine.post(0, CallJob(fn=lambda env, i=i: order.append(i)), replies.to(i))
        after_last_post = time.perf_counter_ns()
        with trio.fail_after(SAFETY):
            await started.wait()
        gate_opened = time.perf_counter_ns()
        gate.set()
        results = [await replies.get(i) for i in range(20)]
    assert order == list(range(20))
    assert all(replies.count(i) == 1 for i in range(20))
    # Job 19 was posted before the gate opened and picked up after it, so it waited at
    # least that long in the mailbox.
    assert results[19].phases.queue_ns >= gate_opened - after_last_post
    assert all(r.phases.queue_ns >= 0 for r in results)


async def test_post_from_a_foreign_thread_and_the_reply_comes_from_the_lane_thread() -> None:
    replies = Replies()
    async with serving(Built(), 2) as engine:
        reply = replies.to("x")

        def poster() -> None:
            engine.post(1, CallJob(fn=lambda env: threading.current_thread().name), reply)

        await trio.to_thread.run_sync(poster)
        r = await replies.get("x")
    assert r.lane == 1
    assert r.outcome.unwrap() == "rlmesh-trio-lane-1"
    assert replies.calls["x"][0][1] == "rlmesh-trio-lane-1"
    assert replies.count("x") == 1


async def test_an_exception_is_captured_with_its_traceback() -> None:
    def explode(env: Any) -> None:
        raise KeyError("deep inside")

    replies = Replies()
    async with serving(Built(), 1) as engine:
        r = await call(engine, replies, 0, lambda: CallJob(fn=explode))
        assert isinstance(r.outcome, outcome.Error)
        err = r.outcome.error
        assert isinstance(err, KeyError)
        frames = []
        tb = err.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        assert frames[-1] == "explode"
        assert r.phases.user_ns > 0
        # the lane survives the job's exception
        ok = await call(engine, replies, 0, lambda: CallJob(fn=lambda env: 7))
        assert ok.outcome.unwrap() == 7


async def test_a_reply_callback_that_raises_does_not_kill_the_lane(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def bad_reply(r: LaneReply) -> None:
        raise RuntimeError("callback bug")

    replies = Replies()
    async with serving(Built(), 1) as engine:
        engine.post(0, CallJob(fn=lambda env: 1), bad_reply)
        ok = await call(engine, replies, 0, lambda: CallJob(fn=lambda env: 2))
        assert ok.outcome.unwrap() == 2
        assert engine.alive(0)
    assert any("reply callback" in rec.getMessage() for rec in caplog.records)


async def test_close_answers_queued_jobs_as_stopped_after_finishing_the_current_one() -> None:
    replies = Replies()
    gate = threading.Event()
    token = trio.lowlevel.current_trio_token()
    started = trio.Event()

    def current(env: Any) -> str:
        token.run_sync_soon(started.set)
        gate.wait(SAFETY)
        return "finished"

    built = Built()
    engine = LaneEngine(built, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        engine.post(0, CallJob(fn=current), replies.to("current"))
        for i in range(5):
            engine.post(0, CallJob(fn=lambda env: "never"), replies.to(i))
        with trio.fail_after(SAFETY):
            await started.wait()
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(LaneClosedError, match=r"^lane 0 is no longer running$"):
            engine.post(0, CallJob(fn=lambda env: None), replies.to("late"))
        assert not engine.alive(0)
        gate.set()
    assert (await replies.get("current")).outcome.unwrap() == "finished"
    for i in range(5):
        r = await replies.get(i)
        assert replies.count(i) == 1
        with pytest.raises(LaneBrokenError, match=r"^lane 0 stopped before answering$"):
            r.outcome.unwrap()
    assert replies.count("late") == 0
    assert built.envs[0].close_threads == [built.envs[0].made_on]


async def test_a_lane_that_dies_answers_its_jobs_once_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Simulate an engine bug on lane 0 while it runs job "bug": the lane thread dies.
    replies = Replies()
    gate = threading.Event()
    built = Built()
    doomed: list[Job] = []
    real_execute = LaneWork.execute

    def buggy_execute(self: LaneWork, env: Any, job: Job, queue_ns: int) -> Any:
        if any(job is d for d in doomed):
            raise RuntimeError("engine bug")
        return real_execute(self, env, job, queue_ns)

    monkeypatch.setattr(LaneWork, "execute", buggy_execute)
    async with serving(built, 2) as engine:
        engine.post(0, CallJob(fn=lambda env: gate.wait(SAFETY)), replies.to("first"))
        bug = CallJob(fn=lambda env: "never")
        doomed.append(bug)
        engine.post(0, bug, replies.to("bug"))
        engine.post(0, CallJob(fn=lambda env: "never"), replies.to("queued"))
        gate.set()
        assert (await replies.get("first")).outcome.unwrap() is True
        for key in ("bug", "queued"):
            with pytest.raises(LaneBrokenError, match=r"^lane 0 stopped before answering$"):
                (await replies.get(key)).outcome.unwrap()
        await wait_closed(built.envs[0])
        assert not engine.alive(0)
        with pytest.raises(LaneBrokenError, match=r"^lane 0 is no longer running$"):
            engine.post(0, CallJob(fn=lambda env: None), replies.to("late"))
        ok = await call(engine, replies, 1, lambda: CallJob(fn=lambda env: 1))
        assert ok.outcome.unwrap() == 1
        assert engine.alive(1)
    assert all(replies.count(k) == 1 for k in ("first", "bug", "queued"))
    assert replies.count("late") == 0
    assert any("lane 0 died" in rec.getMessage() for rec in caplog.records)
    for env in built.envs.values():
        assert env.close_threads == [env.made_on]


# --------------------------------------------------------------------------------------
# 3. wire work (needs the codec)


async def test_reset_encodes_the_observation_and_info_on_the_lane() -> None:
    from rlmesh_trio._codec import from_meta_map

    replies = Replies()
    async with serving(Built(), 1) as engine:
        r = await call(engine, replies, 0, lambda: ResetJob(seed=5, options={"k": 1}))
        result = r.outcome.unwrap()
        assert isinstance(result, ResetResult)
        expected, _ = engine.contract.observation_codec.encode_observation(1, soft_checks=True)
        assert result.observation == expected
        assert result.observation == [np.int64(1).tobytes()]  # Discrete: raw int64 (SPEC §3.3)
        assert from_meta_map(result.info) == {"seed": 5, "options": {"k": 1}}
        assert result.obs_warning is None
        assert r.phases.decode_ns == 0
        assert r.phases.user_ns > 0
        assert r.phases.encode_ns > 0


async def test_step_decodes_validates_steps_and_encodes() -> None:
    from rlmesh_trio._codec import from_meta_map

    replies = Replies()
    built = Built()
    async with serving(built, 3) as engine:
        # The session validated the whole 3-lane action: each lane decodes its own row.
        leaves = discrete_leaves(0, 1, 2)
        results = []
        for lane in range(3):
            results.append(
                await call(
                    engine,
                    replies,
                    lane,
                    lambda lane=lane: StepJob(leaves=leaves, n=3, row=lane, validated=True),
                )
            )
        for lane, r in enumerate(results):
            step = r.outcome.unwrap()
            assert isinstance(step, StepResult)
            assert step.observation == [np.int64(lane).tobytes()]
            assert step.reward == lane + 0.5
            assert type(step.reward) is float
            assert step.terminated is (lane == 2)
            assert step.truncated is False
            assert from_meta_map(step.info) == {"action": lane}
            assert step.action_warning is None
            assert step.obs_warning is None
            assert r.phases.decode_ns > 0
            assert r.phases.user_ns > 0
            assert r.phases.encode_ns > 0
            assert built.envs[lane].calls == [("step", built.envs[lane].made_on)]


async def test_an_unvalidated_step_runs_the_full_validation_and_errors_pass_unwrapped() -> None:
    replies = Replies()
    built = Built()
    async with serving(built, 1) as engine:
        r = await call(
            engine,
            replies,
            0,
            lambda: StepJob(leaves=discrete_leaves(5), n=1, row=0, validated=False),
        )
        with pytest.raises(ActionError) as info:
            r.outcome.unwrap()
        assert str(info.value) == "$: value 5 not in range [0, 3)"
        r = await call(
            engine,
            replies,
            0,
            lambda: StepJob(leaves=[b"\x00" * 4], n=1, row=0, validated=False),
        )
        with pytest.raises(ActionError, match="length mismatch"):
            r.outcome.unwrap()
        assert built.envs[0].calls == []  # the env never saw a bad action
        assert r.phases.user_ns == 0


class BoomEnv(ProbeEnv):
    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        raise RuntimeError("boom in step")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        return 0, {"bad": {1, 2}}  # a set is not a MetaValue


async def test_env_and_codec_exceptions_travel_as_raised() -> None:
    replies = Replies()
    async with serving(Built(lambda lane: BoomEnv()), 1) as engine:
        r = await call(
            engine,
            replies,
            0,
            lambda: StepJob(leaves=discrete_leaves(1), n=1, row=0, validated=False),
        )
        with pytest.raises(RuntimeError, match=r"^boom in step$"):
            r.outcome.unwrap()
        assert r.phases.user_ns > 0
        r = await call(engine, replies, 0, lambda: ResetJob(seed=None, options=None))
        with pytest.raises(TypeError):
            r.outcome.unwrap()


def box_env(observation: Any = None) -> ProbeEnv:
    box = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
    return ProbeEnv(action_space=box, observation_space=box, observation=observation)


BOX_OUT_OF_BOUNDS = [np.asarray([5.0, 0.0], dtype="<f4").tobytes()]


@pytest.mark.parametrize("policy", ["warn", "strict", "off"])
async def test_policy_for_a_soft_action_violation(policy: Any) -> None:
    replies = Replies()
    built = Built(lambda lane: box_env(observation=np.zeros(2, np.float32)))
    async with serving(built, 1, policy=policy) as engine:
        assert engine.policy == policy
        _, expected = engine.contract.action_codec.decode_action(
            BOX_OUT_OF_BOUNDS, 1, 0, soft_checks=True
        )
        assert expected is not None
        assert expected.kind == "action"
        r = await call(
            engine,
            replies,
            0,
            lambda: StepJob(leaves=BOX_OUT_OF_BOUNDS, n=1, row=0, validated=False),
        )
        if policy == "strict":
            with pytest.raises(PolicyViolation) as info:
                r.outcome.unwrap()
            assert str(info.value) == expected.detail
            assert built.envs[0].calls == []  # refused before the env was called
        else:
            step = r.outcome.unwrap()
            assert step.action_warning == (expected if policy == "warn" else None)
            assert [c[0] for c in built.envs[0].calls] == ["step"]


@pytest.mark.parametrize("policy", ["warn", "strict", "off"])
async def test_policy_for_a_soft_observation_violation(policy: Any) -> None:
    replies = Replies()
    bad = np.asarray([3.0, 0.0], dtype=np.float32)
    async with serving(Built(lambda lane: box_env(observation=bad)), 1, policy=policy) as engine:
        _, expected = engine.contract.observation_codec.encode_observation(bad, soft_checks=True)
        assert expected is not None
        assert expected.kind == "observation"
        r = await call(engine, replies, 0, lambda: ResetJob(seed=None, options=None))
        if policy == "strict":
            with pytest.raises(PolicyViolation) as info:
                r.outcome.unwrap()
            assert str(info.value) == expected.detail
        else:
            reset = r.outcome.unwrap()
            assert reset.obs_warning == (expected if policy == "warn" else None)
            assert reset.observation == [bad.tobytes()]


async def test_a_nan_observation_is_a_codec_error_under_every_policy() -> None:
    replies = Replies()
    nan = np.asarray([math.nan, 0.0], dtype=np.float32)
    async with serving(Built(lambda lane: box_env(observation=nan)), 1, policy="off") as engine:
        r = await call(engine, replies, 0, lambda: ResetJob(seed=None, options=None))
        with pytest.raises(ValueError, match="NaN"):
            r.outcome.unwrap()


async def test_render_encodes_png_or_answers_no_frame() -> None:
    replies = Replies()
    async with serving(Built(lambda lane: ProbeEnv(render_mode="rgb_array")), 1) as engine:
        assert engine.contract.render_mode == "rgb_array"
        r = await call(engine, replies, 0, lambda: RenderJob())
        result = r.outcome.unwrap()
        assert isinstance(result, RenderResult)
        assert result.frame is not None
        decoded = np.asarray(Image.open(io.BytesIO(result.frame)))
        assert decoded.shape == (4, 6, 3)
        assert decoded.tolist() == ProbeEnv(render_mode="rgb_array").render().tolist()
        assert r.phases.user_ns > 0
        assert r.phases.encode_ns > 0
        assert r.phases.decode_ns == 0
    async with serving(Built(), 1) as engine:
        assert engine.contract.render_mode == ""
        r = await call(engine, replies, 0, lambda: RenderJob())
        assert r.outcome.unwrap() == RenderResult(frame=None)


async def test_two_sleepy_lanes_step_concurrently_each_on_its_own_thread() -> None:
    # The reference's test, in spirit: a 300 ms step on each of two lanes.
    replies = Replies()
    built = Built(lambda lane: ProbeEnv(step_sleep=0.3))
    async with serving(built, 2) as engine:
        for lane in range(2):
            await call(
                engine,
                replies,
                lane,
                lambda lane=lane: ResetJob(seed=lane, options=None),
            )
        start = time.perf_counter()
        for lane in range(2):
            engine.post(
                lane,
                StepJob(leaves=discrete_leaves(1, 1), n=2, row=lane, validated=True),
                replies.to(lane),
            )
        results = [await replies.get(lane) for lane in range(2)]
        elapsed = time.perf_counter() - start
    assert elapsed < 0.6, elapsed  # sequential steps would need 2 x 300 ms
    assert all(r.outcome.unwrap().reward == 1.5 for r in results)
    assert all(r.phases.user_ns >= 300_000_000 for r in results)
    threads = []
    for lane in range(2):
        env = built.envs[lane]
        assert [c[0] for c in env.calls] == ["reset", "step"]
        assert {c[1] for c in env.calls} == {env.made_on}
        threads.append(env.made_on)
    assert threads[0] != threads[1]


# --------------------------------------------------------------------------------------
# 4. contract agreement


def _cartpole_metadata_as_served() -> dict[str, Any]:
    """CartPole's metadata as a fresh env has it now, as the wire carries it.

    Before gymnasium 1.4 a vector env writes ``autoreset_mode`` into the env *class's*
    metadata, so after any ``make_vec`` in the process every CartPole (here and in the
    reference server) carries it; from 1.4 on the class's dict stays as declared.
    """
    want: dict[str, Any] = {"render_modes": ["human", "rgb_array"], "render_fps": 50}
    local = gym.make("CartPole-v1")
    try:
        if "autoreset_mode" in local.metadata:
            want["autoreset_mode"] = "NextStep"
    finally:
        local.close()
    return want


async def test_the_contract_is_lane_zeros_and_built_once() -> None:
    from rlmesh_trio._codec import SpaceCodec, from_meta_map, space_to_spec

    async with serving(LaneEngine.factory("CartPole-v1"), 2) as engine:
        contract = engine.contract
        assert contract.env_id == "CartPole-v1"
        assert isinstance(contract.action_codec, SpaceCodec)
        assert isinstance(contract.observation_codec, SpaceCodec)
        assert bytes(space_to_spec(contract.action_space)) == bytes(
            space_to_spec(spaces.Discrete(2))
        )
        assert from_meta_map(contract.metadata) == _cartpole_metadata_as_served()
        assert contract.render_mode == ""
    async with serving(Built(), 1) as engine:
        assert engine.contract.env_id == "UnknownEnv-v1"


async def test_the_contract_is_not_available_before_start() -> None:
    engine = LaneEngine(Built(), 1)
    with pytest.raises(RuntimeError, match="not started"):
        engine.contract  # noqa: B018


@pytest.mark.parametrize(
    ("different", "what"),
    [
        (lambda: ProbeEnv(action_space=spaces.Discrete(4)), "action_space"),
        (lambda: ProbeEnv(observation_space=spaces.Discrete(4)), "observation_space"),
        (lambda: ProbeEnv(render_mode="rgb_array"), "render_mode"),
        (lambda: gym.make("CartPole-v1").unwrapped, "observation_space"),
    ],
)
async def test_a_lane_whose_contract_differs_is_refused(
    different: Callable[[], gym.Env[Any, Any]], what: str
) -> None:
    built = Built(lambda lane: different() if lane == 2 else ProbeEnv())
    engine = LaneEngine(built, 3)
    async with trio.open_nursery() as nursery:
        with pytest.raises(ContractMismatchError) as info:
            await nursery.start(engine.run)
    message = str(info.value)
    assert message.startswith("lane 2 disagrees with lane 0 on the env contract: ")
    assert what in message
    # the lanes already built were torn down: every env closed once, on its own thread
    assert sorted(built.envs) == [0, 1, 2]
    for env in built.envs.values():
        if isinstance(env, ProbeEnv):
            assert env.close_threads == [env.made_on]


class MetaEnv(ProbeEnv):
    def __init__(self, metadata: dict[str, Any], env_id: str | None = None) -> None:
        super().__init__()
        self.metadata = metadata
        if env_id is not None:
            self.spec = gym.envs.registration.EnvSpec(env_id)


async def test_metadata_and_env_id_must_agree() -> None:
    nan_meta = {"x": math.nan, "l": [1, 2.5, "a"]}
    async with serving(Built(lambda lane: MetaEnv(dict(nan_meta))), 2) as engine:
        assert engine.contract.env_id == "UnknownEnv-v1"  # NaN == NaN for the comparison
    for lane1, what in [
        (MetaEnv({"x": 1.0, "l": [1, 2.5, "a"]}), "metadata"),
        (MetaEnv({"x": math.nan, "l": [True, 2.5, "a"]}), "metadata"),  # bool is not int
        (MetaEnv(dict(nan_meta), env_id="Other-v0"), "env_id 'Other-v0' != 'UnknownEnv-v1'"),
    ]:
        built = Built(lambda lane, lane1=lane1: lane1 if lane == 1 else MetaEnv(dict(nan_meta)))
        engine = LaneEngine(built, 2)
        async with trio.open_nursery() as nursery:
            with pytest.raises(ContractMismatchError, match=r"^lane 1 disagrees") as info:
                await nursery.start(engine.run)
        assert what in str(info.value)


async def test_autoreset_mode_in_metadata_is_served_as_the_reference_does() -> None:
    # Checked against rlmesh 0.1.0: gymnasium 1.4's vector envs copy the metadata before
    # writing autoreset_mode, so a CartPole built after make_vec serves plain metadata
    # (older gymnasiums write it into the class's dict: then both servers serve it); an
    # env whose own metadata carries autoreset_mode keeps it (served as text "NextStep").
    from gymnasium.vector import AutoresetMode

    from rlmesh_trio._codec import from_meta_map

    vec = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    try:
        async with serving(LaneEngine.factory("CartPole-v1"), 1) as engine:
            assert from_meta_map(engine.contract.metadata) == _cartpole_metadata_as_served()
    finally:
        vec.close()
    meta = {"autoreset_mode": AutoresetMode.NEXT_STEP}
    async with serving(Built(lambda lane: MetaEnv(dict(meta))), 2) as engine:
        assert from_meta_map(engine.contract.metadata) == {"autoreset_mode": "NextStep"}


async def test_a_make_env_failure_surfaces_at_start_after_tearing_down_the_built_lanes() -> None:
    def build(lane: int) -> gym.Env[Any, Any]:
        if lane == 1:
            raise OSError("no simulator licence")
        return ProbeEnv()

    built = Built(build)
    engine = LaneEngine(built, 3)
    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError, match="no simulator licence") as info:
            await nursery.start(engine.run)
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "build" in frames  # the real traceback survived
    for env in built.envs.values():
        assert env.close_threads == [env.made_on]
    with pytest.raises(LaneClosedError):
        engine.post(0, CallJob(fn=lambda env: None), lambda r: None)


async def test_a_startup_failure_does_not_wait_for_a_lane_stuck_building(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlmesh_trio.lanes")
    release = threading.Event()
    lane1_building = threading.Event()

    def build(lane: int) -> gym.Env[Any, Any]:
        if lane == 0:
            lane1_building.wait(SAFETY)  # fail only once lane 1 is stuck in its make_env
            raise ValueError("bad config")
        lane1_building.set()
        release.wait(SAFETY)
        return ProbeEnv()

    built = Built(build)
    engine = lane_engine(built, 2, teardown_timeout=0.2)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="bad config"):
            await nursery.start(engine.run)
    assert time.perf_counter() - start < 0.2 + 5.0
    assert not release.is_set()
    assert any("lane 1" in rec.getMessage() for rec in caplog.records)
    release.set()  # lane 1 finishes building, finds nothing to serve, closes its env
    await wait_lane_threads_gone()
    assert built.envs[1].close_threads == [built.envs[1].made_on]


async def test_an_unsupported_space_surfaces_at_start() -> None:
    from rlmesh_trio._errors import UnsupportedSpaceError

    built = Built(lambda lane: ProbeEnv(observation_space=spaces.Graph(spaces.Discrete(2), None)))
    engine = LaneEngine(built, 2)
    async with trio.open_nursery() as nursery:
        with pytest.raises(UnsupportedSpaceError):
            await nursery.start(engine.run)
    assert all(env.closed.is_set() for env in built.envs.values())


# --------------------------------------------------------------------------------------
# 5, 6. folding phases and batching infos


def test_fold_phases_sums_codec_time_and_takes_the_slowest_lane() -> None:
    lanes = [
        Phases(queue_ns=5, decode_ns=1, user_ns=10_000_000, encode_ns=2),
        Phases(queue_ns=9, decode_ns=3, user_ns=40_000_000, encode_ns=4),
        Phases(queue_ns=1, decode_ns=5, user_ns=100_000_000, encode_ns=6),
    ]
    folded, skew = fold_phases(lanes)
    assert folded == Phases(queue_ns=9, decode_ns=9, user_ns=100_000_000, encode_ns=12)
    assert skew == 90_000_000


def test_fold_phases_edge_cases() -> None:
    one = Phases(queue_ns=1, decode_ns=2, user_ns=3, encode_ns=4)
    assert fold_phases([one]) == (one, None)
    assert fold_phases([]) == (Phases(), None)
    assert fold_phases([Phases(), Phases()]) == (Phases(), None)  # slowest 0: no skew
    assert fold_phases([Phases(user_ns=7), Phases(user_ns=7)])[1] == 0


def test_batch_infos() -> None:
    a = spaces_v1.MetaMap(entries={"x": spaces_v1.MetaValue(integer=1)})
    b = spaces_v1.MetaMap()
    assert batch_infos([a], None) is a
    assert batch_infos([a], [True]) is a
    assert bytes(batch_infos([], None)) == b""
    batched = batch_infos([a, b], [False, True])
    assert list(batched.entries) == ["final_info", "_final_info"]
    final = batched.entries["final_info"].list
    assert final is not None
    assert [item.map for item in final.items] == [a, b]
    mask = batched.entries["_final_info"].list
    assert mask is not None
    assert [item.bool for item in mask.items] == [False, True]
    # a reset's mask is all true; an empty lane map still has its entry (SPEC §5.3)
    reset = batch_infos([b, b, b], None)
    reset_mask = reset.entries["_final_info"].list
    assert reset_mask is not None
    assert [item.bool for item in reset_mask.items] == [True] * 3
    # round trip: on the wire the False flags are present (oneof at default)
    parsed = spaces_v1.MetaMap.parse(bytes(batched))
    parsed_mask = parsed.entries["_final_info"].list
    assert parsed_mask is not None
    assert [i.bool for i in parsed_mask.items] == [False, True]
    with pytest.raises(ValueError, match="done flags"):
        batch_infos([a, b], [True])


# --------------------------------------------------------------------------------------
# 7. error texts, alive()


async def test_error_texts_and_alive() -> None:
    engine = LaneEngine(Built(), 2)
    for bad in (-1, 2, 7):
        with pytest.raises(LaneError, match=rf"^lane {bad} out of range for 2 lanes$"):
            engine.post(bad, CallJob(fn=lambda env: None), lambda r: None)
        with pytest.raises(LaneError, match=rf"^lane {bad} out of range for 2 lanes$"):
            engine.alive(bad)
    assert not engine.alive(0)  # not started yet
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        assert engine.alive(0)
        assert engine.alive(1)
        engine.close()
        assert not engine.alive(0)
        assert not engine.alive(1)
    with pytest.raises(LaneClosedError, match=r"^lane 1 is no longer running$"):
        engine.post(1, CallJob(fn=lambda env: None), lambda r: None)
    with pytest.raises(RuntimeError, match="only be called once"):
        await engine.run()


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="num_envs"):
        LaneEngine(Built(), 0)
    # The engine takes resolved options: its policy and teardown deadline are checked by
    # the one validator, ``resolve()``, under their ServeOptions names.
    with pytest.raises(ValueError, match="policy"):
        lane_engine(Built(), 1, policy="loud")
    with pytest.raises(ValueError, match="close_timeout_seconds"):
        lane_engine(Built(), 1, teardown_timeout=-1)
    with pytest.raises(TypeError):
        LaneEngine("CartPole-v1", 1)  # type: ignore[arg-type]
    assert LANE_TEARDOWN_TIMEOUT == 5.0


def test_factory() -> None:
    env = LaneEngine.factory("CartPole-v1", max_episode_steps=3)()
    try:
        assert env.spec is not None
        assert env.spec.id == "CartPole-v1"
        assert env.spec.max_episode_steps == 3
    finally:
        env.close()
    probe = LaneEngine.factory(ProbeEnv, render_mode="rgb_array")()
    assert isinstance(probe, ProbeEnv)
    assert probe.render_mode == "rgb_array"
    with pytest.raises(TypeError):
        LaneEngine.factory(42)  # type: ignore[arg-type]


async def test_jobs_posted_before_run_wait_for_the_lane() -> None:
    replies = Replies()
    engine = LaneEngine(Built(), 1)
    engine.post(0, CallJob(fn=lambda env: threading.current_thread().name), replies.to("early"))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        assert (await replies.get("early")).outcome.unwrap() == "rlmesh-trio-lane-0"
        engine.close()


async def test_close_before_run_builds_nothing_and_returns() -> None:
    built = Built()
    engine = LaneEngine(built, 2)
    engine.close()
    with trio.fail_after(SAFETY):
        await engine.run()
    assert built.calls == 0


# --------------------------------------------------------------------------------------
# 8, 9. teardown


async def test_teardown_closes_every_env_once_concurrently_and_drops_them() -> None:
    # Both envs' close() wait at a barrier: it only opens when both lanes close at once.
    barrier = threading.Barrier(2, timeout=SAFETY)
    passed: list[int] = []
    refs: list[weakref.ref[Any]] = []
    closes: list[tuple[int, int, int]] = []

    def build(lane: int) -> gym.Env[Any, Any]:
        def close_hook() -> None:
            barrier.wait()
            passed.append(lane)

        env = ProbeEnv(close_hook=close_hook)
        refs.append(weakref.ref(env))
        original_close = env.close

        def close() -> None:
            closes.append((lane, threading.get_ident(), env.made_on))
            original_close()

        env.close = close  # type: ignore[method-assign]
        return env

    def make() -> gym.Env[Any, Any]:
        return build(lane_of_current_thread())

    async with serving(make, 2) as engine:
        replies = Replies()
        for lane in range(2):
            await call(engine, replies, lane, lambda: ResetJob(seed=None, options=None))
    assert sorted(passed) == [0, 1]
    assert sorted(lane for lane, _, _ in closes) == [0, 1]  # exactly once each
    assert all(ident == made_on for _, ident, made_on in closes)
    del replies, engine
    gc.collect()
    assert [r() for r in refs] == [None, None]


async def test_cancelling_run_still_closes_the_envs() -> None:
    built = Built()
    with trio.CancelScope() as scope:
        async with serving(built, 3):
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    for env in built.envs.values():
        assert env.close_threads == [env.made_on]


async def test_teardown_abandons_a_wedged_lane_within_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlmesh_trio.lanes")
    release = threading.Event()
    token = trio.lowlevel.current_trio_token()
    wedged = trio.Event()
    replies = Replies()
    built = Built()
    engine = lane_engine(built, 2, teardown_timeout=0.3)

    def wedge(env: Any) -> str:
        token.run_sync_soon(wedged.set)
        release.wait(SAFETY)
        return "too late"

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        engine.post(0, CallJob(fn=wedge), replies.to("wedged"))
        engine.post(0, CallJob(fn=lambda env: "queued"), replies.to("queued"))
        with trio.fail_after(SAFETY):
            await wedged.wait()
        start = time.perf_counter()
        engine.close()
    elapsed = time.perf_counter() - start
    assert not release.is_set()
    assert elapsed < 0.3 + 5.0  # the bound plus a generous margin: it did not wait
    for key in ("wedged", "queued"):
        r = await replies.get(key)
        with pytest.raises(LaneBrokenError, match=r"^lane 0 stopped before answering$"):
            r.outcome.unwrap()
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any("lane 0" in m and "abandon" in m for m in warnings), warnings
    assert not any("lane 1" in m for m in warnings)
    assert built.envs[1].close_threads == [built.envs[1].made_on]  # the healthy lane closed
    assert built.envs[0].close_threads == []
    # Let the wedged thread go: it finds its job answered, closes its env and exits.
    release.set()
    await wait_closed(built.envs[0])
    await wait_lane_threads_gone()
    assert built.envs[0].close_threads == [built.envs[0].made_on]
    assert replies.count("wedged") == 1
    assert replies.count("queued") == 1


async def test_the_default_teardown_bound_on_a_fake_clock(autojump_clock: trio.abc.Clock) -> None:
    # One lane, already wedged: from here no real thread has to make progress, so the
    # fake clock can run the default 5 s deadline out at once.
    release = threading.Event()
    token = trio.lowlevel.current_trio_token()
    wedged = trio.Event()
    replies = Replies()
    built = Built()

    def wedge(env: Any) -> None:
        token.run_sync_soon(wedged.set)
        release.wait(SAFETY)

    engine = LaneEngine(built, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        engine.post(0, CallJob(fn=wedge), replies.to("wedged"))
        await wedged.wait()
        start = trio.current_time()
        engine.close()
    waited = trio.current_time() - start
    assert LANE_TEARDOWN_TIMEOUT <= waited < LANE_TEARDOWN_TIMEOUT + 1.0
    with pytest.raises(LaneBrokenError, match="stopped before answering"):
        (await replies.get("wedged")).outcome.unwrap()
    release.set()
    await wait_closed(built.envs[0])
    await wait_lane_threads_gone()


async def test_teardown_abandons_an_env_close_that_never_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlmesh_trio.lanes")
    release = threading.Event()
    built = Built(
        lambda lane: ProbeEnv(close_hook=(lambda: release.wait(SAFETY)) if lane == 1 else None)
    )
    start = time.perf_counter()
    async with serving(built, 2, teardown_timeout=0.2):
        start = time.perf_counter()
    assert time.perf_counter() - start < 0.2 + 5.0
    assert not release.is_set()
    assert any("lane 1" in rec.getMessage() for rec in caplog.records)
    assert built.envs[0].close_threads == [built.envs[0].made_on]
    release.set()
    await wait_lane_threads_gone()


# --------------------------------------------------------------------------------------
# PNG


def golden_render_frame() -> bytes:
    with open(GOLDENS / "render.jsonl", encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            render = record.get("fields", {}).get("3:render")
            if record.get("kind") == "message" and render and "1:frame" in render:
                return bytes.fromhex(render["1:frame"])
    raise AssertionError("no render frame in the render golden")


def decode_png(data: bytes | None, mode: str = "RGB") -> np.ndarray[Any, Any]:
    assert data is not None
    image = Image.open(io.BytesIO(data))
    assert image.mode == mode
    return np.asarray(image)


def test_png_matches_the_reference_frame_pixel_for_pixel() -> None:
    reference = golden_render_frame()
    frame = decode_png(reference)
    assert frame.shape == (4, 6, 3)  # the reference's 6x4 frame (SPEC §7.10)
    ours = encode_png(frame)
    assert ours is not None and ours.startswith(b"\x89PNG\r\n\x1a\n")
    assert np.array_equal(decode_png(ours), frame)


def test_png_keeps_rgba_and_gray_and_casts_other_dtypes_as_numpy_does() -> None:
    """As the reference: RGBA and gray frames keep their mode; another dtype is cast to
    uint8 (wrapped, truncated; True is 1)."""
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    rgba = np.concatenate([rgb, np.full((2, 3, 1), 7, np.uint8)], axis=2)
    assert np.array_equal(decode_png(encode_png(rgba), "RGBA"), rgba)
    gray = np.array([[0, 128], [255, 3]], dtype=np.uint8)
    assert np.array_equal(decode_png(encode_png(gray), "L"), gray)
    assert np.array_equal(decode_png(encode_png(gray.astype(np.int64)), "L"), gray)
    wrapped = np.array([[1000, -5, 312]], dtype=np.int64)
    assert decode_png(encode_png(wrapped), "L").tolist() == [[232, 251, 56]]
    assert decode_png(encode_png(np.array([[0.3, 2.9]])), "L").tolist() == [[0, 2]]
    assert decode_png(encode_png(np.array([[True, False]])), "L").tolist() == [[1, 0]]
    assert np.array_equal(decode_png(encode_png(rgb.tolist())), rgb)


@pytest.mark.parametrize(
    "frame",
    [
        np.zeros((2, 2, 1), np.uint8),
        np.zeros((2, 2, 2), np.uint8),
        np.zeros((2, 2, 5), np.uint8),
        np.zeros((1, 2, 2, 3), np.uint8),
        np.zeros((2,), np.uint8),
    ],
)
def test_a_frame_of_another_shape_is_no_frame(frame: Any) -> None:
    assert encode_png(frame) is None


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (np.zeros((0, 2, 3), np.uint8), RuntimeError),
        (np.zeros((2, 0, 3), np.uint8), RuntimeError),
        ("not a frame", ValueError),
    ],
)
def test_png_refuses_what_it_cannot_encode(frame: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_png(frame)
