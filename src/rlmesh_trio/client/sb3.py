"""Stable-Baselines3's ``VecEnv`` over an endpoint: :class:`RemoteVecEnv` (the ``sb3`` extra).

SB3 drives its environments through its own ``VecEnv`` API, not gymnasium's vector API:
``reset()`` returns the observations only (the infos land in ``reset_infos``), seeds and
options set with ``seed()`` / ``set_options()`` are used at the next ``reset()``, and a
finished env is reset in the same step, its last observation in
``info["terminal_observation"]`` and ``info["TimeLimit.truncated"]`` set on every step.
:class:`RemoteVecEnv` does exactly what SB3's ``DummyVecEnv`` does over local envs, with
the lanes of a lane endpoint as its envs::

    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor
    from rlmesh_trio.client.sb3 import RemoteVecEnv

    env = VecMonitor(RemoteVecEnv("tcp://127.0.0.1:50051"))
    PPO("MlpPolicy", env, seed=0).learn(100_000)

This module imports Stable-Baselines3 (and so torch); ``rlmesh_trio`` and
``rlmesh_trio.client`` never import it. docs/trainers.md has the whole story.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

try:
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
    from stable_baselines3.common.vec_env.util import dict_to_obs, obs_space_info
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "rlmesh_trio.client.sb3 needs Stable-Baselines3: the sb3 extra (pip install "
        "'.[sb3]' from a clone, or the wheel's [sb3])"
    ) from exc

from .._errors import RlmeshTrioError
from .._tls import TlsSetting
from ._answers import crashed, per_lane_reset, per_lane_step
from ._autoreset import (
    LaneReset,
    LaneStep,
    fold_terminal,
    plan_step,
    same_step_resets,
)
from ._blocking import BlockingEndpoint
from ._codecs import decode_frame
from ._contract import Contract
from ._errors import LANE_FAULT_KEY, EndpointError, EnvError, ErrorCode
from ._joining import count_of, lane_endpoint, open_endpoints, same_contract
from ._messages import Episode, Reply, render_builder
from ._rounds import Request, Rounds, raise_fatal, run_shares
from ._settings import (
    DEFAULT_CLOSE_TIMEOUT_SECONDS,
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_PING_INTERVAL_SECONDS,
    DEFAULT_PING_TIMEOUT_SECONDS,
    ConnectionSettings,
    request_timeout_ms,
)

__all__ = ["RemoteAttributeError", "RemoteVecEnv"]

LANE_ATTRIBUTES = ("action_space", "metadata", "observation_space", "render_mode")
"""What :meth:`RemoteVecEnv.get_attr` answers: what the endpoint's contract says of
every lane's env."""

T = TypeVar("T")


class RemoteAttributeError(RlmeshTrioError, NotImplementedError, AttributeError):
    """An env attribute or method that :class:`RemoteVecEnv` cannot reach: the env lives
    on the server, and rlmesh-wire-v1 carries its spaces, render mode and metadata, its
    reset, step and render, nothing else. A ``NotImplementedError`` naming the attribute;
    an ``AttributeError`` too, so that SB3's ``has_attr`` answers False."""


