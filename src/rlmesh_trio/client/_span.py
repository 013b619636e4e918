"""The EnvPool face (``send`` / ``recv``) of a :class:`~rlmesh_trio.client.VectorEnv`
over several endpoints: each endpoint keeps its own lane pool (:class:`._pool.PoolCore`
on its connection); this one routes the vector's lanes to them, waits on every
endpoint's socket at once, and hands out the first ``batch_size`` lanes to finish,
whichever endpoint they are on, in the vector's lane numbers.
"""

from __future__ import annotations

import collections
import selectors
import ssl
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from ._blocking import BlockingConnection, BlockingEndpoint
from ._codecs import ACTION_ERRORS, expand_seeds, invalid_actions, lanes_of
from ._errors import LaneBusyError, LaneError
from ._pool import Batch, BlockingPool, batch_of

__all__ = ["Member", "SpanningPool"]


class Member(Protocol):
    """What the spanning pool needs of one endpoint of the vector."""

    ep: BlockingEndpoint
    pool: BlockingPool
    offset: int
    num_envs: int


class SpanningPool:
    """``send`` / ``async_reset`` / ``recv`` over the lanes of several endpoints."""

    def __init__(
        self, members: Sequence[Member], batch_size: int | None, mode: AutoresetMode
    ) -> None:
        n = sum(m.num_envs for m in members)
        if batch_size is None:
            batch_size = n
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise TypeError(f"batch_size must be an int, not {type(batch_size).__name__}")
        if not 1 <= int(batch_size) <= n:
            raise ValueError(f"batch_size must be in 1..num_envs={n}, got {batch_size}")
        self.members = list(members)
        self.num_envs = n
        self.batch_size = int(batch_size)
        self.mode = mode
        self._order: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        """Every member's finished lanes (member, its lane), in the order they arrived."""

    # ---- checks -----------------------------------------------------------------------

    def _busy(self) -> list[int]:
        return [m.offset + lane for m in self.members for lane in m.pool.core.busy()]

    def check_whole(self, what: str) -> None:
        """``step()`` / ``reset()`` of the whole vector: refused while the pool holds a
        lane (and ``step()`` with a smaller batch)."""
        if what == "step()" and self.batch_size < self.num_envs:
            raise RuntimeError(
                f"step() steps all {self.num_envs} lanes and waits for each; with "
                f"batch_size={self.batch_size} < num_envs use send() and recv()"
            )
        busy = self._busy()
        if busy:
            raise LaneBusyError(
                f"{what}: lanes {busy} have a step in flight or a result not yet "
                "received; recv() them first"
            )

    def _split(self, env_indices: Sequence[int] | None, what: str) -> list[list[tuple[int, int]]]:
        """Each member's share of ``env_indices`` (None: every lane): (position in the
        request, the member's own lane). Busy lanes are refused before anything is sent."""
        lanes = lanes_of(env_indices, self.num_envs) or list(range(self.num_envs))
        clash = sorted(set(self._busy()).intersection(lanes))
        if clash:
            raise LaneBusyError(
                f"{what}: lanes {clash} have a step in flight or a result not yet "
                "received; recv() them first"
            )
        shares: list[list[tuple[int, int]]] = [[] for _ in self.members]
        for position, lane in enumerate(lanes):
            for i, m in enumerate(self.members):
                if m.offset <= lane < m.offset + m.num_envs:
                    shares[i].append((position, lane - m.offset))
                    break
        return shares

    # ---- requests ---------------------------------------------------------------------

    def send(self, actions: Any, env_indices: Sequence[int] | None, timeout_ms: int | None) -> None:
        shares = self._split(env_indices, "send()")
        k = sum(len(share) for share in shares)
        rows = _rows(self.members[0].pool, actions, k)
        for m, share in zip(self.members, shares, strict=True):
            if not share:
                continue
            local = [lane for _, lane in share]
            if isinstance(rows, np.ndarray):
                batch: Any = rows[[position for position, _ in share]]
            else:
                space = m.pool.core.state.contract.action_space
                share_rows = [rows[p] for p, _ in share]
                out: Any = create_empty_array(space, len(share))
                batch = concatenate(space, share_rows, out)
            m.pool.send(batch, local, timeout_ms)

    def reset(
        self,
        env_indices: Sequence[int] | None,
        seed: int | Sequence[int | None] | None,
        options: Mapping[str, Any] | None,
        timeout_ms: int | None,
    ) -> None:
        shares = self._split(env_indices, "async_reset()")
        requested = lanes_of(env_indices, self.num_envs) or list(range(self.num_envs))
        seeds = expand_seeds(seed, requested)  # an int: lane i of the vector gets seed + i
        for m, share in zip(self.members, shares, strict=True):
            if share:
                local = [lane for _, lane in share]
                m.pool.reset(local, [seeds[p] for p, _ in share], options, timeout_ms)

    # ---- replies ----------------------------------------------------------------------

    def recv(self) -> Batch:
        while True:
            self._settle()
            for key in self._order:
                i, lane = key
                core = self.members[i].pool.core
                item = core.ready.get(lane)
                if isinstance(item, BaseException):
                    del core.ready[lane]
                    del self._order[key]
                    if isinstance(item, LaneError):
                        item.env_id = self.members[i].offset + lane
                    raise item
            held = sum(len(m.pool.core.ready) + len(m.pool.core.flights) for m in self.members)
            want = min(self.batch_size, held)
            if want == 0:
                for m in self.members:
                    m.pool.core.state.check_open()
                raise RuntimeError("recv(): no lane is in flight; send() or reset first")
            if len(self._order) >= want:
                return self._take(want)
            self._wait()

    def _settle(self) -> None:
        """Land every member's replies; note the lanes that finished, in order."""
        for i, m in enumerate(self.members):
            core = m.pool.core
            if core.settle():
                m.ep.flush()
            core.expire()
            for lane in core.ready:
                self._order.setdefault((i, lane), None)

    def _take(self, k: int) -> Batch:
        chosen = list(self._order)[:k]
        counts = collections.Counter(i for i, _ in chosen)
        taken: list[tuple[int, Any]] = []
        for i, m in enumerate(self.members):
            if counts[i]:
                for lane, result in m.pool.core.take_results(counts[i]):
                    del self._order[(i, lane)]
                    taken.append((m.offset + lane, result))
        return batch_of(self.members[0].pool.core.state.codecs, taken)

    def _wait(self) -> None:
        """Read whichever members' sockets have data (at most until the earliest
        request deadline); after ``ping_interval`` of silence everywhere, each member
        with lanes in flight is read on its own, which PINGs it (a lost server is found
        as on one endpoint)."""
        waiting = [m for m in self.members if m.pool.core.flights]
        deadlines = [d for m in waiting if (d := m.pool.core.next_deadline()) is not None]
        deadline = min(deadlines) if deadlines else None
        ready = [m for m in waiting if _buffered(m.ep)]
        if not ready:
            interval = min(m.ep.link.ping_interval_seconds for m in waiting)
            limit = interval if deadline is None else max(0.0, deadline - time.monotonic())
            ready = _readable(waiting, min(limit, interval))
            if not ready and (deadline is None or time.monotonic() < deadline):
                ready = waiting  # silence: read each, PINGing it
        for m in ready:
            m.ep.wait(partial(_read_since, m.ep.link, m.ep.link.reads), deadline)


