"""``rlmesh_trio.client.sb3.RemoteVecEnv``: Stable-Baselines3's ``VecEnv`` over served
lanes, equal to SB3's own ``DummyVecEnv`` over the same envs (transcripts of observations,
rewards, dones, infos and ``reset_infos``; SB3's wrappers; a short PPO run), its
attributes, renders and errors, and lane faults that end episodes as truncations.

Skipped without Stable-Baselines3 (the ``sb3`` extra; ``nox -s trainers`` runs it)."""

from __future__ import annotations

import copy
import functools
import gc
import json
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np
import pytest
import trio
from support.faulty import RAISE, Controller, Factory
from support.serving import served

from rlmesh_trio import serve_env
from rlmesh_trio._codec import from_meta_map, to_meta_map
from rlmesh_trio.client import VectorEnv

pytest.importorskip("stable_baselines3")
torch = pytest.importorskip("torch")

from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.utils import check_for_correct_spaces  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecCheckNan,
    VecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
    is_vecenv_wrapped,
)
from stable_baselines3.common.vec_env.base_vec_env import tile_images  # noqa: E402

from rlmesh_trio.client.sb3 import RemoteAttributeError, RemoteVecEnv  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BOUND = 60.0
T = TypeVar("T")
OK = 0
LANE_FAULT = "rlmesh_trio.lane_fault"


# ---- envs ----------------------------------------------------------------------------


