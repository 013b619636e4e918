"""The clients over a server that rebuilds faulted lanes (issue 19, finding 1): a lane's
fault is CRASHED and recoverable, the endpoint stays open, the other lanes go on, and the
faulted lane's next reset in the same session works. ``VectorEnv`` ends that lane's
episode truncated and resets it at the next step, as gymnasium's autoreset does."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import trio
from gymnasium.vector import AutoresetMode
from support.faulty import HANG, RAISE
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio.client import (
    EndpointError,
    EnvError,
    ErrorCode,
    RequestTimeoutError,
    VectorEnv,
    open_endpoint,
)
from rlmesh_trio.client._codecs import REPLY_GRACE

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

BOUND = 30.0
OK = 0
FAULT = {"error": "RuntimeError: boom on step 1", "lane": 1, "rebuilt": True}


def config(num_envs: int, policy: str = "rebuild") -> ServerConfig:
    return ServerConfig(
        entrypoint="support.faulty:make",
        num_envs=num_envs,
        ours_args=("--on-lane-fault", policy),
    )


async def test_the_trio_endpoint_goes_on_after_a_lane_faults(servers: ServerPool) -> None:
    srv = await trio.to_thread.run_sync(functools.partial(servers.fresh, "ours", config(3)))
    crashed: list[EnvError] = []
    steps = [0, 0, 0]

    async def lane(ep: Any, i: int) -> None:
        await ep.reset(seeds=[10 + i], env_indices=[i])
        for t in range(6):
            action = RAISE if (i == 1 and t == 1) else OK
            try:
                await ep.step(np.array([action]), env_indices=[i])
            except EnvError as exc:
                crashed.append(exc)
                obs, _ = await ep.reset(seeds=[20 + i], env_indices=[i])  # same session
                assert obs[0].tolist() == [0.0, float((20 + i) % 10)]
                continue
            steps[i] += 1

    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(lane, ep, i)
            assert not ep.closed
            # The whole vector steps on: the rebuilt lane was reset above.
            obs, _rew, _term, trunc, _ = await ep.step(np.array([OK, OK, OK]))
            assert obs[1].tolist() == [5.0, 1.0] and not trunc.any()
            episodes = await ep.aclose()
    (error,) = crashed
    assert error.code == ErrorCode.CRASHED and error.is_recoverable
    assert error.message == (
        "step failed: RuntimeError: boom on step 1 (lane 1 faulted and was rebuilt: reset "
        "it to go on)"
    )
    assert error.lane_faults == [FAULT]  # which lane to reset
    assert steps == [6, 5, 6]
    # Close reports every lane's running episode (and the faulted one as interrupted
    # in a step reply, popped above by nobody: it is not repeated here).
    assert sorted((e.env_index, e.seed) for e in episodes) == [(0, 10), (1, 21), (2, 12)]


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
async def test_vector_env_truncates_the_faulted_step_and_goes_on(
    servers: ServerPool, mode: AutoresetMode
) -> None:
    srv = await trio.to_thread.run_sync(functools.partial(servers.fresh, "ours", config(2)))

    def run() -> list[Any]:
        env = VectorEnv(srv.address, autoreset_mode=mode)
        try:
            out: list[Any] = [env.reset(seed=[3, 4])]
            out.append(env.step(np.array([OK, OK])))
            out.append(env.step(np.array([OK, RAISE])))  # lane 1 faults
            out.append(env.step(np.array([OK, OK])))
            out.append(env.step(np.array([OK, OK])))
            return out
        finally:
            env.close()

    with trio.fail_after(BOUND):
        out = await trio.to_thread.run_sync(run)
    _, first, fault, after, again = out
    obs, rewards, terminated, truncated, infos = fault
    # A whole-vector request: both lanes' episodes end truncated on their last observation
    # (lane 0's step result was dropped with the request), lane 1's info names the fault.
    assert truncated.tolist() == [True, True] and not terminated.any()
    assert rewards.tolist() == [0.0, 0.0]
    if mode == AutoresetMode.SAME_STEP:  # the truncated step's info is the final one
        assert infos["_final_info"].tolist() == [True, True]
        infos = infos["final_info"]
    faults = infos["rlmesh_trio.lane_fault"]  # gymnasium batches a dict info key by key
    assert infos["_rlmesh_trio.lane_fault"].tolist() == [False, True]
    assert {key: faults[key][1] for key in FAULT} == FAULT
    if mode == AutoresetMode.NEXT_STEP:
        assert np.array_equal(obs, first[0])
        # The next step resets both lanes (seedless: the envs go on from their seeds),
        # then they step again.
        assert after[0][:, 0].tolist() == [0.0, 0.0] and after[1].tolist() == [0.0, 0.0]
        assert again[0][:, 0].tolist() == [1.0, 1.0] and not again[3].any()
    else:
        assert obs[:, 0].tolist() == [0.0, 0.0]  # reset in the same step
        assert after[0][:, 0].tolist() == [1.0, 1.0] and not after[3].any()


@pytest.mark.parametrize("kind", ["ref", "ours"])
async def test_a_call_never_waits_past_its_deadline_plus_the_grace(
    servers: ServerPool, kind: str
) -> None:
    """Issue 19, finding 7: against a server that answers PINGs but not a step (the
    reference with a hung env), ``step(timeout_ms=...)`` blocked until killed. Now the
    client gives up at ``timeout_ms`` plus its grace: RequestTimeoutError, recoverable,
    the endpoint open. (Our server answers its own TIMEOUT first.)"""
    cfg = ServerConfig(
        entrypoint="support.faulty:make",
        env=(("RLMESH_FAULTY_HANG_SECONDS", "8"),),
    )
    srv = await trio.to_thread.run_sync(functools.partial(servers.fresh, kind, cfg))
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset(seeds=[1])
            t0 = trio.current_time()
            with pytest.raises(EndpointError) as caught:
                await ep.step(np.array([HANG]), timeout_ms=300)
            waited = trio.current_time() - t0
            assert caught.value.code == ErrorCode.TIMEOUT and caught.value.is_recoverable
            assert not ep.closed
    assert waited < 0.3 + REPLY_GRACE + 2.0, waited
    if kind == "ref":
        assert isinstance(caught.value, RequestTimeoutError), caught.value
        assert "within 300ms plus the client's" in caught.value.message


def test_vector_env_never_waits_past_its_request_timeout(servers: ServerPool) -> None:
    cfg = ServerConfig(
        entrypoint="support.faulty:make",
        env=(("RLMESH_FAULTY_HANG_SECONDS", "8"),),
    )
    srv = servers.fresh("ref", cfg)
    env = VectorEnv(srv.address, request_timeout_seconds=0.3)
    try:
        env.reset(seed=1)
        with pytest.raises(RequestTimeoutError):
            env.step(np.array([HANG]))
    finally:
        env.close()
