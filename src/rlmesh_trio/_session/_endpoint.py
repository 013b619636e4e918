"""Server-wide state shared by every Join of one server: :class:`Endpoint`.

It holds the env contract, the conformance ledger (SPEC §3.7.6) and the editions, and
answers Handshake (SPEC §6) and Shutdown (SPEC §10.1-10.2). Sans-IO, like the session.
"""

from __future__ import annotations

import dataclasses
import itertools
import platform
import sys
from collections.abc import Callable, Sequence

from .._codec import Candidate
from .._errors import InvalidRequestError
from .._jobs import EnvContract
from .._options import DEFAULT_CLOSE_TIMEOUT, FaultPolicy, Policy
from .._proto.rlmesh.core import v1 as core_v1
from .._proto.rlmesh.env import v1 as env_v1
from .._version import __version__
from .._wire._protocol import PROTOCOL_GENERATION, WORKFLOW_EDITION

LANE_STATES_KEY = "rlmesh_trio.lane_states"
"""Handshake ``peer_info.extra`` key: every lane's supervision state, comma-separated in
lane order (``serving,rebuilding,serving``), as ``rlmesh-trio probe`` shows them."""


class ConformanceLedger:
    """The (kind, path) pairs already reported, per lane and server-wide (SPEC §3.7.6).

    Lives as long as the server: not cleared by resets, Close or a new Join.
    """

    def __init__(self, num_envs: int) -> None:
        self.lanes: list[set[tuple[str, str]]] = [set() for _ in range(num_envs)]
        self.server: set[tuple[str, str]] = set()

    def place(
        self, lanes: Sequence[int], candidates: Sequence[Sequence[Candidate]]
    ) -> tuple[list[list[Candidate]], list[Candidate]]:
        """Apply de-duplication for one reply (SPEC §3.7.7).

        ``candidates[i]`` are lane ``lanes[i]``'s candidates, action first. Returns each
        lane's surviving list R(i) and the reply-level list N of server-new pairs.
        """
        survivors: list[list[Candidate]] = []
        for lane, cands in zip(lanes, candidates, strict=True):
            seen = self.lanes[lane]
            kept = []
            for cand in cands:
                key = (cand.kind, cand.path)
                if key not in seen:
                    seen.add(key)
                    kept.append(cand)
            survivors.append(kept)
        fresh: list[Candidate] = []
        new_keys: set[tuple[str, str]] = set()
        for kind in ("action", "observation"):
            for kept in survivors:
                for cand in kept:
                    key = (cand.kind, cand.path)
                    if cand.kind == kind and key not in self.server and key not in new_keys:
                        new_keys.add(key)
                        fresh.append(cand)
        self.server |= new_keys
        return survivors, fresh


def _peer_info() -> core_v1.PeerInfo:
    import gymnasium
    import numpy

    return core_v1.PeerInfo(
        component="rlmesh-env",
        package_version=__version__,
        language="python",
        language_version=platform.python_version(),
        os=sys.platform if sys.platform != "darwin" else "macos",
        os_version=platform.release(),
        arch=platform.machine(),
        framework_versions={"gymnasium": gymnasium.__version__, "numpy": numpy.__version__},
        extra={
            "rlmesh.workflow.base": WORKFLOW_EDITION,
            "rlmesh.workflow.edition": WORKFLOW_EDITION,
            "rlmesh.build.cohort": "stable",
            "rlmesh.build.source": "release",
            "rlmesh.server.implementation": f"rlmesh-trio {__version__}",
        },
    )


class Endpoint:
    """Server-wide state: one per server, shared by its successive Join sessions.

    Not thread-safe: used from the transport loop only.
    """

    def __init__(
        self,
        contract: EnvContract,
        num_envs: int,
        *,
        policy: Policy = "warn",
        workflow_edition: str | None = None,
        allow_remote_shutdown: bool = False,
        on_lane_fault: FaultPolicy = "error",
        close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
        lane_states: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        # Validated once, by _options.resolve(); None means the only edition there is.
        edition = workflow_edition or WORKFLOW_EDITION
        self.contract = contract
        self.num_envs = num_envs
        self.policy: Policy = policy
        self.edition = edition
        self.allow_remote_shutdown = allow_remote_shutdown
        self.on_lane_fault: FaultPolicy = on_lane_fault
        """How the sessions answer a faulted lane (``truncate``: as a truncation)."""
        self.close_timeout = close_timeout
        self.lane_states = lane_states
        """How long a Close waits for lane jobs still running before it is answered."""
        self.ledger = ConformanceLedger(num_envs)
        self.tokens = itertools.count(1)
        """Job and timer tokens, unique over every session of this endpoint: the transport
        routes a lane reply to its session by the job's id, so a late reply of an ended
        session can never be taken for one of the next session's jobs."""
        self.peer_info = _peer_info()
        self.env_contract = core_v1.EnvContract(
            spec=core_v1.EnvSpec(
                id=contract.env_id,
                action_space=contract.action_codec.spec,
                observation_space=contract.observation_codec.spec,
                metadata=contract.metadata,
            ),
            num_envs=num_envs,
            render_mode=contract.render_mode,
            autoreset_mode=core_v1.AutoresetMode.DISABLED,
        )

    def handshake(self, request: env_v1.HandshakeRequest) -> env_v1.HandshakeResponse:
        """Answer a Handshake (SPEC §6). A generation mismatch is an answer, not an error.

        Raises InvalidRequestError("handshake request missing base").
        """
        base = request.base
        if base is None:
            raise InvalidRequestError("handshake request missing base")
        peer_info = self.peer_info
        if self.lane_states is not None:
            extra = {**peer_info.extra, LANE_STATES_KEY: ",".join(self.lane_states())}
            peer_info = dataclasses.replace(peer_info, extra=extra)
        reply = core_v1.HandshakeResponse(
            peer_info=peer_info,
            capabilities={"subset_step": "true"},
            supported_workflow_editions=[self.edition],
            preferred_workflow_edition=self.edition,
        )
        if base.protocol_generation != PROTOCOL_GENERATION:
            reply.error_message = (
                f"protocol generation {base.protocol_generation} not compatible with server "
                f"{PROTOCOL_GENERATION}"
            )
            return env_v1.HandshakeResponse(base=reply)
        reply.compatible = True
        return env_v1.HandshakeResponse(base=reply, env_contract=self.env_contract)

    def shutdown(self, request: env_v1.ShutdownRequest) -> tuple[env_v1.ShutdownResponse, bool]:
        """Answer a Shutdown (SPEC §10.1-10.2); the bool says whether the server must stop.

        Raises InvalidRequestError("shutdown request missing base").
        """
        base = request.base
        if base is None:
            raise InvalidRequestError("shutdown request missing base")
        if not self.allow_remote_shutdown:
            message = "remote shutdown is disabled for this environment endpoint"
            return env_v1.ShutdownResponse(base=core_v1.ShutdownResponse(message=message)), False
        message = f"shutdown accepted: {base.reason}" if base.reason else "shutdown accepted"
        response = core_v1.ShutdownResponse(accepted=True, message=message)
        return env_v1.ShutdownResponse(base=response), True