class Chatty(gym.Wrapper):  # type: ignore[type-arg]
    """CartPole whose infos carry what the wire carries (ints, floats, a string, an
    array, a nested dict), cut at 15 steps so episodes end both ways."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1", max_episode_steps=15))
        self.t = 0

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        self.t = 0
        return obs, {
            **info,
            "first": obs[:2].copy(),
            "how": {
                "seeded": kwargs.get("seed") is not None,
                "options": bool(kwargs.get("options")),
            },
        }

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.t += 1
        return obs, reward, terminated, truncated, {**info, "t": self.t, "x": float(obs[0])}


class DictObs(gym.ObservationWrapper):  # type: ignore[type-arg]
    """CartPole with a flat Dict observation (SB3's MultiInputPolicy kind)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1", max_episode_steps=12))
        box = self.env.observation_space
        assert isinstance(box, gym.spaces.Box)
        self.observation_space = gym.spaces.Dict(
            {
                "position": gym.spaces.Box(box.low[:2], box.high[:2], dtype=np.float32),
                "sign": gym.spaces.Discrete(2),
            }
        )

    def observation(self, observation: Any) -> Any:
        return {"position": observation[:2].copy(), "sign": np.int64(observation[2] > 0)}


class WireInfos(gym.Wrapper):  # type: ignore[type-arg]
    """A local env whose infos are as they arrive over the wire (numpy arrays as lists,
    numpy scalars as Python numbers): what a remote env can be equal to."""

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        return obs, from_meta_map(to_meta_map(info))

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, from_meta_map(to_meta_map(info))


def local(make: Callable[[], gym.Env[Any, Any]], n: int) -> DummyVecEnv:
    return DummyVecEnv([lambda: WireInfos(make()) for _ in range(n)])


async def with_server(
    make: Callable[[], gym.Env[Any, Any]],
    num_envs: int,
    client: Callable[[str], T],
    **options: Any,
) -> T:
    """Serve ``num_envs`` lanes of ``make`` in this process (``options``:
    :class:`ServeOptions` fields) and run the blocking ``client(address)`` on a worker
    thread; the server stops when it returns."""
    with trio.fail_after(BOUND):
        async with served(make, num_envs, close_timeout_seconds=None, **options) as address:
            return await trio.to_thread.run_sync(client, address)


def same(a: Any, b: Any, path: str = "$") -> None:
    """``a`` and ``b`` equal in structure, types, dtypes, shapes and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{path}: {a!r} {b!r}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
        )
        assert np.array_equal(a, b), f"{path}: {a} vs {b}"
        return
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)} ({a!r} vs {b!r})"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def transcript(venv: VecEnv, steps: int, seed: int) -> list[Any]:
    """A scripted SB3 session: ``seed()`` then ``reset()``, random steps; mid-way a
    seeded reset with options for every lane, later options for some lanes only."""
    n = venv.num_envs
    rng = np.random.default_rng(seed)
    venv.seed(seed)
    out: list[Any] = [("reset", venv.reset(), copy.deepcopy(venv.reset_infos))]
    for t in range(steps):
        if t == steps // 2:
            venv.seed(seed + 1000)
            venv.set_options({"low": -0.01, "high": 0.01})
            out.append(("reset", venv.reset(), copy.deepcopy(venv.reset_infos)))
        if t == 3 * steps // 4:
            venv.set_options([{"low": -0.02, "high": 0.02} if i % 2 else {} for i in range(n)])
            out.append(("reset", venv.reset(), copy.deepcopy(venv.reset_infos)))
        actions = rng.integers(0, 2, size=n)
        out.append(("step", venv.step(actions), copy.deepcopy(venv.reset_infos)))
    return out


def dones_of(record: list[Any]) -> tuple[int, int]:
    """How many episodes the transcript ended by termination and by truncation."""
    terminated = truncated = 0
    for kind, result, _ in record:
        if kind != "step":
            continue
        for done, info in zip(result[2], result[3], strict=True):
            if done:
                truncated += info["TimeLimit.truncated"]
                terminated += not info["TimeLimit.truncated"]
    return terminated, truncated


# ---- the import ------------------------------------------------------------------------


def test_importing_the_package_imports_neither_torch_nor_sb3() -> None:
    code = (
        "import json, sys\n"
        "import rlmesh_trio, rlmesh_trio.client\n"
        "from rlmesh_trio.client import VectorEnv, Env, open_endpoint\n"
        "heavy = lambda: sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'stable_baselines3'))\n"
        "before = heavy()\n"
        "import rlmesh_trio.client.sb3\n"
        "print(json.dumps([before, 'stable_baselines3' in sys.modules, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=True
    )
    before, sb3_after, torch_after = json.loads(out.stdout)
    assert before == []
    assert sb3_after and torch_after  # the sb3 module does import them


def test_the_module_shows_its_public_path() -> None:
    import rlmesh_trio.client.sb3 as module

    assert module.__all__ == sorted(module.__all__) == ["RemoteAttributeError", "RemoteVecEnv"]
    for name in module.__all__:
        value = getattr(module, name)
        assert value.__module__ == "rlmesh_trio.client.sb3" and (value.__doc__ or "").strip()
    assert issubclass(RemoteVecEnv, VecEnv)
    assert issubclass(RemoteAttributeError, NotImplementedError)
    assert issubclass(RemoteAttributeError, AttributeError)


# ---- equal to DummyVecEnv --------------------------------------------------------------


CASES: dict[str, Callable[[], gym.Env[Any, Any]]] = {"chatty": Chatty, "dict": DictObs}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_transcript_equals_dummy_vec_env(case: str) -> None:
    make, n, steps = CASES[case], 3, 300

    def client(address: str) -> list[Any]:
        remote = RemoteVecEnv(address)
        try:
            assert remote.num_envs == n
            return transcript(remote, steps, seed=11)
        finally:
            remote.close()

    theirs = local(make, n)
    try:
        expected = transcript(theirs, steps, seed=11)
    finally:
        theirs.close()
    got = await with_server(make, n, client)
    same(expected, got)
    terminated, truncated = dones_of(got)
    assert terminated > 10 and truncated > 10  # both ways of ending, many times


@pytest.mark.parametrize("case", sorted(CASES))
async def test_over_several_endpoints_the_transcript_equals_dummy_vec_env(case: str) -> None:
    """Three endpoints of two lanes, a RemoteVecEnv of four gathered from their list:
    the first two endpoints' lanes in list order, DummyVecEnv's transcript exactly; its
    close reports the episodes in its own env numbers."""
    make, steps = CASES[case], 200

    def client(addresses: list[str]) -> list[Any]:
        remote = RemoteVecEnv(",".join(addresses), num_envs=4)
        try:
            assert remote.num_envs == 4 and remote.addresses == addresses[:2]
            return transcript(remote, steps, seed=17)
        finally:
            remote.close()
            assert {e.env_index for e in remote.final_episodes} <= {0, 1, 2, 3}

    theirs = local(make, 4)
    try:
        expected = transcript(theirs, steps, seed=17)
    finally:
        theirs.close()
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(functools.partial(serve_env, make, num_envs=2, endpoints=3))
            got = await trio.to_thread.run_sync(client, list(info.addresses))
            nursery.cancel_scope.cancel()
    same(expected, got)


async def test_sb3_wrappers_and_checks_see_what_they_see_on_dummy_vec_env() -> None:
    """VecCheckNan, VecNormalize, VecFrameStack and VecMonitor over RemoteVecEnv give
    what they give over DummyVecEnv; SB3's space check and wrapper lookups agree."""

    def wrap(venv: VecEnv) -> VecEnv:
        venv = VecCheckNan(venv, raise_exception=True)
        venv = VecNormalize(venv, gamma=0.98)
        venv = VecFrameStack(venv, n_stack=3)
        return VecMonitor(venv)

    spaces = Chatty()

    def session(venv: VecEnv) -> list[Any]:
        check_for_correct_spaces(venv, spaces.observation_space, spaces.action_space)
        wrapped = wrap(venv)
        assert is_vecenv_wrapped(wrapped, VecNormalize)
        return transcript(wrapped, 120, seed=3)

    def client(address: str) -> list[Any]:
        remote = RemoteVecEnv(address)
        try:
            assert remote.env_is_wrapped(gym.wrappers.TimeLimit) == [False, False]
            return session(remote)
        finally:
            remote.close()

    theirs = local(Chatty, 2)
    try:
        expected = session(theirs)
    finally:
        theirs.close()
    got = await with_server(Chatty, 2, client)
    for record in (expected, got):  # VecMonitor's wall-clock fields differ by nature
        for kind, result, _ in record:
            if kind == "step":
                for info in result[3]:
                    info.get("episode", {}).pop("t", None)
    same(expected, got)


class Episodes(BaseCallback):
    """Every finished episode's return and length, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, float, int]] = []

    def _on_step(self) -> bool:
        for i, info in enumerate(self.locals["infos"]):
            if "episode" in info:
                self.seen.append(
                    (self.num_timesteps, i, info["episode"]["r"], info["episode"]["l"])
                )
        return True


@pytest.fixture
def deterministic_torch() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def short_ppo(venv: VecEnv) -> tuple[list[tuple[int, int, float, int]], dict[str, Any]]:
    model = PPO("MlpPolicy", VecMonitor(venv), n_steps=64, batch_size=64, n_epochs=2, seed=5)
    episodes = Episodes()
    model.learn(3 * 64 * venv.num_envs, callback=episodes)
    return episodes.seen, model.policy.state_dict()


@pytest.mark.usefixtures("deterministic_torch")
async def test_a_short_ppo_run_learns_what_it_learns_on_dummy_vec_env() -> None:
    make = functools.partial(gym.make, "CartPole-v1")
    theirs = DummyVecEnv([make] * 4)
    try:
        expected = short_ppo(theirs)
    finally:
        theirs.close()

    def client(address: str) -> Any:
        remote = RemoteVecEnv(address)
        try:
            return short_ppo(remote)
        finally:
            remote.close()

    got = await with_server(make, 4, client)
    assert got[0] == expected[0] and len(got[0]) > 20
    assert list(got[1]) == list(expected[1])
    for name, tensor in expected[1].items():
        assert torch.equal(tensor, got[1][name]), name


# ---- attributes, render, errors --------------------------------------------------------


async def test_attributes_methods_and_render() -> None:
    controller = Controller(episode_steps=100)
    make = Factory(controller)

    def client(address: str) -> None:
        remote = RemoteVecEnv(address)
        theirs = DummyVecEnv([Factory(Controller(episode_steps=100)) for _ in range(2)])
        try:
            for name in ("observation_space", "action_space", "render_mode", "metadata"):
                assert remote.get_attr(name) == theirs.get_attr(name), name
                assert remote.has_attr(name)
            assert remote.get_attr("render_mode", indices=1) == ["rgb_array"]
            assert remote.env_method("get_wrapper_attr", "action_space", indices=[0]) == [
                gym.spaces.Discrete(4)
            ]
            assert remote.render_mode == theirs.render_mode == "rgb_array"
            assert remote.metadata == theirs.metadata
            for name in ("spec", "np_random", "num_envs", "unwrapped"):
                with pytest.raises(RemoteAttributeError, match=f"get_attr\\('{name}'\\)"):
                    remote.get_attr(name)
                assert not remote.has_attr(name)
            with pytest.raises(NotImplementedError, match=r"read RemoteVecEnv\.num_envs"):
                remote.get_attr("num_envs")
            with pytest.raises(RemoteAttributeError, match="set_attr\\('render_mode'\\)"):
                remote.set_attr("render_mode", None)
            with pytest.raises(NotImplementedError, match="env_method\\('seed'\\)"):
                remote.env_method("seed", 3)
            assert remote.env_is_wrapped(gym.Wrapper, indices=[1]) == [False]
            remote.seed(4)
            theirs.seed(4)
            same(theirs.reset(), remote.reset())
            for _ in range(3):
                same(theirs.step(np.array([1, 0])), remote.step(np.array([1, 0])))
            # The servers render lane 0 of a vector only: the other lanes have no frame
            # (asked once), and are black in render()'s tiled image.
            local_frames = theirs.get_images()
            images = remote.get_images()
            assert len(images) == 2 and images[1] is None
            same(local_frames[0], images[0])
            assert remote.env_method("render", indices=[1]) == [None]
            assert remote.env_method("render", indices=[0])[0].shape == (2, 3, 3)
            black = np.zeros_like(local_frames[1])
            same(tile_images([local_frames[0], black]), remote.render())
        finally:
            remote.close()
            theirs.close()
        assert sorted((e.env_index, e.step_count) for e in remote.final_episodes) == [
            (0, 3),
            (1, 3),
        ]
        remote.close()  # again: nothing

    await with_server(make, 2, client)


async def test_without_rgb_array_there_are_no_images() -> None:
    def client(address: str) -> None:
        remote = RemoteVecEnv(address)
        try:
            assert remote.render_mode is None
            with pytest.warns(UserWarning, match="render mode is None"):
                assert remote.get_images() == [None]
            with pytest.warns(UserWarning, match="no `render_mode`"):
                assert remote.render() is None
        finally:
            remote.close()

    await with_server(functools.partial(gym.make, "CartPole-v1"), 1, client)


async def test_step_before_reset_is_reset_needed_and_the_server_is_not_asked() -> None:
    controller = Controller()

    def client(address: str) -> None:
        remote = RemoteVecEnv(address)
        try:
            calls = [env.calls for env in controller.built]
            with pytest.raises(gym.error.ResetNeeded, match="before calling reset"):
                remote.step(np.array([0, 0]))
            assert [env.calls for env in controller.built] == calls  # no env was called
            remote.reset()
            remote.step(np.array([0, 0]))
        finally:
            remote.close()

    await with_server(Factory(controller), 2, client)


async def test_a_refused_constructor_holds_no_session() -> None:
    """SB3 refuses a nested observation space (as DummyVecEnv does); the session the
    constructor had opened is closed, so the next client gets the endpoint."""
    from support.envs import make_nested

    def client(address: str) -> None:
        with pytest.raises(NotImplementedError, match="Nested observation spaces"):
            RemoteVecEnv(address)
        envs = VectorEnv(address)
        envs.close()

    with pytest.raises(NotImplementedError, match="Nested observation spaces"):
        DummyVecEnv([make_nested])
    await with_server(make_nested, 1, client)


@pytest.fixture
def no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.usefixtures("no_gc")
async def test_a_dropped_remote_vec_env_frees_the_session_at_once() -> None:
    """No reference cycle of its own: dropped without ``close()`` (inside SB3's
    ``VecMonitor`` too), the client's connection goes at once and the next one joins."""

    def client(address: str) -> None:
        env = VecMonitor(RemoteVecEnv(address))
        env.reset()
        env.step(np.zeros(2, np.int64))
        gone = weakref.ref(env.unwrapped)
        del env
        assert gone() is None
        again = RemoteVecEnv(address)  # an open session would refuse it: FAILED_PRECONDITION
        again.reset()
        again.close()

    await with_server(functools.partial(gym.make, "CartPole-v1"), 2, client)


# ---- lane faults -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["rebuild", "truncate"])
async def test_a_lane_fault_ends_the_episode_as_a_truncation(policy: str) -> None:
    controller = Controller(episode_steps=100)

    def client(address: str) -> list[Any]:
        remote = RemoteVecEnv(address)
        try:
            remote.seed(3)
            out: list[Any] = [remote.reset()]
            out.append(remote.step(np.array([OK, OK])))
            out.append(remote.step(np.array([OK, RAISE])))  # lane 1's env raises
            out.append(remote.step(np.array([OK, OK])))
            return out
        finally:
            remote.close()

    first, before, fault, after = await with_server(
        Factory(controller), 2, client, on_lane_fault=policy
    )
    assert first.tolist() == [[0.0, 3.0], [0.0, 4.0]]
    obs, rewards, dones, infos = fault
    # rebuild: the whole-vector step is answered CRASHED, both lanes' results dropped;
    # truncate: only the faulted lane's step is a truncation.
    faulted = [0, 1] if policy == "rebuild" else [1]
    assert dones.tolist() == [i in faulted for i in range(2)]
    for i in range(2):
        if i in faulted:
            assert rewards[i] == 0.0 and infos[i]["TimeLimit.truncated"] is True
            same(before[0][i], infos[i]["terminal_observation"])  # its last observation
            # reset in the same step (unseeded: lane 1's env is a fresh one, never seeded)
            assert obs[i].tolist() == [0.0, 3.0 if i == 0 else -1.0]
        else:
            assert rewards[i] == 1.0 and "terminal_observation" not in infos[i]
            assert obs[i].tolist() == [2.0, 3.0]
    assert LANE_FAULT not in infos[0]
    fault_info = infos[1][LANE_FAULT]
    assert fault_info["lane"] == 1 and fault_info["error"] == "RuntimeError: boom on step 1"
    assert not after[2].any() and after[1].tolist() == [1.0, 1.0]


async def test_a_lane_that_cannot_be_reset_yet_is_reset_at_a_later_step() -> None:
    """The faulted lane's rebuild fails once (its factory raises): the lane is dead for
    the backoff, its reset refused. It keeps its last observation and each step reports
    it done again (reward 0) and tries again, until the rebuilt lane resets."""
    controller = Controller(episode_steps=10_000)

    def client(address: str) -> list[Any]:
        remote = RemoteVecEnv(address)
        try:
            remote.reset()
            remote.step(np.array([OK, OK]))
            controller.fail_builds = 1
            steps = [remote.step(np.array([OK, RAISE]))]
            deadline = time.monotonic() + 20
            while steps[-1][2][1] and time.monotonic() < deadline:
                steps.append(remote.step(np.array([OK, OK])))
                if steps[-1][2][1]:
                    time.sleep(0.02)  # the server's backoff; nothing to wait on here
            return steps
        finally:
            remote.close()

    steps = await with_server(Factory(controller), 2, client, on_lane_fault="truncate")
    first, *waiting, reset, last = steps
    assert first[2].tolist() == [False, True] and LANE_FAULT in first[3][1]
    stale = first[3][1]["terminal_observation"]
    assert stale.tolist() == [1.0, -1.0]
    assert waiting, "the rebuild was expected to fail once"
    for _obs, rewards, dones, infos in [first, *waiting, reset]:
        assert dones[1] and infos[1]["TimeLimit.truncated"] and rewards[1] == 0.0
    for obs, _rewards, _dones, _infos in [first, *waiting]:
        assert obs[1].tolist() == stale.tolist()  # no reset yet: the last observation
    for _obs, _rewards, _dones, infos in [*waiting, reset]:
        assert infos[1]["terminal_observation"].tolist() == stale.tolist()
        assert infos[1].get(LANE_FAULT, {}).get("lane", 1) == 1
    assert reset[0][1].tolist() == [0.0, -1.0]  # the rebuilt env's first observation
    assert [s[2][0] for s in steps] == [False] * len(steps)  # lane 0 steps on throughout
    obs, rewards, dones, infos = last
    assert not dones[1] and rewards[1] == 1.0 and obs[1].tolist() == [1.0, -1.0]
    assert controller.violations == []
