"""A CleanRL-style PPO in one file, over any ``gymnasium.vector.VectorEnv`` with discrete
actions and a flat Box observation: gymnasium's ``SyncVectorEnv`` or
``rlmesh_trio.client.VectorEnv`` over served envs, unchanged.

The loop is CleanRL's: collect ``num_steps`` steps of every env, compute GAE advantages,
then ``update_epochs`` passes of clipped-surrogate minibatch updates. It reads the step
after an episode's end as the next episode's first observation, which is gymnasium's
``SAME_STEP`` autoreset (the finished env is reset inside ``step``): with ``NEXT_STEP``
(gymnasium 1.x's default) the step after a done would be a reset step whose action is
ignored and whose reward is 0, and the loop would learn from it as if it were real. So
``train`` refuses any other mode. The defaults are rl-zoo's CartPole-v1 PPO
hyperparameters (8 envs, 32 steps, 20 epochs, gamma 0.98, GAE lambda 0.8, lr 1e-3
annealed to 0) on a CleanRL actor-critic (two 64-unit tanh MLPs, orthogonal init).

Run locally: ``python examples/cleanrl_ppo.py``; over served envs: start
``rlmesh-trio serve --env CartPole-v1 --num-envs 8`` and run
``python examples/cleanrl_ppo.py --address tcp://127.0.0.1:50051``.

By id, as CleanRL's own ``ppo.py`` builds its envs (a ``SyncVectorEnv`` of
``gym.make(env_id)`` thunks, each in ``RecordEpisodeStatistics``), with nothing of
rlmesh-trio in the script: ``python examples/cleanrl_ppo.py --env-id CartPole-v1``
locally; over served envs start ``rlmesh-trio serve --env CartPole-v1 --endpoints 8``,
set ``RLMESH_TRIO_ADDRESS`` to the line it prints, and run ``python
examples/cleanrl_ppo.py --env-id rlmesh_trio:rlmesh_trio/Remote-v0``.
``--metrics-file`` writes what CleanRL sends to TensorBoard (the losses of every
update, the episode statistics) as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from torch import nn
from torch.distributions import Categorical


@dataclass(frozen=True)
class Config:
    seed: int = 0
    total_timesteps: int = 100_000
    num_steps: int = 32
    """Steps of every env per rollout."""
    learning_rate: float = 1e-3
    anneal_lr: bool = True
    gamma: float = 0.98
    gae_lambda: float = 0.8
    num_minibatches: int = 1
    update_epochs: int = 20
    clip_coef: float = 0.2
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5


def layer(inputs: int, outputs: int, std: float = float(np.sqrt(2))) -> nn.Linear:
    """A linear layer with CleanRL's initialisation: orthogonal weights, zero bias."""
    linear = nn.Linear(inputs, outputs)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.constant_(linear.bias, 0.0)
    return linear


