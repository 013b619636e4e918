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
from typing import Any, SupportsFloat, TypeVar

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, iterate

from .._deprecation import Rename, renamed_kwargs
from .._tls import TlsSetting
from ._answers import StepResult
from ._autoreset import (
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
from ._core import check_options
from ._errors import (
    EndpointClosedError,
)
from ._gather import addresses_of
from ._joining import (
    count_of,
    one_lane_contract,
    open_endpoints,
    same_contract,
)
from ._messages import Episode, render_builder, reset_builder, step_builder
from ._part import InfoCalls, Part
from ._pool import Batch
from ._rounds import Rounds, run_shares
from ._settings import (
    DEFAULT_CLOSE_TIMEOUT_SECONDS,
    DEFAULT_CONNECT_TIMEOUT_SECONDS,
    DEFAULT_PING_INTERVAL_SECONDS,
    DEFAULT_PING_TIMEOUT_SECONDS,
    OLD_CONNECTION_KEYWORDS,
    ConnectionSettings,
    request_timeout_ms,
    seconds_of_ms,
)
from ._span import SpanningPool

__all__ = ["Env", "RenderModeError", "VectorEnv"]

T = TypeVar("T")


OLD_ADAPTER_KEYWORDS: dict[str, Rename] = {
    **OLD_CONNECTION_KEYWORDS,
    "request_timeout_ms": ("request_timeout_seconds", seconds_of_ms),
}
"""The adapters' 0.1 keywords (deprecated, removed in 0.2): ``request_timeout_ms`` (int
milliseconds) becomes ``request_timeout_seconds`` (float seconds)."""


class RenderModeError(ValueError, TypeError):
    """``render_mode=`` asked of an adapter is not the served env's. A ``ValueError``;
    a ``TypeError`` too, which is how an env says it does not take that keyword:
    Stable-Baselines3's ``make_vec_env(env_id)`` asks every env for ``rgb_array`` and
    makes it again without ``render_mode`` on a ``TypeError``."""


def _check_render_mode(address: str, asked: str | None, served: str | None) -> None:
    """``render_mode=`` (what ``gymnasium.make`` passes when asked for one) must be the
    served env's: the server renders, the client only carries its frames."""
    if asked is not None and asked != served:
        raise RenderModeError(
            f"render_mode={asked!r}, but the env at {address} is served with "
            f"render_mode={served!r}; the server's env decides (serve it with that "
            "render_mode, e.g. rlmesh-trio serve --kwargs-json '{\"render_mode\": ...}')"
        )


class VectorEnv(gym.vector.VectorEnv):
    """A ``gymnasium.vector.VectorEnv`` whose sub-envs are the lanes of one endpoint, or
    of several endpoints side by side.

    ``address``: one address; a list of addresses (or one string of comma-separated
    ones); or None, which reads ``RLMESH_TRIO_ADDRESS`` (one address or a
    comma-separated list: what ``gymnasium.make_vec("rlmesh_trio/Remote-v0",
    num_envs=N)`` uses). With a list, whole endpoints are gathered in list order until
    they hold ``num_envs`` lanes (None: every endpoint of the list); an endpoint whose
    Join session another client holds, or that cannot be reached, is passed over, and
    when the rest cannot make up the count :class:`EndpointsUnavailableError` names each
    endpoint and why it was not taken. The vector's lanes are the endpoints' lanes in
    list order; every reset and step goes to all of them at once (one Join each) and
    comes back as one batch, exactly as ``SyncVectorEnv`` over the same envs. An
    endpoint lost mid-way is raised naming it, the others closed.

    ``autoreset_mode``: ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``, with the
    semantics of gymnasium's ``SyncVectorEnv`` (DISABLED: reset finished lanes with
    ``reset(options={"reset_mask": mask})``). Each endpoint must be a lane endpoint
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
    are ready (docs/client.md), across every endpoint of the vector. With
    ``batch_size < num_envs``, :meth:`step` is refused (it would wait for every lane:
    that is what the pool avoids); with ``batch_size == num_envs`` it works as ever once
    no lane is in flight.

    ``num_envs`` (what ``gymnasium.make_vec`` passes; default: whatever the endpoints
    serve) must equal the endpoint's lane count when one address is given, else a
    ``ValueError`` naming both. ``render_mode`` (None: the served env's) must be the
    served env's. A constructor that raises has closed its connections first.
    :meth:`step` before this client's own :meth:`reset` of every lane raises
    ``gymnasium.error.ResetNeeded`` (nothing sent).
    """

    @renamed_kwargs(**OLD_ADAPTER_KEYWORDS)
    def __init__(
        self,
        address: str | Sequence[str] | None = None,
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
        want = count_of(num_envs)
        timeout_ms = request_timeout_ms(request_timeout_seconds)
        settings = ConnectionSettings(
            auth_token=auth_token,
            tls=tls,
            connect_timeout_seconds=connect_timeout_seconds,
            ping_interval_seconds=ping_interval_seconds,
            ping_timeout_seconds=ping_timeout_seconds,
            close_timeout_seconds=close_timeout_seconds,
        )
        joined = open_endpoints(address, want, settings)
        self._parts: list[Part] = []
        try:
            self._setup(joined, want, mode, timeout_ms, batch_size, render_mode)
        except BaseException:
            # Nothing held past a failed constructor (its traceback keeps ``self``).
            for _, ep in joined:
                ep.close()
            raise

    def _setup(
        self,
        joined: list[tuple[str, BlockingEndpoint]],
        num_envs: int | None,
        mode: AutoresetMode,
        timeout_ms: int,
        batch_size: int | None,
        render_mode: str | None,
    ) -> None:
        single = len(joined) == 1
        offset = 0
        for address, ep in joined:
            part = Part(address, ep, offset, mode, timeout_ms, batch_size if single else None)
            self._parts.append(part)
            offset += part.num_envs
        first = self._parts[0]
        for part in self._parts[1:]:
            same_contract(first.contract, first.address, part.contract, part.address)
        contract = first.contract
        if num_envs is not None and num_envs != offset:
            raise ValueError(
                f"num_envs={num_envs}, but the endpoint at {first.address} serves "
                f"{contract.num_envs} lanes: a VectorEnv drives all of an endpoint's lanes "
                f"(pass num_envs={contract.num_envs}; gymnasium.make_vec's default is 1)"
            )
        _check_render_mode(first.address, render_mode, contract.render_mode)
        self._single = first if single else None
        self.final_episodes: list[Episode] = []
        """What the servers reported at :meth:`close` (episodes still running then)."""
        self.addresses = [part.address for part in self._parts]
        """The endpoints this vector joined, in lane order."""
        self.autoreset_mode = mode
        self.num_envs = offset
        self.metadata = dict(contract.metadata)
        self.metadata["autoreset_mode"] = mode
        self.render_mode = contract.render_mode
        self.single_observation_space = contract.observation_space
        self.single_action_space = contract.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.spec = None
        self._pool = None if single else SpanningPool(self._parts, batch_size, mode)

    # ---- running the parts ----------------------------------------------------------------

    def _run(self, rounds: list[Rounds[T]]) -> list[T]:
        """Every part's share of a reset or step, all at once (:func:`._rounds.run_shares`:
        a part's failure raised naming its endpoint, a fatal one closing the others)."""
        return run_shares(self._parts, rounds, self.close)

    def _replayed(self, calls: list[InfoCalls]) -> dict[str, Any]:
        infos: dict[str, Any] = {}
        for part, recorded in zip(self._parts, calls, strict=True):
            for lane, info in recorded.calls:
                infos = self._add_info(infos, info, lane + part.offset)
        return infos

    def _observations(self) -> Any:
        rows = [row for part in self._parts for row in part.lanes.obs]
        return self._parts[0].state.codecs.batch(rows)

    # ---- EnvPool API (docs/client.md) -----------------------------------------------------

    @property
    def batch_size(self) -> int:
        """How many lanes :meth:`recv` returns."""
        if self._single is not None:
            return self._single.pool.core.batch_size
        assert self._pool is not None
        return self._pool.batch_size

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
        timeout = self._timeout_of(timeout_ms)
        if self._single is not None:
            self._single.pool.reset(env_indices, seed, options, timeout)
            return
        assert self._pool is not None
        self._pool.reset(env_indices, seed, options, timeout)

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
        timeout = self._timeout_of(timeout_ms)
        if self._single is not None:
            self._single.pool.send(actions, env_indices, timeout)
            return
        assert self._pool is not None
        self._pool.send(actions, env_indices, timeout)

    def recv(self) -> Batch:
        """The next ``batch_size`` lanes that finished (all that are in flight if
        fewer), batched in lane order, ``infos["env_id"]`` naming them. A lane's error
        is raised (``LaneError`` for a recoverable one: that lane is idle again)."""
        if self._single is not None:
            return self._single.pool.recv()
        assert self._pool is not None
        return self._pool.recv()

    def _timeout_of(self, timeout_ms: int | None) -> int:
        return self._parts[0].timeout_ms if timeout_ms is None else timeout_of(timeout_ms)

    def _check_whole_step(self, what: str) -> None:
        if self._single is not None:
            if what == "step()":
                self._single.pool.core.check_whole_step()
            else:
                self._single.pool.core.check_idle(None, what)
            return
        assert self._pool is not None
        self._pool.check_whole(what)

    # ---- gymnasium API -----------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        n = self.num_envs
        self._check_whole_step("reset()")
        seeds = seeds_of(seed, n)
        check_options(options)
        mask = take_reset_mask(options, n)
        single = self._single
        if single is not None:
            (infos,) = self._run([single.reset(seeds, options, mask, self._add_info)])
            return self._observations(), infos
        calls = [InfoCalls() for _ in self._parts]
        self._run(
            [
                part.reset(
                    seeds[part.offset : part.offset + part.num_envs],
                    options,
                    None if mask is None else mask[part.offset : part.offset + part.num_envs],
                    recorded,
                )
                for part, recorded in zip(self._parts, calls, strict=True)
            ]
        )
        return self._observations(), self._replayed(calls)

    def step(self, actions: Any) -> StepResult:
        self._check_whole_step("step()")
        never = [i + part.offset for part in self._parts for i in part.lanes.never_reset()]
        if never:
            raise ResetNeeded(
                f"Cannot call VectorEnv.step() before this client reset every lane "
                f"(lanes {never} were never reset by it): call reset() first"
            )
        rows = self._action_rows(actions)
        single = self._single
        if single is not None:
            return self._run([single.step(actions, rows, self._add_info)])[0]
        calls = [InfoCalls() for _ in self._parts]
        self._run(
            [
                part.step(
                    None
                    if rows is not None
                    else actions[part.offset : part.offset + part.num_envs],
                    None if rows is None else rows[part.offset : part.offset + part.num_envs],
                    recorded,
                )
                for part, recorded in zip(self._parts, calls, strict=True)
            ]
        )
        parts = self._parts
        return (
            self._observations(),
            np.concatenate([part.lanes.rewards for part in parts]),
            np.concatenate([part.lanes.terminations for part in parts]),
            np.concatenate([part.lanes.truncations for part in parts]),
            self._replayed(calls),
        )

    def _action_rows(self, actions: Any) -> list[Any] | None:
        """None when ``actions`` is a batch the fast action codec encodes whole; else one
        action per lane (their count checked)."""
        n = self.num_envs
        fast = self._parts[0].state.codecs.fast_action is not None
        if fast and isinstance(actions, np.ndarray) and actions.shape[:1] == (n,):
            return None
        try:
            rows = list(iterate(self.action_space, actions))
        except ACTION_ERRORS as exc:
            raise invalid_actions(exc) from exc
        if len(rows) != n:
            raise ValueError(f"expected {n} actions, got {len(rows)}")
        return rows

    def render(self) -> tuple[Any, ...] | None:
        """Each lane's frame; None for a lane the server cannot render (the 0.1.0
        servers render lane 0 of a multi-lane endpoint only)."""
        if self.render_mode is None:
            return None
        return tuple(frame for part in self._parts for frame in part.render())

    def close_extras(self, **kwargs: Any) -> None:
        episodes: list[Episode] = []
        for part in getattr(self, "_parts", ()):
            episodes.extend(part.close())
        self.final_episodes = episodes

    def __del__(self) -> None:
        # Not gymnasium's (1.1-1.2: close(), a Close round trip waiting up to
        # close_timeout_seconds, from the collector on any thread): the endpoints' own
        # finalizers drop the connections without a request and without waiting.
        pass


class Env(gym.Env):
    """A ``gymnasium.Env`` over a one-lane endpoint (``num_envs == 1``).

    ``reset(seed=...)`` also seeds the adapter's own ``np_random`` (as ``gymnasium.Env``
    does), the env's own randomness lives on the server. ``render()`` returns the
    server's frame as an ``(H, W, 3)`` array (RGBA: 4 channels; gray: ``(H, W)``;
    ``render_mode`` from the contract; ``render_mode=``, which ``gymnasium.make``
    passes when asked for one, must be the served env's). :meth:`step` before this
    client's own :meth:`reset` raises ``gymnasium.error.ResetNeeded`` (nothing sent).
    Every other keyword (``auth_token``, ``tls``, ``request_timeout_seconds``, the
    connection's ``*_seconds``, and the deprecated 0.1 names) as :class:`VectorEnv`
    takes it.

    The constructor reads the env's spaces with a Handshake and takes no session: the
    endpoint's one Join session is taken at the first :meth:`reset` (or
    :meth:`render`), so an env made only to read its spaces (TorchRL's ``GymEnv`` makes
    one before its ``num_envs`` workers, RLlib and others do the same) holds no
    endpoint. ``address``: as :class:`VectorEnv` takes it (None:
    ``RLMESH_TRIO_ADDRESS``); from a list, that first reset joins the first one-lane
    endpoint in list order that admits this client (so N envs made and reset in turn, as
    ``SyncVectorEnv`` and SB3's ``DummyVecEnv`` do, take endpoints 0..N-1, each env's
    seed where a local run puts it); :attr:`address` says which (None until then). A
    BUSY or unreachable endpoint there is :class:`EndpointsUnavailableError` naming
    each.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"]}
    """The class's (what ``gymnasium.make`` reads before connecting): the wire carries
    RGB frames. An instance's is the served env's."""

    @renamed_kwargs(**OLD_ADAPTER_KEYWORDS)
    def __init__(
        self,
        address: str | Sequence[str] | None = None,
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
        self._settings = ConnectionSettings(
            auth_token=auth_token,
            tls=tls,
            connect_timeout_seconds=connect_timeout_seconds,
            ping_interval_seconds=ping_interval_seconds,
            ping_timeout_seconds=ping_timeout_seconds,
            close_timeout_seconds=close_timeout_seconds,
        )
        self._addresses = addresses_of(address)
        source, contract = one_lane_contract(self._addresses, self._settings)
        _check_render_mode(source, render_mode, contract.render_mode)
        self._contract = contract
        self._ep: BlockingEndpoint | None = None
        self._closed = False
        self.address: str | None = None
        """The endpoint this env joined (at its first reset); None before."""
        self._needs_reset = True
        self.final_episodes: list[Episode] = []
        self.observation_space = contract.observation_space
        self.action_space = contract.action_space
        self.metadata = dict(contract.metadata)
        self.render_mode = contract.render_mode
        self.spec = None

    def _joined(self) -> BlockingEndpoint:
        """The session, taken now if not yet (see the class's docstring)."""
        if self._ep is not None:
            return self._ep
        if self._closed:
            raise EndpointClosedError()
        ((address, ep),) = open_endpoints(self._addresses, 1, self._settings)
        contract = ep.state.contract
        try:
            if contract.num_envs != 1:
                raise ValueError(f"{address} has {contract.num_envs} lanes; use VectorEnv for it")
            same_contract(self._contract, "the env's spaces", contract, address)
        except BaseException:
            ep.close()
            raise
        self._ep, self.address = ep, address
        return ep

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        check_options(options)
        seeds = [] if seed is None else [wire_seed(seed)]
        ep = self._joined()
        reply = ep.roundtrip(
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
        return ep.state.codecs.observations(reply.leaves, 1)[0], reply.infos

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._needs_reset:
            raise ResetNeeded(
                "Cannot call Env.step() before this client's own reset(): call reset() first"
            )
        ep = self._joined()
        codecs = ep.state.codecs
        leaves = codecs.encode_single_action(action)
        reply = ep.roundtrip(
            [partial(step_builder, leaves=leaves, timeout_ms=self._timeout_ms, lanes=[])],
            ["step"],
            timeout_ms=self._timeout_ms,
            lanes=[[0]],
        )[0]
        rewards, terminated, truncated = step_arrays(reply, 1)
        obs = codecs.observations(reply.leaves, 1)[0]
        return obs, float(rewards[0]), bool(terminated[0]), bool(truncated[0]), reply.infos

    def render(self) -> Any:
        if self.render_mode is None:
            return None
        reply = self._joined().roundtrip(
            [partial(render_builder, lane=0)], ["render"], lanes=[[0]]
        )[0]
        return decode_frame(reply)

    def close(self) -> None:
        self._closed = True
        ep = getattr(self, "_ep", None)
        if ep is not None:
            self.final_episodes = ep.close()