class _Share:
    """One endpoint's lanes of a :class:`RemoteVecEnv` (``offset``: its first lane's
    index there): the connection, and the rounds of requests its lanes' share of a reset
    or a step takes. Lanes here are the endpoint's own (0..num_envs-1)."""

    def __init__(
        self, address: str, ep: BlockingEndpoint, offset: int, timeout_ms: int, last_obs: list[Any]
    ) -> None:
        contract = lane_endpoint(address, ep, "RemoteVecEnv")
        self.address = address
        self.ep = ep
        self.contract = contract
        self.codecs = ep.state.codecs
        self.offset = offset
        self.num_envs = contract.num_envs
        self.timeout_ms = timeout_ms
        self._last_obs = last_obs
        """The vector's last observation of every lane (the RemoteVecEnv's list)."""
        self.unreset = np.zeros((self.num_envs,), dtype=np.bool_)
        """Lanes whose reset after a finished episode failed (a lane fault): reset in
        place of their next step."""
        self.unrenderable: set[int] = set()
        """Lanes the server refused to render (it renders lane 0 only)."""

    @property
    def name(self) -> str:
        last = self.offset + self.num_envs - 1
        lanes = f"env {last}" if last == self.offset else f"envs {self.offset}..{last}"
        return f"the endpoint at {self.address} ({lanes} of the VecEnv)"

    def last_obs(self, lane: int) -> Any:
        return copy.deepcopy(self._last_obs[self.offset + lane])  # SB3 keeps what it is given

    def reset(
        self, seeds: list[int | None], options: list[dict[str, Any]]
    ) -> Rounds[dict[int, LaneReset]]:
        """Reset every lane with ``seeds`` and ``options`` (one each); each lane's
        observation and info."""
        n = self.num_envs
        seeded = [s is not None for s in seeds]
        alike = all(not o for o in options) or all(o is options[0] for o in options)
        if (all(seeded) or not any(seeded)) and alike:
            groups = [list(range(n))]  # one whole-vector reset
        else:
            groups = [[i] for i in range(n)]  # each lane its own, sent together
        request = Request()
        for group in groups:
            request.reset(
                group,
                self.timeout_ms,
                whole=len(group) == n,
                seeds=[int(s) for s in (seeds[i] for i in group) if s is not None],
                options=options[group[0]] or None,
            )
        answers = yield request
        out: dict[int, LaneReset] = {}
        for group, answer in zip(groups, answers, strict=True):
            if isinstance(answer, EndpointError):
                raise answer
            out.update(per_lane_reset(self.codecs, group, answer))
        self.unreset[:] = False
        return out

    def step(self, actions: Any) -> Rounds[tuple[dict[int, LaneStep], dict[int, LaneReset]]]:
        """Step every lane with ``actions`` (this endpoint's rows) and reset the lanes
        whose episode ended in the same step, as SAME_STEP does (one round trip, two when
        a lane ended): each lane's result, and the first observation and info of the
        lanes reset. A lane whose reset failed last time is reset in place of its step,
        as NEXT_STEP resets a finished lane (:func:`._autoreset.plan_step`)."""
        plan = plan_step(AutoresetMode.NEXT_STEP, self.unreset)
        stepping, unreset = plan.step_lanes, plan.reset_lanes
        request = Request()
        if stepping:
            leaves = self._encode_actions(actions, stepping)
            request.step(leaves, stepping, self.timeout_ms, whole=len(stepping) == self.num_envs)
        for lane in unreset:
            self._autoreset_request(request, lane)
        answers = yield request
        raise_fatal(answers)
        results: dict[int, LaneStep] = {}
        fresh: dict[int, LaneReset] = {}
        if stepping:
            results.update(self._stepped(stepping, answers[0]))
        if unreset:
            # Lanes whose reset failed at the last step: that episode (one observation
            # long) ends here too, and the reset is tried again.
            for lane in unreset:
                results[lane] = (self.last_obs(lane), 0.0, False, True, {})
            fresh.update(self._autoreset(unreset, answers[len(answers) - len(unreset) :], results))
        done = same_step_resets(AutoresetMode.SAME_STEP, plan, results)
        if done:
            # One lane-scoped reset per finished lane, sent together: a lane that cannot
            # be reset holds up no other.
            request = Request()
            for lane in done:
                self._autoreset_request(request, lane)
            answers = yield request
            raise_fatal(answers)
            fresh.update(self._autoreset(done, answers, results))
        return results, fresh

    # ---- the wire ------------------------------------------------------------------

    def _encode_actions(self, actions: Any, lanes: list[int]) -> list[bytes]:
        if isinstance(actions, np.ndarray) and actions.shape[:1] == (self.num_envs,):
            subset = actions if len(lanes) == self.num_envs else actions[lanes]
            return self.codecs.encode_actions(subset, len(lanes))
        return self.codecs.encode_actions_rows([actions[i] for i in lanes])

    def _stepped(self, lanes: list[int], answer: Reply | EndpointError) -> dict[int, LaneStep]:
        """Each lane's result of a step of ``lanes``; a step answered CRASHED (a lane
        fault under rebuild): every lane truncated on its last observation, reward 0."""
        if isinstance(answer, EnvError):
            return crashed(self.last_obs, lanes, answer)
        assert isinstance(answer, Reply)
        return per_lane_step(self.codecs, lanes, answer)

    def _autoreset_request(self, request: Request, lane: int) -> None:
        """The unseeded reset of one finished lane (SB3 seeds only at ``reset()``)."""
        request.reset([lane], self.timeout_ms, whole=self.num_envs == 1)

    def _autoreset(
        self,
        lanes: list[int],
        answers: Sequence[Reply | EndpointError],
        results: dict[int, LaneStep],
    ) -> dict[int, LaneReset]:
        """The resets of finished ``lanes``, one answer each: the first observations and
        infos of those reset; a lane whose reset failed (a lane fault) is kept for the
        next step's, its fault in its info."""
        fresh: dict[int, LaneReset] = {}
        for lane, answer in zip(lanes, answers, strict=True):
            if isinstance(answer, Reply):
                self.unreset[lane] = False
                fresh.update(per_lane_reset(self.codecs, [lane], answer))
                continue
            self.unreset[lane] = True
            assert isinstance(answer, EnvError)
            for fault in answer.lane_faults:
                if fault["lane"] == lane:
                    results[lane][4].setdefault(LANE_FAULT_KEY, fault)
        return fresh

    def frames(self, lanes: list[int]) -> list[np.ndarray[Any, Any] | None]:
        """The lanes' frames, one render request each, sent together; None for a lane
        the server cannot render (a recoverable refusal, remembered: not asked again)."""
        asked = [lane for lane in lanes if lane not in self.unrenderable]
        answers = self.ep.roundtrip_each(
            [partial(render_builder, lane=lane) for lane in asked],
            ["render"] * len(asked),
            lanes=[[lane] for lane in asked],
        )
        frames: dict[int, np.ndarray[Any, Any] | None] = {}
        for lane, answer in zip(asked, answers, strict=True):
            if isinstance(answer, EndpointError):
                if not answer.is_recoverable:
                    raise answer
                if answer.code == ErrorCode.INVALID_ACTION:
                    self.unrenderable.add(lane)  # "single-env render only supports 0"
                frames[lane] = None
            else:
                frames[lane] = decode_frame(answer)
        return [frames.get(lane) for lane in lanes]

    def close(self) -> list[Episode]:
        """Close the session; the episodes it reported, their lanes the VecEnv's."""
        return [
            replace(episode, env_index=episode.env_index + self.offset)
            for episode in self.ep.close()
        ]


