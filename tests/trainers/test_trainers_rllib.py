"""RLlib mounts the served envs with no glue (issue 30): PPO (the new API stack) on
``config.environment("rlmesh_trio/Remote-v0", env_config={"address": ...})`` with
``gym_env_vectorize_mode="vector_entry_point"`` builds ``rlmesh_trio.client.VectorEnv``
through ``gymnasium.make_vec`` (RLlib passes ``env_config`` as its keywords and
``num_envs_per_env_runner`` as ``num_envs``), trains, and learns exactly what it learns on
the same config over local envs (``"CartPole-v1"``, ``gym_env_vectorize_mode="sync"``):
the same episode returns and losses per iteration, equal final weights."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.refserver import ServerConfig, ServerPool
from timings import timed

# Before Ray is imported: it reads them at import.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

pytest.importorskip("torch")
pytest.importorskip("ray.rllib")

import ray
from gymnasium.vector import AutoresetMode
from ray.rllib.algorithms.ppo import PPOConfig

from rlmesh_trio.client import EndpointsUnavailableError, VectorEnv
from rlmesh_trio.client._gather import ADDRESS_VARIABLE

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(300)]

ENV_ID = "CartPole-v1"
N_ENVS = 8
SEED = 0
ITERATIONS = 4


RUNNER_LANES = 4
"""Lanes of each endpoint (and envs of each env runner) in the several-runner runs."""


@pytest.fixture(scope="module")
def two_endpoints(servers: ServerPool) -> Iterator[list[str]]:
    """``rlmesh-trio serve --env CartPole-v1 --num-envs 4 --endpoints 2``, its addresses
    in ``RLMESH_TRIO_ADDRESS`` before Ray starts (its workers inherit the variable)."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=RUNNER_LANES, endpoints=2))
    before = os.environ.get(ADDRESS_VARIABLE)
    os.environ[ADDRESS_VARIABLE] = ",".join(server.addresses)
    try:
        yield server.addresses
    finally:
        if before is None:
            del os.environ[ADDRESS_VARIABLE]
        else:
            os.environ[ADDRESS_VARIABLE] = before


@pytest.fixture(scope="module", autouse=True)
def local_ray(two_endpoints: list[str]) -> Iterator[None]:
    """A local Ray for the module (RLlib's Algorithm needs one even with no remote env
    runner or learner): loopback only, no dashboard."""
    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    print(f"ray.init: {time.monotonic() - began:.1f} s")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """As the suite's check, but Ray's own driver threads (kept until ``ray.shutdown``)
    are not ours: only the client's threads must be gone."""

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("rlmesh")]

    before = set(ours())
    yield
    deadline = time.monotonic() + 5.0
    while (leaked := [t for t in ours() if t not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"threads leaked by this test: {[t.name for t in leaked]}"


@pytest.fixture
def address(servers: ServerPool) -> str:
    return servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS)).address


@dataclass
class Run:
    iterations: list[dict[str, Any]]
    weights: dict[str, Any]
    env_type: type
    autoreset_mode: Any


def config(env: str, env_config: dict[str, Any], vectorize_mode: str) -> PPOConfig:
    return (
        PPOConfig()
        .environment(env, env_config=env_config)
        .env_runners(
            num_env_runners=0,  # sample in this process
            num_envs_per_env_runner=N_ENVS,  # the endpoint's lanes
            gym_env_vectorize_mode=vectorize_mode,
        )
        .training(train_batch_size_per_learner=1024, minibatch_size=256, num_epochs=4)
        .debugging(seed=SEED)
    )


def train(envs: str, ppo: PPOConfig) -> Run:
    def run() -> Run:
        algo = ppo.build_algo()
        try:
            env = algo.env_runner.env.unwrapped
            results = [algo.train() for _ in range(ITERATIONS)]
            weights = {k: v.clone() for k, v in algo.get_module().state_dict().items()}
            return Run(
                [
                    {
                        "sampled": r["env_runners"]["num_env_steps_sampled"],
                        "episodes": r["env_runners"]["num_episodes"],
                        "return_mean": r["env_runners"]["episode_return_mean"],
                        "total_loss": float(r["learners"]["default_policy"]["total_loss"]),
                        "policy_loss": float(r["learners"]["default_policy"]["policy_loss"]),
                        "vf_loss": float(r["learners"]["default_policy"]["vf_loss"]),
                    }
                    for r in results
                ],
                weights,
                type(env),
                env.metadata.get("autoreset_mode"),
            )
        finally:
            algo.stop()

    return timed("RLlib", envs, run)


def test_rllib_ppo_on_the_registered_id_learns_what_it_learns_on_local_envs(
    servers: ServerPool, deterministic_torch: Any
) -> None:
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    remote = train(
        f"VectorEnv (NEXT_STEP, {N_ENVS} lanes, rlmesh-trio serve)",
        config("rlmesh_trio/Remote-v0", {"address": server.address}, "vector_entry_point"),
    )
    # RLlib's env runner expects gymnasium's default autoreset (NEXT_STEP: the step after
    # an episode's end returns the reset observation, taken as the next episode's start).
    assert remote.env_type is VectorEnv
    assert remote.autoreset_mode == AutoresetMode.NEXT_STEP
    for it in remote.iterations:
        assert it["sampled"] >= 1024, it
        assert it["episodes"] > 0, it
        assert math.isfinite(it["return_mean"]) and it["return_mean"] > 0, it
        assert all(math.isfinite(it[k]) for k in ("total_loss", "policy_loss", "vf_loss")), it
    first, last = remote.iterations[0]["return_mean"], remote.iterations[-1]["return_mean"]
    assert last > first, remote.iterations  # it learns (random CartPole play: ~22)

    local = train(f"SyncVectorEnv ({N_ENVS} x {ENV_ID})", config(ENV_ID, {}, "sync"))
    assert remote.iterations == local.iterations
    assert list(remote.weights) == list(local.weights)
    for name, tensor in local.weights.items():
        assert deterministic_torch.equal(tensor, remote.weights[name]), name
    print(f"RLlib PPO seed {SEED}: {remote.iterations}")


