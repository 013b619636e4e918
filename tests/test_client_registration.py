"""The gymnasium id ``rlmesh_trio/Remote-v0`` (issue 30, item 1): ``gymnasium.make`` and
``gymnasium.make_vec`` reach the client, after ``import rlmesh_trio`` and through the
``rlmesh_trio:`` module prefix alone; ``num_envs`` and ``render_mode`` are checked against
the endpoint; the wrappers ``make`` adds never call the remote env themselves; and the
``make_vec`` snippet of docs/trainers.md runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from support import envs
from support.refserver import ServerConfig, ServerPool

import rlmesh_trio
from rlmesh_trio.client import Env, VectorEnv

pytestmark = pytest.mark.timeout(120)

ID = "rlmesh_trio/Remote-v0"
TESTS = Path(__file__).resolve().parent
TRAINERS_MD = TESTS.parent / "docs" / "trainers.md"


def cartpole(servers: ServerPool, lanes: int) -> str:
    return servers.get("ours", ServerConfig(num_envs=lanes)).address


def test_import_registers_the_id_once_with_string_entry_points() -> None:
    spec = gym.spec(ID)
    assert spec.entry_point == "rlmesh_trio.client:Env"
    assert spec.vector_entry_point == "rlmesh_trio.client:VectorEnv"
    assert spec.max_episode_steps is None and spec.kwargs == {}
    assert spec.order_enforce and not spec.disable_env_checker
    # Idempotent: a second registration changes nothing and warns nothing (warnings are
    # errors in this suite; gymnasium warns when an id is overridden).
    rlmesh_trio._register_with_gymnasium()  # type: ignore[attr-defined]
    assert gym.spec(ID) is spec


def run_python(code: str, timeout: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_package_stays_light() -> None:
    """Registration needs gymnasium's registry only: no client, no trainer library."""
    out = run_python(
        """
        import sys
        import rlmesh_trio
        import gymnasium
        assert "rlmesh_trio/Remote-v0" in gymnasium.registry
        heavy = {"torch", "stable_baselines3", "ray", "torchrl", "rlmesh_trio.client"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    assert out.strip() == "[]"


def test_the_module_prefix_needs_no_import(servers: ServerPool) -> None:
    """``rlmesh_trio:rlmesh_trio/Remote-v0`` in a program that never imports the package
    (a config-driven trainer): gymnasium imports it, which registers the id."""
    one, four = cartpole(servers, 1), cartpole(servers, 4)
    out = run_python(
        f"""
        import sys
        import gymnasium
        assert "rlmesh_trio" not in sys.modules
        env = gymnasium.make("rlmesh_trio:rlmesh_trio/Remote-v0", address={one!r})
        obs, _ = env.reset(seed=3)
        print(type(env.unwrapped).__module__, type(env.unwrapped).__name__, obs.shape)
        env.close()
        envs = gymnasium.make_vec(
            "rlmesh_trio:rlmesh_trio/Remote-v0",
            num_envs=4,
            vectorization_mode="vector_entry_point",
            address={four!r},
            autoreset_mode="SameStep",
        )
        obs, _ = envs.reset(seed=3)
        print(type(envs).__name__, envs.metadata["autoreset_mode"].name, obs.shape)
        envs.close()
        """
    )
    assert out.splitlines() == [
        "rlmesh_trio.client Env (4,)",
        "VectorEnv SAME_STEP (4, 4)",
    ]


@pytest.mark.parametrize("mode", [*AutoresetMode, "SameStep", "Disabled"], ids=str)
def test_make_vec_is_the_vector_env_with_its_autoreset_mode(
    servers: ServerPool, mode: AutoresetMode | str
) -> None:
    """``make_vec`` with ``vector_entry_point`` (and with the mode left out: gymnasium
    picks it for an id that has one) builds a ``VectorEnv`` whose transcript is
    ``SyncVectorEnv``'s over the same envs, seeds and actions."""
    address = cartpole(servers, 3)
    expected = AutoresetMode(mode)
    kwargs: dict[str, Any] = (
        {} if mode == "Disabled" else {"vectorization_mode": "vector_entry_point"}
    )
    remote = gym.make_vec(ID, num_envs=3, address=address, autoreset_mode=mode, **kwargs)
    local = SyncVectorEnv([envs.make_cartpole for _ in range(3)], autoreset_mode=expected)
    try:
        assert isinstance(remote, VectorEnv)
        assert remote.metadata["autoreset_mode"] is expected
        assert remote.spec is not None and remote.spec.id == ID
        assert remote.spec.kwargs["address"] == address
        transcripts = []
        for env in (local, remote):
            env.action_space.seed(5)
            steps: list[Any] = [env.reset(seed=9)]
            for _ in range(40):
                steps.append(env.step(env.action_space.sample()))
                done = steps[-1][2] | steps[-1][3]
                if expected == AutoresetMode.DISABLED and done.any():
                    steps.append(env.reset(options={"reset_mask": done}))
            transcripts.append(steps)
        for ours, theirs in zip(*transcripts, strict=True):
            for a, b in zip(ours[:-1], theirs[:-1], strict=True):  # infos differ in type only
                assert np.array_equal(a, b)
    finally:
        remote.close()
        local.close()


def test_make_vec_num_envs_must_be_the_endpoints_lanes(servers: ServerPool) -> None:
    address = cartpole(servers, 3)
    for asked in (1, 4):
        with pytest.raises(ValueError) as info:
            gym.make_vec(
                ID, num_envs=asked, vectorization_mode="vector_entry_point", address=address
            )
        assert str(info.value) == (
            f"num_envs={asked}, but the endpoint at {address} serves 3 lanes: a VectorEnv "
            "drives all of an endpoint's lanes (pass num_envs=3; gymnasium.make_vec's "
            "default is 1)"
        )
    with pytest.raises(TypeError, match="num_envs must be an int, not str"):
        VectorEnv(address, num_envs="3")  # type: ignore[arg-type]
    # The error left nothing behind: the endpoint admits the next client at once.
    envs_ = VectorEnv(address, num_envs=3)
    envs_.close()


def test_make_is_a_one_lane_env_behind_gymnasiums_wrappers(servers: ServerPool) -> None:
    """``make`` wraps the ``Env`` in the passive checker and ``OrderEnforcing``; the
    checker sees the caller's calls only. Its results equal a local CartPole's."""
    address = cartpole(servers, 1)
    env = gym.make(ID, address=address)
    calls: list[str] = []
    remote = env.unwrapped
    assert isinstance(remote, Env)
    for name in ("reset", "step", "render"):
        method = getattr(remote, name)

        def spy(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(remote, name, spy)
    local = envs.make_cartpole()
    try:
        wrappers = []
        inner: Any = env
        while isinstance(inner, gym.Wrapper):
            wrappers.append(type(inner).__name__)
            inner = inner.env
        assert wrappers == ["OrderEnforcing", "PassiveEnvChecker"]
        assert env.spec is not None and env.spec.kwargs == {"address": address}
        with pytest.raises(gym.error.ResetNeeded):
            env.step(0)
        first, theirs = env.reset(seed=4), local.reset(seed=4)
        assert np.array_equal(first[0], theirs[0])
        for action in (0, 1, 1, 0, 1):
            ours_step, theirs_step = env.step(action), local.step(action)
            assert np.array_equal(ours_step[0], theirs_step[0])
            assert ours_step[1:4] == theirs_step[1:4]
        assert env.render() is None  # CartPole served without a render mode
        assert calls == ["reset", *["step"] * 5, "render"]
    finally:
        env.close()
        local.close()


def test_make_refuses_a_vector_endpoint_and_another_render_mode(servers: ServerPool) -> None:
    three = cartpole(servers, 3)
    with pytest.raises(ValueError, match="3 lanes; use VectorEnv for it"):
        gym.make(ID, address=three)
    one = cartpole(servers, 1)
    with pytest.raises(ValueError) as info:
        gym.make(ID, address=one, render_mode="rgb_array")
    assert str(info.value).startswith(
        f"render_mode='rgb_array', but the env at {one} is served with render_mode=None;"
    )
    with pytest.raises(ValueError, match="render_mode='rgb_array', but"):
        gym.make_vec(ID, num_envs=3, address=three, render_mode="rgb_array")
    boom = servers.get("ours", ServerConfig(entrypoint="support.envs:make_boom")).address
    env = gym.make(ID, address=boom, render_mode="rgb_array")  # the served env's: fine
    try:
        env.reset(seed=1)
        assert env.render().shape == (*envs.FRAME_HW, 3)
    finally:
        env.close()


def trainers_snippet() -> str:
    """The first python block of docs/trainers.md's ``make_vec`` section."""
    text = TRAINERS_MD.read_text(encoding="utf-8")
    section = text.split("## gymnasium: `make` and `make_vec`", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


def test_the_trainers_doc_make_vec_snippet_runs(
    servers: ServerPool, capsys: pytest.CaptureFixture[str]
) -> None:
    code = trainers_snippet()
    assert '"tcp://127.0.0.1:50051"' in code and "--num-envs 8" in code
    address = servers.get("ours", ServerConfig(env_id="CartPole-v1", num_envs=8)).address
    namespace: dict[str, Any] = {}
    exec(
        compile(code.replace("tcp://127.0.0.1:50051", address), str(TRAINERS_MD), "exec"), namespace
    )
    finished = namespace["finished"]
    assert len(finished) >= 8 and all(r >= 8 for r in finished)
    assert namespace["envs"].closed
    assert re.fullmatch(r"\d+ episodes, mean return \d+\.\d\n", capsys.readouterr().out)