class RemoteVecEnv(VecEnv):
    """A Stable-Baselines3 ``VecEnv`` whose envs are the lanes of a lane endpoint (what
    ``rlmesh-trio serve --num-envs N`` and ``rlmesh.EnvServer([env, ...])`` serve).

    It behaves as SB3's ``DummyVecEnv`` over the same envs, step for step: ``seed(s)``
    seeds lane ``i`` with ``s + i`` at the next :meth:`reset` (``set_options`` likewise),
    :meth:`reset` returns the observations and sets ``reset_infos``, and a lane whose
    episode ends is reset in the same :meth:`step_wait` (unseeded), with
    ``info["terminal_observation"]``; ``info["TimeLimit.truncated"]`` is set on every
    step. Rewards are float32, dones bool, infos the lanes' own (as the wire carries
    them: a numpy array in an env's info arrives as a list).

    **Lane faults** (a server under ``--on-lane-fault rebuild|truncate``) end episodes as
    truncations, which SB3 bootstraps from ``terminal_observation``: the lane's step
    reads reward 0, done, ``TimeLimit.truncated`` True, its last observation as the
    terminal one, and ``info["rlmesh_trio.lane_fault"]`` names the fault; the lane is
    reset in the same step. Under ``rebuild`` a faulted whole-vector step drops every
    lane's result, so every lane ends its episode so; under ``truncate`` only the
    faulted lane does. If that reset fails too, the lane keeps its last observation and
    the next step reports it done again (reward 0) and tries the reset again.

    :meth:`get_attr` answers ``observation_space``, ``action_space``, ``render_mode``
    and ``metadata`` from the endpoint's contract; :meth:`env_method` answers ``render``
    and ``get_wrapper_attr``; anything else, and every :meth:`set_attr`, raises
    :class:`RemoteAttributeError` naming it. :meth:`env_is_wrapped` is False for every
    lane (the client cannot see the server's wrappers; wrap this VecEnv with SB3's
    ``VecMonitor`` for episode statistics). :meth:`close` sends Close; what the server
    reported then is in ``final_episodes``.

    ``address`` as :class:`rlmesh_trio.client.VectorEnv` takes it: one address, a list
    (or a comma-separated string) of endpoints whose lanes are this VecEnv's envs in list
    order, gathered whole up to ``num_envs`` (None: every endpoint of the list), or None
    for ``RLMESH_TRIO_ADDRESS``; several endpoints step at once, and one lost is raised
    naming it (the others closed). Other keywords as ``VectorEnv`` takes them: ``auth_token``,
    ``tls``, ``request_timeout_seconds`` (the wire's ``timeout_ms`` on every reset and
    step), ``connect_timeout_seconds``, ``ping_interval_seconds``,
    ``ping_timeout_seconds``, ``close_timeout_seconds``.
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        num_envs: int | None = None,
        auth_token: str | None = None,
        tls: TlsSetting = None,
        request_timeout_seconds: float | None = None,
        connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
        ping_interval_seconds: float = DEFAULT_PING_INTERVAL_SECONDS,
        ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS,
        close_timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS,
    ) -> None:
        timeout_ms = request_timeout_ms(request_timeout_seconds)
        want = count_of(num_envs)
        settings = ConnectionSettings(
            auth_token=auth_token,
            tls=tls,
            connect_timeout_seconds=connect_timeout_seconds,
            ping_interval_seconds=ping_interval_seconds,
            ping_timeout_seconds=ping_timeout_seconds,
            close_timeout_seconds=close_timeout_seconds,
        )
        joined = open_endpoints(address, want, settings)
        self._shares: list[_Share] = []
        try:
            self._last_obs: list[Any] = []
            offset = 0
            for each, ep in joined:
                share = _Share(each, ep, offset, timeout_ms, self._last_obs)
                self._shares.append(share)
                offset += share.num_envs
            first = self._shares[0]
            contract = first.contract
            for share in self._shares[1:]:
                same_contract(first.contract, first.address, share.contract, share.address)
            if want is not None and want != offset:
                raise ValueError(
                    f"num_envs={want}, but the endpoint at {first.address} serves "
                    f"{offset} lanes: a RemoteVecEnv drives all of an endpoint's lanes"
                )
            self.contract: Contract = contract
            """What the endpoints serve (env id, spaces, lanes of the first, ...)."""
            self.addresses = [share.address for share in self._shares]
            """The endpoints this VecEnv joined, in the order of its envs."""
            self.final_episodes: list[Episode] = []
            """What the servers reported at :meth:`close` (episodes still running then)."""
            n = offset
            self._last_obs.extend([None] * n)
            super().__init__(n, contract.observation_space, contract.action_space)
            self.metadata = copy.deepcopy(contract.metadata)  # the env's, as DummyVecEnv
            self._keys, shapes, dtypes = obs_space_info(self.observation_space)
            self._buf_obs = OrderedDict(
                (key, np.zeros((n, *tuple(shapes[key])), dtype=dtypes[key])) for key in self._keys
            )
            self._buf_dones = np.zeros((n,), dtype=bool)
            self._buf_rews = np.zeros((n,), dtype=np.float32)
            self._started = False
            self._actions: Any = None
            self._tiling = False
        except BaseException:
            for _, ep in joined:
                ep.close()
            raise

    # ---- SB3's VecEnv API ----------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every lane, with the seeds of :meth:`seed` (``seed + i``) and the options
        of :meth:`set_options` if set (both used once); the infos go to ``reset_infos``."""
        seeds, options = list(self._seeds), list(self._options)
        outcomes = self._run(
            [
                share.reset(
                    seeds[share.offset : share.offset + share.num_envs],
                    options[share.offset : share.offset + share.num_envs],
                )
                for share in self._shares
            ]
        )
        for share, out in zip(self._shares, outcomes, strict=True):
            for lane, (obs, info) in out.items():
                self.reset_infos[share.offset + lane] = info
                self._save_obs(share.offset + lane, obs)
        self._started = True
        self._reset_seeds()
        self._reset_options()
        return self._obs_from_buf()

    def step_async(self, actions: np.ndarray[Any, Any]) -> None:
        """Take the lanes' actions (batched, leading dimension ``num_envs``); the step
        itself is done by :meth:`step_wait`."""
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        """Step every lane with the actions of :meth:`step_async`, and reset the lanes
        whose episode ended, in the same call (one round trip, two when a lane ended)."""
        if not self._started:
            raise gym.error.ResetNeeded(
                "Cannot call RemoteVecEnv.step_wait() before calling reset()"
            )
        actions, self._actions = self._actions, None
        if actions is None:
            raise ValueError("step_wait() without step_async(actions)")
        outcomes = self._run(
            [
                share.step(actions[share.offset : share.offset + share.num_envs])
                for share in self._shares
            ]
        )
        results: dict[int, LaneStep] = {}
        fresh: dict[int, LaneReset] = {}
        for share, (stepped, reset) in zip(self._shares, outcomes, strict=True):
            results.update((share.offset + lane, r) for lane, r in stepped.items())
            fresh.update((share.offset + lane, r) for lane, r in reset.items())
        infos = fold_terminal(
            results, fresh, self._buf_rews, self._buf_dones, self.reset_infos, self._save_obs
        )
        # The infos are this step's own objects, kept by nobody else (DummyVecEnv hands out
        # deep copies of the buffers it keeps).
        return self._obs_from_buf(), np.copy(self._buf_rews), np.copy(self._buf_dones), infos

    def close(self) -> None:
        """Send Close and drop the connections (again: nothing)."""
        episodes: list[Episode] = []
        for share in getattr(self, "_shares", ()):
            episodes.extend(share.close())
        self.final_episodes = episodes

    def _run(self, rounds: list[Rounds[T]]) -> list[T]:
        """Every endpoint's share of a reset or step, all at once (:func:`._rounds.run_shares`:
        an endpoint's failure raised naming it, a fatal one closing the others)."""
        return run_shares(self._shares, rounds, self.close)

    def _frames(self, lanes: list[int]) -> list[np.ndarray[Any, Any] | None]:
        """The lanes' frames (None for a lane the server cannot render)."""
        frames: dict[int, np.ndarray[Any, Any] | None] = {}
        for share in self._shares:
            mine = [
                lane - share.offset
                for lane in lanes
                if share.offset <= lane < share.offset + share.num_envs
            ]
            if mine:
                for lane, frame in zip(mine, share.frames(mine), strict=True):
                    frames[share.offset + lane] = frame
        return [frames.get(lane) for lane in lanes]

    def get_images(self) -> Sequence[np.ndarray[Any, Any] | None]:
        """Each lane's frame (``render_mode`` ``rgb_array``); None for a lane the server
        cannot render (both rlmesh-trio and rlmesh 0.1.0 render lane 0 of a vector only).
        """
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is "
                "`rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None for _ in range(self.num_envs)]
        frames = self._frames(list(range(self.num_envs)))
        if self._tiling:
            # SB3's render() tiles every lane's frame: a lane without one is black.
            shape = next((f.shape for f in frames if f is not None), None)
            if shape is not None:
                return [np.zeros(shape, np.uint8) if f is None else f for f in frames]
        return frames

    def render(self, mode: str | None = None) -> np.ndarray[Any, Any] | None:
        """SB3's ``VecEnv.render``: the lanes' frames tiled in one image (``rgb_array``),
        a lane the server cannot render black."""
        self._tiling = True
        try:
            image: np.ndarray[Any, Any] | None = super().render(mode)
            return image
        finally:
            self._tiling = False

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The lanes' ``observation_space``, ``action_space``, ``render_mode`` or
        ``metadata`` (from the contract); any other name raises
        :class:`RemoteAttributeError`."""
        lanes = list(self._get_indices(indices))
        if attr_name not in LANE_ATTRIBUTES:
            hint = (
                " (a VecEnv's own attribute: read RemoteVecEnv.num_envs)"
                if attr_name == "num_envs"
                else ""
            )
            raise RemoteAttributeError(
                f"get_attr({attr_name!r}): the env runs on the server, and the wire carries "
                f"only {', '.join(LANE_ATTRIBUTES)} of it{hint}"
            )
        value = getattr(self.contract, attr_name)
        return [copy.deepcopy(value) for _ in lanes]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Always :class:`RemoteAttributeError`: nothing of a served env can be set over
        the wire."""
        raise RemoteAttributeError(
            f"set_attr({attr_name!r}): the env runs on the server, and the wire cannot set "
            "its attributes"
        )

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """``render`` (each addressed lane's frame) and ``get_wrapper_attr(name)`` (as
        :meth:`get_attr`); any other method raises :class:`RemoteAttributeError`."""
        lanes = list(self._get_indices(indices))
        if method_name == "render" and not method_args and not method_kwargs:
            return list(self._frames(lanes))
        if method_name == "get_wrapper_attr" and len(method_args) == 1 and not method_kwargs:
            return self.get_attr(str(method_args[0]), lanes)
        raise RemoteAttributeError(
            f"env_method({method_name!r}): the env runs on the server, and the wire calls "
            "only its reset, step and render (env_method('render'))"
        )

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """False for every lane: the client cannot see the server's wrappers."""
        return [False for _ in self._get_indices(indices)]

    # ---- observations as DummyVecEnv keeps them ----------------------------------------

    def _save_obs(self, lane: int, obs: Any) -> None:
        self._last_obs[lane] = obs
        for key in self._keys:
            if key is None:
                self._buf_obs[key][lane] = obs
            else:
                self._buf_obs[key][lane] = obs[key]

    def _obs_from_buf(self) -> VecEnvObs:
        return dict_to_obs(
            self.observation_space, OrderedDict((key, a.copy()) for key, a in self._buf_obs.items())
        )