class Agent(nn.Module):
    """Separate actor and critic MLPs."""

    def __init__(self, observations: int, actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer(observations, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, std=1.0)
        )
        self.actor = nn.Sequential(
            layer(observations, 64),
            nn.Tanh(),
            layer(64, 64),
            nn.Tanh(),
            layer(64, actions, std=0.01),
        )

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def act(
        self, obs: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """An action (sampled unless given), its log-probability, the entropy, the value."""
        dist = Categorical(logits=self.actor(obs))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.value(obs)


@dataclass
class Result:
    agent: Agent
    episodes: list[tuple[int, int, float]] = field(default_factory=list)
    """Every finished episode in the order seen: (global step, env index, return)."""
    statistics: list[tuple[int, int, float, int]] = field(default_factory=list)
    """What ``RecordEpisodeStatistics`` on an env reported (the envs made by
    :func:`make_env`): (global step, env index, return, length)."""
    losses: list[dict[str, float]] = field(default_factory=list)
    """Each update's last minibatch, as CleanRL logs it: ``policy_loss``,
    ``value_loss``, ``entropy``, ``approx_kl``, ``clipfrac``, and the learning rate."""
    seconds: float = 0.0


def train(envs: gym.vector.VectorEnv, config: Config | None = None) -> Result:
    """Train a PPO agent on ``envs`` (SAME_STEP autoreset) and return it with the
    episode returns seen on the way."""
    config = config or Config()
    mode = envs.metadata.get("autoreset_mode")
    if mode != AutoresetMode.SAME_STEP:
        raise ValueError(f"this loop needs SAME_STEP autoreset, the envs do {mode}")
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    n, steps = envs.num_envs, config.num_steps
    obs_shape = envs.single_observation_space.shape
    assert obs_shape is not None and isinstance(envs.single_action_space, gym.spaces.Discrete)
    agent = Agent(int(np.prod(obs_shape)), int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=config.learning_rate, eps=1e-5)

    obs = torch.zeros((steps, n, *obs_shape))
    actions = torch.zeros((steps, n), dtype=torch.long)
    logprobs = torch.zeros((steps, n))
    rewards = torch.zeros((steps, n))
    dones = torch.zeros((steps, n))
    values = torch.zeros((steps, n))

    result = Result(agent)
    started = time.perf_counter()
    global_step = 0
    running_return = np.zeros(n)
    first, _ = envs.reset(seed=config.seed)
    next_obs = torch.as_tensor(first, dtype=torch.float32)
    next_done = torch.zeros(n)
    updates = config.total_timesteps // (steps * n)
    for update in range(updates):
        if config.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - update / updates) * config.learning_rate

        for t in range(steps):  # the rollout
            global_step += n
            obs[t], dones[t] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.act(next_obs)
            actions[t], logprobs[t], values[t] = action, logprob, value
            observation, reward, terminated, truncated, infos = envs.step(action.numpy())
            done = np.logical_or(terminated, truncated)
            result.statistics.extend(episode_statistics(global_step, infos))
            rewards[t] = torch.as_tensor(reward, dtype=torch.float32)
            running_return += reward
            for i in np.flatnonzero(done):
                result.episodes.append((global_step, int(i), float(running_return[i])))
                running_return[i] = 0.0
            next_obs = torch.as_tensor(observation, dtype=torch.float32)
            next_done = torch.as_tensor(done, dtype=torch.float32)

        with torch.no_grad():  # GAE, bootstrapped from the value of the next observation
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(n)
            next_value = agent.value(next_obs)
            for t in reversed(range(steps)):
                if t == steps - 1:
                    alive, following = 1.0 - next_done, next_value
                else:
                    alive, following = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + config.gamma * following * alive - values[t]
                last = delta + config.gamma * config.gae_lambda * alive * last
                advantages[t] = last
            returns = advantages + values

        b_obs = obs.reshape((-1, *obs_shape))
        b_actions, b_logprobs = actions.reshape(-1), logprobs.reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        batch = steps * n
        minibatch = batch // config.num_minibatches
        order = np.arange(batch)
        logged: dict[str, float] = {}
        for _epoch in range(config.update_epochs):
            np.random.shuffle(order)
            for start in range(0, batch, minibatch):
                idx = torch.as_tensor(order[start : start + minibatch])
                _, logprob, entropy, value = agent.act(b_obs[idx], b_actions[idx])
                log_ratio = logprob - b_logprobs[idx]
                ratio = log_ratio.exp()
                adv = b_advantages[idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                clipped = torch.clamp(ratio, 1 - config.clip_coef, 1 + config.clip_coef)
                policy_loss = torch.max(-adv * ratio, -adv * clipped).mean()
                value_loss = 0.5 * ((value - b_returns[idx]) ** 2).mean()
                loss = policy_loss - config.ent_coef * entropy.mean() + config.vf_coef * value_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), config.max_grad_norm)
                optimizer.step()
                with torch.no_grad():
                    logged = {
                        "learning_rate": float(optimizer.param_groups[0]["lr"]),
                        "policy_loss": float(policy_loss),
                        "value_loss": float(value_loss),
                        "entropy": float(entropy.mean()),
                        "approx_kl": float(((ratio - 1) - log_ratio).mean()),
                        "clipfrac": float(((ratio - 1.0).abs() > config.clip_coef).float().mean()),
                    }
        result.losses.append(logged)
    result.seconds = time.perf_counter() - started
    return result


def episode_statistics(
    global_step: int, infos: dict[str, Any]
) -> list[tuple[int, int, float, int]]:
    """The episodes ``RecordEpisodeStatistics`` closed at this step (SAME_STEP: in the
    finished envs' ``final_info``): (global step, env index, return, length)."""
    final = infos.get("final_info", {})
    episode = final.get("episode")
    if episode is None:
        return []
    mask = final["_episode"]
    return [
        (global_step, int(i), float(episode["r"][i]), int(episode["l"][i]))
        for i in np.flatnonzero(mask)
    ]


def make_env(env_id: str, idx: int) -> Callable[[], gym.Env[Any, Any]]:
    """CleanRL's env thunk: ``gym.make(env_id)`` in ``RecordEpisodeStatistics``."""

    def thunk() -> gym.Env[Any, Any]:
        env = gym.make(env_id)
        return gym.wrappers.RecordEpisodeStatistics(env)

    return thunk


def make_envs(address: str | None, num_envs: int = 8) -> gym.vector.VectorEnv:
    """Served envs at ``address`` (a lane endpoint), else ``num_envs`` local CartPoles;
    SAME_STEP autoreset either way."""
    if address is not None:
        from rlmesh_trio.client import VectorEnv

        return VectorEnv(address, autoreset_mode=AutoresetMode.SAME_STEP)
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(num_envs)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--address", help="a lane endpoint (default: 8 local CartPoles)")
    source.add_argument("--env-id", help="build the envs by id, as CleanRL's ppo.py does")
    parser.add_argument("--num-envs", type=int, default=8, help="envs (with --env-id)")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--total-timesteps", type=int, default=Config.total_timesteps)
    parser.add_argument("--metrics-file", help="write the losses and episodes here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.env_id is not None:
        envs = gym.vector.SyncVectorEnv(
            [make_env(args.env_id, i) for i in range(args.num_envs)],
            autoreset_mode=AutoresetMode.SAME_STEP,
        )
    else:
        envs = make_envs(args.address)
    try:
        result = train(envs, Config(seed=args.seed, total_timesteps=args.total_timesteps))
    finally:
        envs.close()
    if args.metrics_file:
        with open(args.metrics_file, "w") as out:
            json.dump(
                {
                    "losses": result.losses,
                    "episodes": result.episodes,
                    "statistics": result.statistics,
                },
                out,
            )
    last = [r for _, _, r in result.episodes[-100:]]
    print(
        f"{len(result.episodes)} episodes in {result.seconds:.1f} s; "
        f"mean return of the last {len(last)}: {np.mean(last) if last else float('nan'):.1f}"
    )


if __name__ == "__main__":
    main()