def test_one_remote_env_runner_builds_the_env_in_its_own_process(address: str) -> None:
    """``num_env_runners=1``: the driver's env runner builds no env, the remote one (a Ray
    worker process) builds the ``VectorEnv``, the ``rlmesh_trio:`` prefix importing the
    package there. (Two or more need an endpoint each: the two-runner test below.)"""
    ppo = config(
        "rlmesh_trio:rlmesh_trio/Remote-v0", {"address": address}, "vector_entry_point"
    ).env_runners(num_env_runners=1)
    ppo.training(train_batch_size_per_learner=512, minibatch_size=128, num_epochs=1)
    algo = ppo.build_algo()
    try:
        assert getattr(algo.env_runner, "env", None) is None
        result = algo.train()
        assert result["env_runners"]["num_env_steps_sampled"] >= 512
        assert result["env_runners"]["num_episodes"] > 0
    finally:
        algo.stop()


def test_num_envs_must_be_the_endpoints_lanes(servers: ServerPool) -> None:
    """``num_envs_per_env_runner`` other than the endpoint's lanes: gymnasium's
    ``make_vec`` error, naming both, surfaces from ``build_algo``."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    ppo = config("rlmesh_trio/Remote-v0", {"address": server.address}, "vector_entry_point")
    ppo.env_runners(num_envs_per_env_runner=2)
    with pytest.raises(Exception, match=f"num_envs=2, but the endpoint at .* serves {N_ENVS}"):
        ppo.build_algo()


def runners_config(env: str, vectorize_mode: str, runners: int) -> PPOConfig:
    """PPO with ``runners`` remote env runners of ``RUNNER_LANES`` envs each, the id as
    given and no address anywhere (``RLMESH_TRIO_ADDRESS`` has it)."""
    return (
        PPOConfig()
        .environment(env)
        .env_runners(
            num_env_runners=runners,
            num_envs_per_env_runner=RUNNER_LANES,
            gym_env_vectorize_mode=vectorize_mode,
        )
        .training(train_batch_size_per_learner=512, minibatch_size=128, num_epochs=2)
        .debugging(seed=SEED)
    )


def train_remote_runners(envs: str, ppo: PPOConfig) -> tuple[list[dict[str, Any]], Any]:
    def run() -> tuple[list[dict[str, Any]], Any]:
        algo = ppo.build_algo()
        try:
            assert algo.env_runner_group.num_healthy_remote_workers() == 2
            results = [algo.train() for _ in range(3)]
            weights = {k: v.clone() for k, v in algo.get_module().state_dict().items()}
            return [
                {
                    "sampled": r["env_runners"]["num_env_steps_sampled"],
                    "episodes": r["env_runners"]["num_episodes"],
                    "return_mean": r["env_runners"]["episode_return_mean"],
                    "total_loss": float(r["learners"]["default_policy"]["total_loss"]),
                }
                for r in results
            ], weights
        finally:
            algo.stop()

    return timed("RLlib", envs, run)


def test_two_env_runners_by_id_claim_an_endpoint_each_and_learn_what_local_runners_learn(
    deterministic_torch: Any,
) -> None:
    """Two remote env runners on the registered id, the address only in
    ``RLMESH_TRIO_ADDRESS`` (two endpoints of one ``serve --endpoints 2``): each runner's
    ``make_vec`` gathers an endpoint of its own, and the run equals two local runners'."""
    remote = train_remote_runners(
        "2 env runners by id, 2 endpoints",
        runners_config("rlmesh_trio:rlmesh_trio/Remote-v0", "vector_entry_point", 2),
    )
    local = train_remote_runners(
        f"2 env runners, SyncVectorEnv of {RUNNER_LANES}", runners_config(ENV_ID, "sync", 2)
    )
    assert remote[0] == local[0]
    for name, tensor in local[1].items():
        assert deterministic_torch.equal(tensor, remote[1][name]), name


def test_more_env_runners_than_endpoints_fail_the_run_at_startup() -> None:
    """Three runners, two endpoints: the third runner's env cannot gather its lanes. With
    RLlib's ``restart_failed_env_runners=False`` (docs/trainers.md) ``build_algo``
    raises that error, naming every endpoint, rather than training with two runners."""
    ppo = runners_config("rlmesh_trio:rlmesh_trio/Remote-v0", "vector_entry_point", 3)
    ppo.env_runners(num_cpus_per_env_runner=0)  # three runners on a two-CPU Ray
    ppo.fault_tolerance(restart_failed_env_runners=False)
    with pytest.raises(
        EndpointsUnavailableError, match=f"cannot gather {RUNNER_LANES} lanes"
    ) as caught:
        ppo.build_algo()
    assert "busy: another client holds its Join session" in str(caught.value)
    assert "restart_failed_env_runners=False" in str(caught.value)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def documented_block() -> str:
    """The Python block of docs/trainers.md's RLlib section."""
    section = DOCS.read_text().split("\n## RLlib", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_documented_block_runs(address: str) -> None:
    block = documented_block()
    assert '"tcp://127.0.0.1:50051"' in block
    block = block.replace('"tcp://127.0.0.1:50051"', repr(address))
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), namespace)
    assert namespace["result"]["env_runners"]["num_env_steps_sampled"] > 0
