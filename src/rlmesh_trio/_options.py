"""Server options (the lifecycle knobs of rlmesh's ``ServeOptions``, plus ours)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Policy = Literal["warn", "strict", "off"]
"""How soft conformance violations are handled (SPEC §3.7.8)."""

WORKFLOW_EDITION = "2026.06"
"""The only workflow edition rlmesh-wire-v1 0.1.0 implements."""

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Per-message size limit, both directions (SPEC §1.8)."""

DEFAULT_CLOSE_TIMEOUT = 5.0
"""Seconds the lanes get, together, to close their envs at server stop."""

DEFAULT_DRAIN_TIMEOUT = 5.0
"""Seconds in-flight requests get to finish after a shutdown was requested."""


@dataclass(frozen=True)
class ServeOptions:
    """How a server behaves over its lifetime. Every field has the reference's default.

    ``allow_remote_shutdown``: accept the Shutdown RPC (also enabled by the
    environment variable ``RLMESH_ALLOW_REMOTE_SHUTDOWN=1|true``).
    ``idle_timeout_seconds``: stop after this long without Join activity (None: never).
    ``drain_timeout_seconds``: at stop, how long in-flight requests may still finish.
    ``close_timeout_seconds``: at stop, how long the lanes together may take to close
    their envs; a lane still stuck after that is abandoned (and named in the log).
    ``workflow_edition``: the edition the endpoint declares (only ``"2026.06"`` exists).
    ``validation_policy``: ``warn``/``strict``/``off``; None reads
    ``RLMESH_VALIDATION_POLICY`` from the environment like the reference.
    """

    allow_remote_shutdown: bool = False
    idle_timeout_seconds: float | None = None
    drain_timeout_seconds: float | None = None
    close_timeout_seconds: float | None = None
    workflow_edition: str | None = None
    validation_policy: Policy | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def remote_shutdown_allowed(self, environ: Mapping[str, str] = os.environ) -> bool:
        """The option, or the environment variable (which can only enable it)."""
        if self.allow_remote_shutdown:
            return True
        value = environ.get("RLMESH_ALLOW_REMOTE_SHUTDOWN", "")
        return value.strip().lower() in ("1", "true")

    def resolved_policy(self, environ: Mapping[str, str] = os.environ) -> Policy:
        """The explicit policy, or the one ``RLMESH_VALIDATION_POLICY`` names."""
        if self.validation_policy is not None:
            return self.validation_policy
        return policy_from_env(environ)


def policy_from_env(environ: Mapping[str, str] = os.environ) -> Policy:
    """``strict`` and ``off`` (any case) select those; anything else means ``warn``."""
    value = environ.get("RLMESH_VALIDATION_POLICY", "").strip().lower()
    if value == "strict":
        return "strict"
    if value == "off":
        return "off"
    return "warn"
