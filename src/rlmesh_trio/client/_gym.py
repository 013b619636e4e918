"""gymnasium adapters over an endpoint: :class:`VectorEnv` and :class:`Env` (synchronous).

Both run the blocking driver in the caller's thread. :class:`VectorEnv` does gymnasium's
autoreset on the client with lane-scoped resets, following ``SyncVectorEnv`` step by
step (same rewards, flags, ``final_obs`` / ``final_info`` and masks, same seeding
rules), so it works with any lane endpoint — rlmesh-trio's or rlmesh 0.1.0's.

They are the entry points of the gymnasium id ``rlmesh_trio/Remote-v0`` (registered by
``import rlmesh_trio``): ``gymnasium.make`` builds an :class:`Env`, ``gymnasium.make_vec``
a :class:`VectorEnv` (``num_envs=`` checked against the endpoint's lanes).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from .._deprecation import Rename, renamed_kwargs
from .._tls import TlsSetting
from ._answers import StepResult, fold_arrays, per_lane_reset, step_answers
from ._autoreset import (
    LaneReset,
    StepPlan,
    VectorLanes,
    fold_reset,
    fold_step,
    plan_step,
    same_step_resets,
    seeds_of,
    take_reset_mask,
)
from ._blocking import BlockingEndpoint
from ._codecs import (
    ACTION_ERRORS,
    decode_frame,
    invalid_actions,
    step_arrays,
    timeout_of,
    wire_seed,
)
from ._core import JoinStream, check_options
from ._errors import EndpointError, EnvError, lane_crash
from ._messages import Episode, Reply, render_builder, reset_builder, step_builder
from ._pool import Batch, BlockingPool
from ._settings import (
    DEFAULT_CLOSE_TIMEOUT_SECONDS,
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_PING_INTERVAL_SECONDS,
    DEFAULT_PING_TIMEOUT_SECONDS,
    OLD_CONNECTION_KEYWORDS,
    request_timeout_ms,
    seconds_of_ms,
)

__all__ = ["Env", "VectorEnv"]


OLD_ADAPTER_KEYWORDS: dict[str, Rename] = {
    **OLD_CONNECTION_KEYWORDS,
    "request_timeout_ms": ("request_timeout_seconds", seconds_of_ms),
}
"""The adapters' 0.1 keywords (deprecated, removed in 0.2): ``request_timeout_ms`` (int
milliseconds) becomes ``request_timeout_seconds`` (float seconds)."""


def _check_render_mode(address: str, asked: str | None, served: str | None) -> None:
    """``render_mode=`` (what ``gymnasium.make`` passes when asked for one) must be the
    served env's: the server renders, the client only carries its frames."""
    if asked is not None and asked != served:
        raise ValueError(
            f"render_mode={asked!r}, but the env at {address} is served with "
            f"render_mode={served!r}; the server's env decides (serve it with that "
            "render_mode, e.g. rlmesh-trio serve --kwargs-json '{\"render_mode\": ...}')"
        )


def _open(
    address: str,
    auth_token: str | None,
    tls: TlsSetting,
    timeouts: tuple[float, float, float, float],
) -> BlockingEndpoint:
    """The adapters' connection; ``timeouts``: connect, ping interval, ping timeout, close."""
    connect, interval, ping, close = timeouts
    return BlockingEndpoint(
        address,
        auth_token=auth_token,
        tls=tls,
        connect_timeout_seconds=connect,
        ping_interval_seconds=interval,
        ping_timeout_seconds=ping,
        close_timeout_seconds=close,
    )


