"""TorchRL mounts the served envs with no glue (issue 30): ``GymWrapper`` over
``rlmesh_trio.client.VectorEnv`` (8 lanes of ``rlmesh-trio serve``), in the two autoreset
modes TorchRL accepts — ``SAME_STEP`` (its ``VecGymEnvTransform`` reads the last
observation from ``final_obs``) and ``DISABLED`` (TorchRL resets finished lanes itself,
passing its ``_reset`` mask as ``reset(options={"reset_mask": ...})``) — passes
``check_env_specs``, and a rollout under a fixed-seed random policy is the same TensorDict,
leaf for leaf and exactly, as the same wrapper's over gymnasium's ``SyncVectorEnv``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.vector import AutoresetMode
from support.refserver import ServerConfig, ServerPool
from timings import timed

pytest.importorskip("torchrl")

import torch
from tensordict import TensorDictBase
from torchrl.envs import EnvBase, GymEnv, GymWrapper
from torchrl.envs.utils import check_env_specs

from rlmesh_trio.client import VectorEnv

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(300)]

ENV_ID = "CartPole-v1"
N_ENVS = 8
SEED = 0
STEPS = 200
"""Random CartPole episodes last ~20 steps: every lane ends (and is reset) several times."""

MODES = [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def local(mode: AutoresetMode) -> gym.vector.VectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make(ENV_ID) for _ in range(N_ENVS)], autoreset_mode=mode
    )


@contextmanager
def wrapped(make: Callable[[], gym.vector.VectorEnv]) -> Iterator[EnvBase]:
    """``GymWrapper(make())``, closed after. The wrapper may sample an action from its
    spec while it builds (a dummy step to learn the info keys' specs), from torch's global
    generator: seeded first, so both sides build alike."""
    torch.manual_seed(SEED)
    vector = make()
    try:
        env = GymWrapper(vector)
    except BaseException:
        vector.close()
        raise
    try:
        yield env
    finally:
        env.close()


def random_policy(env: EnvBase, seed: int) -> Callable[[TensorDictBase], TensorDictBase]:
    """Uniform one-hot actions from a generator of its own (not torch's global one)."""
    generator = torch.Generator().manual_seed(seed)
    n = env.action_spec.shape[-1]

    def policy(td: TensorDictBase) -> TensorDictBase:
        index = torch.randint(n, td.batch_size, generator=generator)
        td.set("action", torch.nn.functional.one_hot(index, n).to(env.action_spec.dtype))
        return td

    return policy


def rollout(env: EnvBase) -> TensorDictBase:
    env.set_seed(SEED)  # a seeded reset: lane i gets SEED + i
    return env.rollout(STEPS, random_policy(env, SEED), break_when_any_done=False)


def assert_same(expected: TensorDictBase, got: TensorDictBase) -> None:
    keys = sorted(expected.keys(include_nested=True, leaves_only=True), key=str)
    assert sorted(got.keys(include_nested=True, leaves_only=True), key=str) == keys
    assert got.batch_size == expected.batch_size
    for key in keys:
        theirs, ours = expected.get(key), got.get(key)
        assert ours.dtype == theirs.dtype, key
        assert torch.equal(ours, theirs), key


@pytest.fixture
def address(servers: ServerPool) -> str:
    return servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS)).address


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_check_env_specs(address: str, mode: AutoresetMode) -> None:
    with wrapped(lambda: VectorEnv(address, autoreset_mode=mode)) as env:
        assert env.batch_size == torch.Size([N_ENVS])
        check_env_specs(env, seed=SEED)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_rollout_equals_sync_vector_env(address: str, mode: AutoresetMode) -> None:
    with wrapped(lambda: local(mode)) as env:
        expected = rollout(env)
    with wrapped(lambda: VectorEnv(address, autoreset_mode=mode)) as env:
        got = rollout(env)
    assert_same(expected, got)
    done = got.get(("next", "done"))
    assert int(done.sum()) >= N_ENVS, "every lane should have ended an episode or more"
    assert bool(done.squeeze(-1).any(dim=-1).all())


def test_partial_reset_with_a_mask_under_disabled(address: str) -> None:
    """DISABLED: TorchRL's own partial reset (a ``_reset`` entry) reaches the client as
    ``reset_mask``: the masked lanes restart, the others keep their state, as locally."""
    mask = torch.tensor([i % 3 == 0 for i in range(N_ENVS)]).unsqueeze(-1)

    def run(env: EnvBase) -> list[TensorDictBase]:
        env.set_seed(SEED)
        td = env.reset()
        policy = random_policy(env, SEED)
        for _ in range(5):
            td = env.step(policy(td)).get("next").clone()
        before = td.clone()
        td.set("_reset", mask)
        after = env.reset(td)
        return [before, after, env.rollout(3, policy, tensordict=after, auto_reset=False)]

    with wrapped(lambda: local(AutoresetMode.DISABLED)) as env:
        expected = run(env)
    with wrapped(lambda: VectorEnv(address, autoreset_mode=AutoresetMode.DISABLED)) as env:
        got = run(env)
    for theirs, ours in zip(expected, got, strict=True):
        assert_same(theirs, ours)
    before, after, _ = got
    kept = ~mask.squeeze(-1)
    assert torch.equal(after["observation"][kept], before["observation"][kept])
    assert not torch.equal(after["observation"][~kept], before["observation"][~kept])


def test_next_step_is_refused_by_torchrl(address: str) -> None:
    """TorchRL refuses gymnasium's default mode itself, for our client as for local envs."""
    for make in (lambda: local(AutoresetMode.NEXT_STEP), lambda: VectorEnv(address)):
        vector: Any = make()
        try:
            with pytest.raises(RuntimeError, match="SAME_STEP or DISABLED"):
                GymWrapper(vector)
        finally:
            vector.close()


DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def documented_block() -> str:
    """The Python block of docs/trainers.md's TorchRL section."""
    section = DOCS.read_text().split("\n## TorchRL", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_documented_block_runs(address: str) -> None:
    block = documented_block()
    assert '"tcp://127.0.0.1:50051"' in block
    block = block.replace('"tcp://127.0.0.1:50051"', repr(address))
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), namespace)
    assert "rollout" in namespace


def test_gym_env_by_id_with_num_envs_over_endpoints_equals_local(
    servers: ServerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GymEnv(env_id, num_envs=4)``: TorchRL makes one env for its specs, then four in
    ``AsyncVectorEnv`` workers, each ``gym.make(env_id)``. By our id, the address only in
    ``RLMESH_TRIO_ADDRESS``, against ``rlmesh-trio serve --endpoints 4`` (the first env
    takes no endpoint: it only reads the spaces): the same rollout as local envs."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, endpoints=4))
    monkeypatch.setenv("RLMESH_TRIO_ADDRESS", ",".join(server.addresses))

    def run(env_id: str) -> TensorDictBase:
        torch.manual_seed(SEED)
        env = GymEnv(env_id, num_envs=4)
        try:
            assert env.batch_size == torch.Size([4])
            return rollout(env)
        finally:
            env.close()

    expected = timed("TorchRL", f"GymEnv(num_envs=4) {ENV_ID}", lambda: run(ENV_ID))
    got = timed(
        "TorchRL",
        "GymEnv(num_envs=4) by id, 4 endpoints",
        lambda: run("rlmesh_trio:rlmesh_trio/Remote-v0"),
    )
    assert_same(expected, got)
    assert int(got.get(("next", "done")).sum()) >= 4