def _rows(pool: BlockingPool, actions: Any, k: int) -> Any:
    """``actions`` for ``k`` lanes: the array itself when the fast codec takes it,
    else one action per lane."""
    codecs = pool.core.state.codecs
    if codecs.fast_action is not None and isinstance(actions, np.ndarray):
        if actions.shape[:1] != (k,):
            raise ValueError(f"expected actions for {k} lanes, got shape {actions.shape}")
        return actions
    try:
        rows = list(iterate(codecs.batched_action_space(k), actions))
    except ACTION_ERRORS as exc:
        raise invalid_actions(exc) from exc
    if len(rows) != k:
        raise ValueError(f"expected actions for {k} lanes, got {len(rows)}")
    return rows


def _read_since(link: BlockingConnection, reads: int) -> bool:
    return link.reads > reads


def _buffered(ep: BlockingEndpoint) -> bool:
    """Data already decrypted and waiting in a TLS socket (select does not see it)."""
    sock = ep.link.sock
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def _readable(members: list[Any], timeout: float) -> list[Any]:
    with selectors.DefaultSelector() as selector:
        for m in members:
            sock = m.ep.link.sock
            if sock is None:
                return [m]  # closed: its wait raises
            selector.register(sock, selectors.EVENT_READ, m)
        return [key.data for key, _ in selector.select(timeout)]