class VectorEnv(gym.vector.VectorEnv):
    """A ``gymnasium.vector.VectorEnv`` whose sub-envs are the lanes of an endpoint.

    ``autoreset_mode``: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``, with the
    semantics of gymnasium's ``SyncVectorEnv`` (DISABLED: reset finished lanes with
    ``reset(options={"reset_mask": mask})``). The endpoint must be a lane endpoint
    (autoreset DISABLED on the server, the ``subset_step`` capability when it has more
    than one lane). ``request_timeout_seconds`` is sent with every reset and step as
    the wire's ``timeout_ms`` (whole milliseconds, as rlmesh's ``RemoteEnv`` sends it;
    the server answers TIMEOUT past it; None or 0: no deadline). ``auth_token`` is sent
    as ``authorization: Bearer``; ``tls``, ``connect_timeout_seconds``,
    ``ping_interval_seconds``, ``ping_timeout_seconds`` and ``close_timeout_seconds`` as
    :func:`~rlmesh_trio.client.open_endpoint` takes them. Infos are what the wire
    carries (numpy arrays in an env's info arrive as lists).

    The 0.1 keywords ``token``, ``request_timeout_ms`` (int milliseconds),
    ``connect_timeout``, ``ping_interval``, ``ping_timeout`` and ``close_timeout`` still
    work (deprecated, removed in 0.2).

    ``batch_size`` (1..num_envs, default num_envs): how many lanes :meth:`recv` returns
    after :meth:`async_reset` / :meth:`send`, EnvPool's way of stepping the lanes that
    are ready (docs/client.md). With ``batch_size < num_envs``, :meth:`step` is refused
    (it would wait for every lane: that is what the pool avoids); with
    ``batch_size == num_envs`` it works as ever once no lane is in flight.

    ``num_envs`` (what ``gymnasium.make_vec`` passes; default: whatever the endpoint
    serves) must equal the endpoint's lane count, else a ``ValueError`` naming both.
    ``render_mode`` (None: the served env's) must be the served env's. A constructor
    that raises has closed its connection first. :meth:`step` before this client's own
    :meth:`reset` of every lane raises ``gymnasium.error.ResetNeeded`` (nothing sent).
    """

    @renamed_kwargs(**OLD_ADAPTER_KEYWORDS)
    def __init__(
        self,
        address: str,
        *,
        num_envs: int | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        batch_size: int | None = None,
        render_mode: str | None = None,
        auth_token: str | None = None,
        tls: TlsSetting = None,
        request_timeout_seconds: float | None = None,
        connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
        ping_interval_seconds: float = DEFAULT_PING_INTERVAL_SECONDS,
        ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS,
        close_timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS,
    ) -> None:
        mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
        if num_envs is not None and (
            isinstance(num_envs, bool) or not isinstance(num_envs, int | np.integer)
        ):
            raise TypeError(f"num_envs must be an int, not {type(num_envs).__name__}")
        self._timeout_ms = request_timeout_ms(request_timeout_seconds)
        self._ep = _open(
            address,
            auth_token,
            tls,
            (
                connect_timeout_seconds,
                ping_interval_seconds,
                ping_timeout_seconds,
                close_timeout_seconds,
            ),
        )
        try:
            self._setup(address, num_envs, mode, batch_size, render_mode)
        except BaseException:
            # Nothing held past a failed constructor (its traceback keeps ``self``).
            self._ep.close()
            raise

    def _setup(
        self,
        address: str,
        num_envs: int | None,
        mode: AutoresetMode,
        batch_size: int | None,
        render_mode: str | None,
    ) -> None:
        self._state: JoinStream = self._ep.state
        contract = self._state.contract
        if contract.autoreset_mode != "DISABLED":
            raise ValueError(
                f"{address} autoresets on the server ({contract.autoreset_mode}); "
                "VectorEnv needs a lane endpoint (autoreset DISABLED)"
            )
        if contract.num_envs > 1 and not contract.subset_step:
            raise ValueError(f"{address} does not take lane-scoped requests (no subset_step)")
        if num_envs is not None and int(num_envs) != contract.num_envs:
            raise ValueError(
                f"num_envs={int(num_envs)}, but the endpoint at {address} serves "
                f"{contract.num_envs} lanes: a VectorEnv drives all of an endpoint's lanes "
                f"(pass num_envs={contract.num_envs}; gymnasium.make_vec's default is 1)"
            )
        _check_render_mode(address, render_mode, contract.render_mode)
        self.final_episodes: list[Episode] = []
        """What the server reported at :meth:`close` (episodes still running then)."""
        self.autoreset_mode = mode
        self.num_envs = contract.num_envs
        self.metadata = dict(contract.metadata)
        self.metadata["autoreset_mode"] = mode
        self.render_mode = contract.render_mode
        self.single_observation_space = contract.observation_space
        self.single_action_space = contract.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.spec = None
        self._lanes = VectorLanes(self.num_envs)
        # The lanes are the pool's book too; they hold no reference back to the env.
        self._pool = BlockingPool(self._ep, self._lanes, batch_size=batch_size, autoreset_mode=mode)

    # ---- requests ---------------------------------------------------------------------

    def _resets(
        self, lanes: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> dict[int, LaneReset]:
        """Lane-scoped resets of ``lanes`` (one request for the seeded lanes, one for the
        unseeded), sent together; each lane's observation and info."""
        seeded = [(lane, s) for lane, s in zip(lanes, seeds, strict=True) if s is not None]
        unseeded = [lane for lane, s in zip(lanes, seeds, strict=True) if s is None]
        groups: list[tuple[list[int], list[int]]] = []
        if seeded:
            groups.append(([lane for lane, _ in seeded], [int(s) for _, s in seeded]))
        if unseeded:
            groups.append((unseeded, []))
        everyone = len(groups) == 1 and groups[0][0] == list(range(self.num_envs))
        builders = [
            partial(
                reset_builder,
                seeds=group_seeds,
                options=options,
                timeout_ms=self._timeout_ms,
                lanes=[] if everyone else group,  # all lanes alike: one whole-vector reset
            )
            for group, group_seeds in groups
        ]
        replies = self._ep.roundtrip(
            builders,
            ["reset"] * len(builders),
            timeout_ms=self._timeout_ms,
            lanes=[group for group, _ in groups],
        )
        out: dict[int, LaneReset] = {}
        for (group, _), reply in zip(groups, replies, strict=True):
            out.update(per_lane_reset(self._state.codecs, group, reply))
        return out

    # ---- EnvPool API (docs/client.md) -----------------------------------------------------

    @property
    def batch_size(self) -> int:
        """How many lanes :meth:`recv` returns."""
        return self._pool.core.batch_size

    def async_reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
        env_indices: Sequence[int] | None = None,
        timeout_ms: int | None = None,
    ) -> None:
        """Reset the lanes ``env_indices`` (None: all), one request each, and return at
        once; :meth:`recv` returns them (reward 0, not done). ``seed``: None, an int
        (lane ``i`` gets ``seed + i``, as :meth:`reset`), or one per addressed lane.
        ``timeout_ms``: default the ``request_timeout`` given at construction."""
        self._pool.reset(env_indices, seed, options, self._timeout_of(timeout_ms))

    def send(
        self,
        actions: Any,
        env_indices: Sequence[int] | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> None:
        """Step the lanes ``env_indices`` (None: all) with ``actions`` (batched in that
        order), one lane-scoped request each, and return at once. A lane that finished
        is reset instead (NEXT_STEP: its action ignored; SAME_STEP: with the step;
        DISABLED: refused until :meth:`async_reset` for it). A lane with a request in
        flight or a result not yet received is refused (``LaneBusyError``)."""
        self._pool.send(actions, env_indices, self._timeout_of(timeout_ms))

    def recv(self) -> Batch:
        """The next ``batch_size`` lanes that finished (all that are in flight if
        fewer), batched in lane order, ``infos["env_id"]`` naming them. A lane's error
        is raised (``LaneError`` for a recoverable one: that lane is idle again)."""
        return self._pool.recv()

    def _timeout_of(self, timeout_ms: int | None) -> int:
        return self._timeout_ms if timeout_ms is None else timeout_of(timeout_ms)

    # ---- gymnasium API -----------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        n = self.num_envs
        self._pool.core.check_idle(None, "reset()")
        seeds = seeds_of(seed, n)
        check_options(options)
        mask = take_reset_mask(options, n)
        lanes = list(range(n)) if mask is None else [i for i in range(n) if mask[i]]
        results = self._resets(lanes, [seeds[i] for i in lanes], options)
        infos = fold_reset(self._lanes, results, mask, self._add_info)
        return self._observations(), infos

    def step(self, actions: Any) -> StepResult:
        self._pool.core.check_whole_step()
        never = self._lanes.never_reset()
        if never:
            raise ResetNeeded(
                f"Cannot call VectorEnv.step() before this client reset every lane "
                f"(lanes {never} were never reset by it): call reset() first"
            )
        rows = self._action_rows(actions)
        plan = plan_step(self.autoreset_mode, self._lanes.done)
        answers = self._step_request(plan, actions, rows)
        lanes, codecs = self._lanes, self._state.codecs
        folded = fold_arrays(lanes, codecs, self.autoreset_mode, plan, answers, self._add_info)
        if folded is not None:
            return folded
        stepped, reset = step_answers(lanes, codecs, plan, answers)
        done = same_step_resets(self.autoreset_mode, plan, stepped)
        finished = self._resets(done, [None] * len(done), None) if done else {}
        infos = fold_step(lanes, stepped, reset, finished, self._add_info)
        return (
            self._observations(),
            np.copy(lanes.rewards),
            np.copy(lanes.terminations),
            np.copy(lanes.truncations),
            infos,
        )

    def _action_rows(self, actions: Any) -> list[Any] | None:
        """None when ``actions`` is a batch the fast action codec encodes whole; else one
        action per lane (their count checked)."""
        n = self.num_envs
        fast = self._state.codecs.fast_action is not None
        if fast and isinstance(actions, np.ndarray) and actions.shape[:1] == (n,):
            return None
        try:
            rows = list(iterate(self.action_space, actions))
        except ACTION_ERRORS as exc:
            raise invalid_actions(exc) from exc
        if len(rows) != n:
            raise ValueError(f"expected {n} actions, got {len(rows)}")
        return rows

    def _step_request(
        self, plan: StepPlan, actions: Any, rows: list[Any] | None
    ) -> list[Reply | EndpointError]:
        """The step's one round trip: a step of ``plan.step_lanes`` (whole-vector when
        every lane steps: the same on a lane endpoint, and the form every server handles
        fastest) beside a lane-scoped reset of ``plan.reset_lanes``; their answers, in that
        order. An error other than a lane's crash is raised."""
        step_lanes, reset_lanes = plan.step_lanes, plan.reset_lanes
        codecs = self._state.codecs
        builders: list[Any] = []
        kinds: list[str] = []
        addressed: list[Sequence[int]] = []
        if step_lanes:
            whole = len(step_lanes) == self.num_envs
            if rows is None:
                subset = actions if whole else actions[step_lanes]
                leaves = codecs.encode_actions(subset, len(step_lanes))
            else:
                leaves = codecs.encode_actions_rows([rows[i] for i in step_lanes])
            builders.append(
                partial(
                    step_builder,
                    leaves=leaves,
                    timeout_ms=self._timeout_ms,
                    lanes=[] if whole else step_lanes,
                )
            )
            kinds.append("step")
            addressed.append(step_lanes)
        if reset_lanes:
            builders.append(
                partial(
                    reset_builder,
                    seeds=[],
                    options=None,
                    timeout_ms=self._timeout_ms,
                    lanes=reset_lanes,
                )
            )
            kinds.append("reset")
            addressed.append(reset_lanes)
        answers = self._ep.roundtrip_each(
            builders, kinds, timeout_ms=self._timeout_ms, lanes=addressed
        )
        for answer in answers:
            if isinstance(answer, EndpointError) and not lane_crash(answer):
                raise answer
        return answers

    def _observations(self) -> Any:
        if self._state.codecs.fast_observation is not None:
            return np.stack(self._lanes.obs)
        space = self.single_observation_space
        out: Any = create_empty_array(space, self.num_envs)
        return concatenate(space, self._lanes.obs, out)

    def render(self) -> tuple[Any, ...] | None:
        """Each lane's frame; None for a lane the server cannot render (the 0.1.0
        servers render lane 0 of a multi-lane endpoint only)."""
        if self.render_mode is None:
            return None
        frames: list[Any] = []
        for lane in range(self.num_envs):
            try:
                reply = self._ep.roundtrip(
                    [partial(render_builder, lane=lane)], ["render"], lanes=[[lane]]
                )[0]
            except EnvError as exc:
                if not exc.is_recoverable:
                    raise
                frames.append(None)
                continue
            frames.append(decode_frame(reply))
        return tuple(frames)

    def close_extras(self, **kwargs: Any) -> None:
        self.final_episodes = self._ep.close()

    def __del__(self) -> None:
        # Not gymnasium's (1.1-1.2: close(), a Close round trip waiting up to
        # close_timeout_seconds, from the collector on any thread): the endpoint's own
        # finalizer drops the connection without a request and without waiting.
        pass


class Env(gym.Env):
    """A ``gymnasium.Env`` over a one-lane endpoint (``num_envs == 1``).

    ``reset(seed=...)`` also seeds the adapter's own ``np_random`` (as ``gymnasium.Env``
    does), the env's own randomness lives on the server. ``render()`` returns the
    server's frame as an ``(H, W, 3)`` array (RGBA: 4 channels; gray: ``(H, W)``;
    ``render_mode`` from the contract; ``render_mode=``, which ``gymnasium.make``
    passes when asked for one, must be the served env's). :meth:`step` before this client's own :meth:`reset` raises
    ``gymnasium.error.ResetNeeded`` (nothing sent). Every other keyword
    (``auth_token``, ``tls``, ``request_timeout_seconds``, the connection's
    ``*_seconds``, and the deprecated 0.1 names) as :class:`VectorEnv` takes it.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}
    """The class's (what ``gymnasium.make`` reads before connecting): the wire carries
    RGB frames. An instance's is the served env's."""

    @renamed_kwargs(**OLD_ADAPTER_KEYWORDS)
    def __init__(
        self,
        address: str,
        *,
        render_mode: str | None = None,
        auth_token: str | None = None,
        tls: TlsSetting = None,
        request_timeout_seconds: float | None = None,
        connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
        ping_interval_seconds: float = DEFAULT_PING_INTERVAL_SECONDS,
        ping_timeout_seconds: float = DEFAULT_PING_TIMEOUT_SECONDS,
        close_timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS,
    ) -> None:
        self._timeout_ms = request_timeout_ms(request_timeout_seconds)
        self._ep = _open(
            address,
            auth_token,
            tls,
            (
                connect_timeout_seconds,
                ping_interval_seconds,
                ping_timeout_seconds,
                close_timeout_seconds,
            ),
        )
        self._state: JoinStream = self._ep.state
        contract = self._state.contract
        try:
            if contract.num_envs != 1:
                raise ValueError(f"{address} has {contract.num_envs} lanes; use VectorEnv for it")
            _check_render_mode(address, render_mode, contract.render_mode)
        except BaseException:
            self._ep.close()
            raise
        self._needs_reset = True
        self.final_episodes: list[Episode] = []
        self.observation_space = contract.observation_space
        self.action_space = contract.action_space
        self.metadata = dict(contract.metadata)
        self.render_mode = contract.render_mode
        self.spec = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        check_options(options)
        seeds = [] if seed is None else [wire_seed(seed)]
        reply = self._ep.roundtrip(
            [
                partial(
                    reset_builder,
                    seeds=seeds,
                    options=options,
                    timeout_ms=self._timeout_ms,
                    lanes=[],
                )
            ],
            ["reset"],
            timeout_ms=self._timeout_ms,
            lanes=[[0]],
        )[0]
        self._needs_reset = False
        return self._state.codecs.observations(reply.leaves, 1)[0], reply.infos

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._needs_reset:
            raise ResetNeeded(
                "Cannot call Env.step() before this client's own reset(): call reset() first"
            )
        leaves = self._state.codecs.encode_single_action(action)
        reply = self._ep.roundtrip(
            [partial(step_builder, leaves=leaves, timeout_ms=self._timeout_ms, lanes=[])],
            ["step"],
            timeout_ms=self._timeout_ms,
            lanes=[[0]],
        )[0]
        rewards, terminated, truncated = step_arrays(reply, 1)
        obs = self._state.codecs.observations(reply.leaves, 1)[0]
        return obs, float(rewards[0]), bool(terminated[0]), bool(truncated[0]), reply.infos

    def render(self) -> Any:
        if self.render_mode is None:
            return None
        reply = self._ep.roundtrip([partial(render_builder, lane=0)], ["render"], lanes=[[0]])[0]
        return decode_frame(reply)

    def close(self) -> None:
        if getattr(self, "_ep", None) is not None:
            self.final_episodes = self._ep.close()
