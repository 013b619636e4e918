"""Round trips of one endpoint's share of a vector's reset or step, driven alone or side
by side with the other endpoints' shares.

An adapter over several endpoints (``VectorEnv``, SB3's ``RemoteVecEnv``) writes its
share of each reset and step as a generator (:data:`Rounds`): it yields the
:class:`Request` of a round trip, gets the answers back, and returns its result.
:func:`run_shares` is the one helper the adapters drive them with. On one endpoint
:func:`run_alone` sends and waits, round after round. Over several,
:func:`run_together` has every share make its first requests before any is sent (a
share that cannot make them raises with nothing sent), writes each round's requests to
every endpoint, and only then reads their answers, so the endpoints work at once.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn, Protocol, TypeVar, cast

from ._blocking import BlockingEndpoint, Submitted
from ._errors import ConnectionLostError, EndpointClosedError, EndpointError, lane_crash
from ._messages import Reply, reset_builder, step_builder

__all__ = [
    "Answer",
    "Request",
    "Rounds",
    "Share",
    "raise_failure",
    "raise_fatal",
    "run_alone",
    "run_shares",
    "run_together",
]

T = TypeVar("T")

Answer = Reply | EndpointError
"""A request's reply, or the error it was answered with."""


@dataclass(frozen=True)
class Request:
    """Requests a share sends together (one write) and whose answers it waits for:
    ``builders[i](request_id) -> bytes`` of kind ``kinds[i]`` addressing ``lanes[i]``."""

    builders: list[Any] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    lanes: list[Sequence[int]] = field(default_factory=list)

    def add(self, builder: Any, kind: str, lanes: Sequence[int]) -> None:
        self.builders.append(builder)
        self.kinds.append(kind)
        self.lanes.append(lanes)

    def step(self, leaves: list[bytes], lanes: list[int], timeout_ms: int, *, whole: bool) -> None:
        """A step of ``lanes`` with their encoded actions; ``whole``: sent as a
        whole-vector step (``lanes`` are every lane of the endpoint), else lane-scoped."""
        built = partial(
            step_builder, leaves=leaves, timeout_ms=timeout_ms, lanes=[] if whole else lanes
        )
        self.add(built, "step", lanes)

    def reset(
        self,
        lanes: list[int],
        timeout_ms: int,
        *,
        whole: bool,
        seeds: list[int] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """A reset of ``lanes`` (``seeds``: the request's, None: unseeded); ``whole``: sent
        as a whole-vector reset (``lanes`` are every lane of the endpoint), else
        lane-scoped."""
        built = partial(
            reset_builder,
            seeds=[] if seeds is None else seeds,
            options=options,
            timeout_ms=timeout_ms,
            lanes=[] if whole else lanes,
        )
        self.add(built, "reset", lanes)


Rounds = Generator[Request, list[Answer], T]
"""One endpoint's share of a reset or a step (see the module's docstring)."""


class Share(Protocol):
    """What :func:`run_shares` needs of one endpoint of an adapter."""

    ep: BlockingEndpoint
    timeout_ms: int

    @property
    def name(self) -> str:
        """The endpoint and its lanes, as a failure names them."""
        ...


def run_shares(
    shares: Sequence[Share], rounds: Sequence[Rounds[T]], close: Callable[[], None]
) -> list[T]:
    """Drive ``rounds[i]`` on ``shares[i]``'s endpoint, all at once; each share's result.

    One share: :func:`run_alone`, its error raised as it is. Several:
    :func:`run_together`, and a failed share's error raised naming its endpoint
    (:func:`raise_failure`: a fatal one calls ``close()`` first)."""
    if len(shares) == 1:
        return [run_alone(shares[0].ep, shares[0].timeout_ms, rounds[0])]
    results, failures = run_together([(s.ep, s.timeout_ms) for s in shares], rounds)
    if failures:
        raise_failure(failures, [s.name for s in shares], close)
    return cast("list[T]", results)


def raise_fatal(answers: Sequence[Answer]) -> None:
    """Raise the first error among a step's ``answers`` that is not a lane crash (a
    crashed lane is an answer: its episode ends, truncated)."""
    for answer in answers:
        if isinstance(answer, EndpointError) and not lane_crash(answer):
            raise answer


def run_alone(ep: BlockingEndpoint, timeout_ms: int, rounds: Rounds[T]) -> T:
    """Drive ``rounds`` on ``ep`` alone; its result."""
    try:
        request = next(rounds)
        while True:
            answers = ep.roundtrip_each(
                request.builders, request.kinds, timeout_ms=timeout_ms, lanes=request.lanes
            )
            request = rounds.send(answers)
    except StopIteration as stop:
        return cast(T, stop.value)


def run_together(
    endpoints: Sequence[tuple[BlockingEndpoint, int]], rounds: Sequence[Rounds[T]]
) -> tuple[list[T | None], dict[int, EndpointError]]:
    """Drive every share at once (``endpoints[i]``: share ``i``'s endpoint and request
    timeout in ms); each share's result, and the errors the failed ones ended with (their
    result None). A failed share stops there; the others run to their end, so no request
    is left unanswered. An error in making the first requests is raised at once, with
    nothing sent."""
    results: list[T | None] = [None] * len(rounds)
    live: dict[int, Request] = {}
    try:
        for i, share in enumerate(rounds):
            try:
                live[i] = next(share)
            except StopIteration as stop:
                results[i] = stop.value
    except BaseException:
        for share in rounds:
            share.close()
        raise
    failures: dict[int, EndpointError] = {}
    while live:
        sent: dict[int, Submitted] = {}
        for i, request in live.items():
            ep, timeout_ms = endpoints[i]
            try:
                sent[i] = ep.submit_each(
                    request.builders, request.kinds, timeout_ms=timeout_ms, lanes=request.lanes
                )
            except EndpointError as exc:
                failures[i] = exc
        live = {}
        for i, submitted in sent.items():
            try:
                live[i] = rounds[i].send(endpoints[i][0].finish(submitted))
            except StopIteration as stop:
                results[i] = stop.value
            except EndpointError as exc:
                failures[i] = exc
    return results, failures


def raise_failure(
    failures: dict[int, EndpointError], names: Sequence[str], close: Callable[[], None]
) -> NoReturn:
    """Raise the first failed share's error, naming its endpoint (``names[i]``). When
    any failure is fatal the adapter cannot go on without those lanes: ``close()``
    first (the other endpoints end their sessions cleanly). A lost connection is raised
    as :class:`ConnectionLostError` saying which endpoint was lost."""
    i = min(failures)
    exc = failures[i]
    if any(not e.is_recoverable for e in failures.values()):
        close()
    if isinstance(exc, ConnectionLostError | EndpointClosedError):
        raise ConnectionLostError(f"{names[i]} was lost: {exc}") from exc
    exc.add_note(f"from {names[i]}")
    raise exc
