"""Seeded differential fuzzing of JoinRequest handling (SPEC §7, §9, §1.10).

The same mutated JoinRequest bytes (:mod:`support.fuzz`) go to the reference server
and to the peer, one message at a time on an open Join, and every outcome must be
equal: which reply arm came back (for an error its code, recoverability and exact
message text; for a step its ``env_indices`` echo), and whether the stream was still
open after it or how it ended (grpc-status, grpc-message). Values, timings and request
ids of successful replies are not compared. The peer is ours or, as a check that the
harness itself is deterministic, a second reference process.

All mismatches of a case are collected and reported together (seed, message index,
hex bytes, both outcomes). Differences that are documented in docs/decisions.md are
excused by the explicit rules in ``support.fuzz.DELIBERATE`` (empty for now).

``RLMESH_FUZZ_COUNT`` is the number of messages per peer, spread over the cases
(default 400; ``nox -s fuzz`` runs 3000); message #i of a case is the same whatever
the count. To see one message again (from ``tests/``)::

    from support import fuzz
    fuzz.generate(seed, index + 1, fuzz.SHAPES[env])[index]
"""

from __future__ import annotations

import math
import os

import pytest
from support import fuzz, wire
from support.params import PEERS
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop]

COUNT = int(os.environ.get("RLMESH_FUZZ_COUNT", "400"))
"""Messages per peer, over all cases."""

CASES = [("cartpole", 1), ("cartpole", 2), ("cartpole", 3), ("nested", 4)]
"""(env, seed): CartPole with 4 lanes, and the nested Dict/Tuple env with 2 lanes."""

PER_CASE = max(1, math.ceil(COUNT / len(CASES)))

SECONDS_PER_MESSAGE = 0.15
"""A generous budget per message (both servers, probe and session restarts included);
measured at about 0.01-0.02 s on a 2-core machine."""

TIMEOUT = 30 + math.ceil(PER_CASE * SECONDS_PER_MESSAGE)
"""Per test: server start-up, then the messages (45 s at the default count)."""


def config(env: str) -> ServerConfig:
    shape = fuzz.SHAPES[env]
    return ServerConfig(entrypoint=fuzz.ENTRYPOINTS[env], num_envs=shape.num_envs)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("env", "seed"), CASES, ids=[f"{env}-seed{seed}" for env, seed in CASES])
@pytest.mark.parametrize("peer", PEERS)
def test_join_request_fuzz(servers: ServerPool, peer: str, env: str, seed: int) -> None:
    shape = fuzz.SHAPES[env]
    messages = fuzz.generate(seed, PER_CASE, shape)
    ref, other = servers.pair(peer, config(env))  # type: ignore[arg-type]
    records, sides, stopped = wire.run(
        fuzz.differential(messages, ref.address, other.address, shape)
    )
    peer_name = "reference#2" if peer == "ref" else "ours"
    mismatches, excused = fuzz.report(records, peer_name)
    equal = len(records) - len(mismatches) - excused
    summary = (
        f"{env} seed {seed}: {equal}/{len(messages)} outcomes equal, {excused} excused by "
        f"DELIBERATE, {len(mismatches)} differ; sessions opened {sides['reference'].reopened} "
        f"(busy retries: reference {sides['reference'].busy_retries}, {peer_name} "
        f"{sides['peer'].busy_retries}). Message #i again: "
        f"fuzz.generate({seed}, {PER_CASE}, fuzz.SHAPES[{env!r}])[i]"
    )
    if stopped is not None:
        mismatches.append(f"HARNESS: {stopped}")
    if mismatches:
        pytest.fail(summary + "\n" + "\n".join(mismatches), pytrace=False)
    assert len(records) == len(messages)
