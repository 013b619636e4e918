"""EnvPool-style stepping of the lanes that are ready: ``send`` / ``recv``.

``send(actions, env_indices)`` puts one lane-scoped request per lane on the wire and
returns; ``recv()`` returns the first ``batch_size`` lanes that finished, batched in lane
order with ``info["env_id"]``. A server runs lane-scoped requests concurrently and
answers them out of order (SPEC §7.4), so the learner never waits for the slowest lane.

:class:`PoolCore` is the protocol logic without I/O (the lanes' book, autoreset per
lane, deadlines, batching); :class:`BlockingPool` drives it on the blocking endpoint
(``VectorEnv(..., batch_size=)``), :class:`AsyncPool` on the Trio one
(``open_endpoint(..., batch_size=)``).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import gymnasium as gym
import numpy as np
import trio
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, iterate

from ._codecs import (
    ACTION_ERRORS,
    Codecs,
    expand_seeds,
    invalid_actions,
    lane_infos,
    lanes_of,
    late,
    reply_deadline,
    step_arrays,
    timeout_of,
)
from ._core import JoinStream, Slot, check_options, result_of
from ._errors import (
    LANE_FAULT_KEY,
    EndpointError,
    EnvError,
    LaneBusyError,
    LaneError,
    RequestTimeoutError,
)
from ._messages import reset_request, step_request

if TYPE_CHECKING:
    from ._blocking import BlockingEndpoint

__all__ = [
    "ENV_ID_KEY",
    "AsyncPool",
    "BlockingPool",
    "LaneBook",
    "PoolCore",
    "autoreset_mode_of",
    "batch_of",
]

ENV_ID_KEY = "env_id"
"""The info key naming a batch's lanes (EnvPool's name), an int32 array."""

Batch = tuple[Any, np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], dict[str, Any]]
"""``(observations, rewards, terminated, truncated, infos)`` of a batch of lanes."""


def autoreset_mode_of(mode: str | AutoresetMode) -> AutoresetMode:
    return mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)


class Book(Protocol):
    """Each lane's state the pool shares with its face: ``done[i]`` (the lane finished
    an episode and is reset before it steps again) and ``obs[i]`` (its latest
    observation; None: never reset)."""

    @property
    def done(self) -> np.ndarray[Any, Any]: ...

    @property
    def obs(self) -> list[Any]: ...


class LaneBook:
    """A :class:`Book` of its own (the Trio face)."""

    def __init__(self, num_envs: int) -> None:
        self.done: np.ndarray[Any, Any] = np.zeros((num_envs,), dtype=np.bool_)
        self.obs: list[Any] = [None] * num_envs


_Result = tuple[Any, float, bool, bool, list[dict[str, Any]]]
"""One lane's finished result; its infos are added to the batch's in order."""

_Plan = tuple[int, str, Callable[..., bytes], int]
"""A request to make: ``(lane, kind, build(rid, timeout_ms=, env_indices=), timeout_ms)``."""


@dataclass(eq=False)
class _Flight:
    """One lane's request on the wire. ``kind``: ``step``; ``reset`` (asked for, or the
    NEXT_STEP autoreset); ``final`` (SAME_STEP's reset after a finished ``stepped``)."""

    lane: int
    kind: str
    rid: str
    slot: Slot
    timeout_ms: int
    deadline: float | None
    stepped: _Result | None = field(default=None)


class _InfoBatch:
    """gymnasium's batched-info layout (``VectorEnv._add_info``) for ``k`` lanes."""

    _add_info: Any = gym.vector.VectorEnv._add_info

    def __init__(self, k: int) -> None:
        self.num_envs = k

    def add(self, infos: dict[str, Any], info: dict[str, Any], j: int) -> dict[str, Any]:
        out: dict[str, Any] = self._add_info(infos, info, j)
        return out


class PoolCore:
    """The pool without I/O: what to send, what came back, what ``recv`` returns.

    Faces call :meth:`send` / :meth:`reset` (then write), :meth:`settle` after replies
    arrive (then write again when it says so: SAME_STEP resets), :meth:`expire` at
    deadlines, and :meth:`take` once :meth:`can_take` holds.
    """

    def __init__(
        self,
        state: JoinStream,
        book: Book,
        *,
        batch_size: int | None,
        autoreset_mode: AutoresetMode,
        clock: Callable[[], float],
    ) -> None:
        n = state.contract.num_envs
        if batch_size is None:
            batch_size = n
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise TypeError(f"batch_size must be an int, not {type(batch_size).__name__}")
        if not 1 <= int(batch_size) <= n:
            raise ValueError(f"batch_size must be in 1..num_envs={n}, got {batch_size}")
        self.state = state
        self.book = book
        self.num_envs = n
        self.batch_size = int(batch_size)
        self.mode = autoreset_mode
        self._clock = clock
        self.flights: dict[int, _Flight] = {}
        self.ready: collections.OrderedDict[int, _Result | BaseException] = (
            collections.OrderedDict()
        )
        """Finished lanes in order of arrival: their result, or the error they ended with."""
        self._arrived: list[int] = []
        self._batched: dict[int, gym.spaces.Space[Any]] = {}
        self.notify: Callable[[], None] = _noop

    # ---- checks -----------------------------------------------------------------------

    def busy(self) -> list[int]:
        """Lanes with a request in flight or a result not yet returned by ``recv``."""
        return sorted({*self.flights, *self.ready})

    def check_idle(self, env_indices: Sequence[int] | None, what: str) -> None:
        """Refuse ``what`` on lanes the pool holds (None: any lane)."""
        if not self.flights and not self.ready:
            return  # the pool holds no lane (every whole-vector step() asks)
        held = set(self.busy())
        lanes = range(self.num_envs) if env_indices is None else env_indices
        clash = sorted(held.intersection(int(i) for i in lanes))
        if clash:
            raise LaneBusyError(
                f"{what}: lanes {clash} have a step in flight or a result not yet "
                "received; recv() them first"
            )

    def check_whole_step(self) -> None:
        """``VectorEnv.step()`` steps the whole vector: refused with a smaller batch."""
        if self.batch_size < self.num_envs:
            raise RuntimeError(
                f"step() steps all {self.num_envs} lanes and waits for each; with "
                f"batch_size={self.batch_size} < num_envs use send() and recv()"
            )
        self.check_idle(None, "step()")

    # ---- requests ---------------------------------------------------------------------

    def send(self, actions: Any, env_indices: Sequence[int] | None, timeout_ms: int | None) -> None:
        """One request per lane: a step, or the reset of a lane that finished (NEXT_STEP:
        its action is ignored, as gymnasium and EnvPool do). Everything is checked before
        anything is sent."""
        self.state.check_open()
        lanes = lanes_of(env_indices, self.num_envs) or list(range(self.num_envs))
        self.check_idle(lanes, "send()")
        never = [lane for lane in lanes if self.book.obs[lane] is None]
        if never:
            raise ValueError(f"send(): lanes {never} were never reset; reset them first")
        done = self.book.done
        if self.mode == AutoresetMode.DISABLED:
            finished = [lane for lane in lanes if done[lane]]
            if finished:
                raise ValueError(
                    f"send(): lanes {finished} finished their episodes and autoreset is "
                    "DISABLED: reset them first"
                )
        leaves = self._encode(actions, len(lanes))
        timeout = timeout_of(timeout_ms)
        plan: list[_Plan] = []
        for lane, lane_leaves in zip(lanes, leaves, strict=True):
            if done[lane] and self.mode == AutoresetMode.NEXT_STEP:
                plan.append((lane, "reset", partial(_reset, seeds=[], options=None), timeout))
            else:
                plan.append((lane, "step", partial(_step, leaves=lane_leaves), timeout))
        self._submit(plan)

    def reset(
        self,
        env_indices: Sequence[int] | None,
        seed: int | Sequence[int | None] | None,
        options: Mapping[str, Any] | None,
        timeout_ms: int | None,
    ) -> None:
        """One reset request per lane. ``seed``: None, an int (lane ``i`` gets
        ``seed + i``, as ``VectorEnv.reset``), or one per addressed lane."""
        self.state.check_open()
        lanes = lanes_of(env_indices, self.num_envs) or list(range(self.num_envs))
        self.check_idle(lanes, "async_reset()")
        seeds = expand_seeds(seed, lanes)
        check_options(options)
        timeout = timeout_of(timeout_ms)
        plan: list[_Plan] = []
        for lane, s in zip(lanes, seeds, strict=True):
            build = partial(_reset, seeds=[] if s is None else [s], options=options)
            plan.append((lane, "reset", build, timeout))
        self._submit(plan)

    def _encode(self, actions: Any, k: int) -> list[list[bytes]]:
        """Each lane's action leaves, from a batch with leading dimension ``k``."""
        codecs = self.state.codecs
        if codecs.fast_action is not None and isinstance(actions, np.ndarray):
            if actions.shape[:1] != (k,):
                raise ValueError(f"expected actions for {k} lanes, got shape {actions.shape}")
            return [codecs.encode_actions(actions[j : j + 1], 1) for j in range(k)]
        try:
            rows = list(iterate(codecs.batched_action_space(k), actions))
        except ACTION_ERRORS as exc:
            raise invalid_actions(exc) from exc
        if len(rows) != k:
            raise ValueError(f"expected actions for {k} lanes, got {len(rows)}")
        return [codecs.encode_actions_rows([row]) for row in rows]

    def _submit(self, plan: Sequence[_Plan], stepped: _Result | None = None) -> None:
        """One lane-scoped request per entry, queued back to back (one write)."""
        state = self.state
        rids = [state.next_id() for _ in plan]
        requests = [
            (build(rid, timeout_ms=timeout, env_indices=[lane]), rid, partial(self._arrive, lane))
            for (lane, _, build, timeout), rid in zip(plan, rids, strict=True)
        ]
        slots = state.submit_many(requests)
        now = self._clock()
        for (lane, kind, _, timeout), rid, slot in zip(plan, rids, slots, strict=True):
            limit = reply_deadline(timeout)
            deadline = None if limit is None else now + limit
            self.flights[lane] = _Flight(lane, kind, rid, slot, timeout, deadline, stepped)

    def _arrive(self, lane: int) -> None:
        self._arrived.append(lane)
        self.notify()

    # ---- replies ----------------------------------------------------------------------

    def settle(self) -> bool:
        """Land the replies that arrived; True if that sent requests (SAME_STEP resets)."""
        sent = False
        arrived, self._arrived = self._arrived, []
        for lane in arrived:
            flight = self.flights.get(lane)
            if flight is not None and (
                flight.slot.reply is not None or flight.slot.error is not None
            ):
                sent = self._land(flight) or sent
        return sent

    def _land(self, flight: _Flight) -> bool:
        lane = flight.lane
        del self.flights[lane]
        state = self.state
        book = self.book
        try:
            reply = result_of(flight.slot, "step" if flight.kind == "step" else "reset")
        except EnvError as exc:
            if exc.is_recoverable and exc.lane_faults:
                # A faulted lane (rlmesh-trio's --on-lane-fault rebuild/truncate): its
                # episode ends truncated on its last observation; the next send resets it.
                faults = {fault["lane"]: fault for fault in exc.lane_faults}
                info = {LANE_FAULT_KEY: faults[lane]} if lane in faults else {}
                book.done[lane] = True
                self.ready[lane] = (book.obs[lane], 0.0, False, True, [info])
            else:
                self.ready[lane] = LaneError(exc, lane) if exc.is_recoverable else exc
            return False
        except EndpointError as exc:
            self.ready[lane] = exc
            return False
        if flight.kind == "step":
            rewards, terminated, truncated = step_arrays(reply, 1)
            state.completed.extend(reply.episodes)
            obs = state.codecs.observations(reply.leaves, 1)[0]
            info = lane_infos(reply.infos, 1)[0]
            result: _Result = (
                obs,
                float(rewards[0]),
                bool(terminated[0]),
                bool(truncated[0]),
                [info],
            )
            book.obs[lane] = obs
            finished = result[2] or result[3]
            if finished and self.mode == AutoresetMode.SAME_STEP:
                try:
                    build = partial(_reset, seeds=[], options=None)
                    self._submit([(lane, "final", build, flight.timeout_ms)], result)
                except EndpointError as exc:
                    self.ready[lane] = exc
                    return False
                return True
            book.done[lane] = finished
            self.ready[lane] = result
            return False
        obs = state.codecs.observations(reply.leaves, 1)[0]
        info = lane_infos(reply.infos, 1)[0]
        book.obs[lane] = obs
        book.done[lane] = False
        if flight.kind == "final":
            assert flight.stepped is not None
            final_obs, reward, term, trunc, final_infos = flight.stepped
            final = {"final_obs": final_obs, "final_info": final_infos[0]}
            self.ready[lane] = (obs, reward, term, trunc, [final, info])
        else:
            self.ready[lane] = (obs, 0.0, False, False, [info])
        return False

    def expire(self) -> None:
        """Give up the requests past their deadline (``timeout_ms`` plus the grace)."""
        now = self._clock()
        for lane, flight in list(self.flights.items()):
            if flight.deadline is None or now < flight.deadline:
                continue
            if flight.slot.reply is not None or flight.slot.error is not None:
                continue  # answered in time; settle() lands it
            self.state.abandon(flight.rid)
            del self.flights[lane]
            verb = "step" if flight.kind == "step" else "reset"
            self.ready[lane] = RequestTimeoutError(
                f"lane {lane}: {late(verb, flight.timeout_ms).message}"
            )

    def next_deadline(self) -> float | None:
        deadlines = [f.deadline for f in self.flights.values() if f.deadline is not None]
        return min(deadlines) if deadlines else None

    def wanted(self) -> int:
        """How many lanes the next batch has: ``batch_size``, or all that are held."""
        return min(self.batch_size, len(self.ready) + len(self.flights))

    def can_take(self) -> bool:
        if any(isinstance(item, BaseException) for item in self.ready.values()):
            return True
        return len(self.ready) >= self.wanted()

    def take(self) -> Batch:
        """The next batch (its lanes in lane order); a lane's error is raised first."""
        return batch_of(self.state.codecs, self.take_results(self.wanted()))

    def take_results(self, k: int) -> list[tuple[int, _Result]]:
        """The first ``k`` lanes that finished, in lane order, with their results; a
        lane's error is raised first."""
        for lane, item in self.ready.items():
            if isinstance(item, BaseException):
                del self.ready[lane]
                raise item
        if k == 0:
            self.state.check_open()
            raise RuntimeError("recv(): no lane is in flight; send() or reset first")
        taken: list[tuple[int, _Result]] = []
        for lane in sorted(list(self.ready)[:k]):
            item = self.ready.pop(lane)
            assert not isinstance(item, BaseException)
            taken.append((lane, item))
        return taken

    # ---- the face's own requests ----------------------------------------------------------

    def rows(self, observations: Any, k: int) -> list[Any]:
        """Each lane's observation of a batch of ``k`` (copies where the batch is an array)."""
        if self.state.codecs.fast_observation is not None:
            return list(np.array(observations))
        space = self._batched.get(k)
        if space is None:
            space = self._batched[k] = batch_space(self.state.contract.observation_space, k)
        return list(iterate(space, observations))

    def note_reset(self, lanes: Sequence[int], rows: Sequence[Any]) -> None:
        """Lanes reset outside the pool (a face's whole or lane-scoped reset)."""
        for lane, row in zip(lanes, rows, strict=True):
            self.book.obs[lane] = row
            self.book.done[lane] = False

    def note_step(self, lanes: Sequence[int], rows: Sequence[Any], finished: Any) -> None:
        """Lanes stepped outside the pool: the finished ones are reset by their next send."""
        for j, (lane, row) in enumerate(zip(lanes, rows, strict=True)):
            self.book.obs[lane] = row
            self.book.done[lane] = bool(finished[j])


def batch_of(codecs: Codecs, taken: Sequence[tuple[int, _Result]]) -> Batch:
    """Lanes' results (``(lane, result)`` in lane order) as one batch, ``infos["env_id"]``
    naming the lanes."""
    k = len(taken)
    observations = codecs.batch([r[0] for _, r in taken])
    rewards = np.array([r[1] for _, r in taken], dtype=np.float64)
    terminated = np.array([r[2] for _, r in taken], dtype=np.bool_)
    truncated = np.array([r[3] for _, r in taken], dtype=np.bool_)
    batcher = _InfoBatch(k)
    infos: dict[str, Any] = {}
    for j, (lane, result) in enumerate(taken):
        for info in result[4]:
            infos = batcher.add(infos, info, j)
        infos = batcher.add(infos, {ENV_ID_KEY: np.int32(lane)}, j)
    return observations, rewards, terminated, truncated, infos


def _reset(
    rid: str,
    *,
    seeds: list[int],
    options: Mapping[str, Any] | None,
    timeout_ms: int,
    env_indices: list[int],
) -> bytes:
    return reset_request(
        rid, seeds=seeds, options=options, timeout_ms=timeout_ms, env_indices=env_indices
    )


def _step(rid: str, *, leaves: list[bytes], timeout_ms: int, env_indices: list[int]) -> bytes:
    return step_request(rid, leaves, timeout_ms=timeout_ms, env_indices=env_indices)


def _noop() -> None:
    pass


# ---------------------------------------------------------------------------- faces


class BlockingPool:
    """The pool on the blocking endpoint, in the caller's thread (``VectorEnv``)."""

    def __init__(
        self,
        endpoint: BlockingEndpoint,
        book: Book,
        *,
        batch_size: int | None,
        autoreset_mode: AutoresetMode,
    ) -> None:
        self._ep = endpoint
        self.core = PoolCore(
            endpoint.state,
            book,
            batch_size=batch_size,
            autoreset_mode=autoreset_mode,
            clock=time.monotonic,
        )

    def send(self, actions: Any, env_indices: Sequence[int] | None, timeout_ms: int | None) -> None:
        try:
            self.core.send(actions, env_indices, timeout_ms)
        finally:
            self._ep.flush()

    def reset(
        self,
        env_indices: Sequence[int] | None,
        seed: int | Sequence[int | None] | None,
        options: Mapping[str, Any] | None,
        timeout_ms: int | None,
    ) -> None:
        try:
            self.core.reset(env_indices, seed, options, timeout_ms)
        finally:
            self._ep.flush()

    def recv(self) -> Batch:
        core = self.core
        while True:
            if core.settle():
                self._ep.flush()
            core.expire()
            if core.can_take():
                return core.take()
            self._ep.wait(lambda: bool(core._arrived), core.next_deadline())


class TrioHost(Protocol):
    """What :class:`AsyncPool` needs of the Trio endpoint it serves (so this module does
    not import ``_endpoint``, which imports it)."""

    def _joined(self) -> JoinStream: ...

    def _arm_keepalive(self) -> None: ...

    async def _flush(self) -> None: ...


class AsyncPool:
    """The pool on the Trio endpoint; one task at a time may wait in :meth:`recv`."""

    def __init__(
        self, endpoint: TrioHost, *, batch_size: int | None, autoreset_mode: AutoresetMode
    ) -> None:
        self._ep = endpoint
        state = endpoint._joined()
        self.core = PoolCore(
            state,
            LaneBook(state.contract.num_envs),
            batch_size=batch_size,
            autoreset_mode=autoreset_mode,
            clock=trio.current_time,
        )
        self._receiving = False

    async def send(
        self, actions: Any, env_indices: Sequence[int] | None, timeout_ms: int | None
    ) -> None:
        try:
            self.core.send(actions, env_indices, timeout_ms)
        finally:
            await self._write()

    async def _write(self) -> None:
        self._ep._arm_keepalive()
        await self._ep._flush()

    async def recv(self) -> Batch:
        if self._receiving:
            raise trio.BusyResourceError("another task is already waiting in recv()")
        core = self.core
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint()
            while True:
                if core.settle():
                    await self._write()
                core.expire()
                if core.can_take():
                    return core.take()
                event = trio.Event()
                core.notify = event.set
                try:
                    deadline = core.next_deadline()
                    with trio.move_on_at(math.inf if deadline is None else deadline):
                        await event.wait()
                finally:
                    core.notify = _noop
        finally:
            self._receiving = False
