"""An env's answers read as the reference reads them, end to end through our client, on
thread and process lanes: legacy Gym's four step values, a ``numpy.bool_`` flag, an
info of None (the reply then carries none, and the client gives empty infos), a reset
that returns the observation alone, and reset signatures without ``seed`` or
``options``. The wire answers themselves are compared with the reference's in
tests/reference/test_error_rows.py (the ``env-answer-*`` and ``reset-*`` rows)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio
from support import envs
from support.serving import served

from rlmesh_trio._lanes._work import real_number, reset_parts, step_flag, step_parts
from rlmesh_trio.client import Env, EnvError, VectorEnv

pytestmark = pytest.mark.timeout(120)

ISOLATION = ["thread", pytest.param("process", id="process-lanes")]


@pytest.mark.parametrize("isolation", ISOLATION)
async def test_odd_but_valid_answers_reach_the_client(isolation: str) -> None:
    async with served(envs.make_answers, 2, lane_isolation=isolation) as address:

        def drive() -> list[Any]:
            seen: list[Any] = []
            env = VectorEnv(address)
            try:
                _, info = env.reset(seed=1, options={"step": "info-none"})
                seen.append(info)
                seen.append(env.step(np.array([1, 0]))[1:])
                _, info = env.reset(
                    seed=2, options={"step": "legacy-time-limit", "reset": "info-none"}
                )
                seen.append(info)
                seen.append(env.step(np.array([1, 0]))[1:])
                env.reset(seed=3, options={"step": "np-bool-flag", "reset": "obs-only"})
                seen.append(env.step(np.array([0, 1]))[1:])
            finally:
                env.close()
            return seen

        seen = await trio.to_thread.run_sync(drive)
    reset_info, step, none_info, legacy, np_bool = seen
    assert list(reset_info["seed"]) == [1, 2]
    rewards, terminated, truncated, info = step
    assert rewards.tolist() == [1.0, 1.0] and not terminated.any() and not truncated.any()
    assert info == {}  # no lane's env gave an info: the reply has none
    assert none_info == {}
    _, terminated, truncated, info = legacy  # legacy Gym: done + TimeLimit.truncated
    assert not terminated.any() and truncated.all()
    assert info["TimeLimit.truncated"].tolist() == [True, True]
    _, terminated, truncated, _ = np_bool
    assert terminated.all() and not truncated.any()


@pytest.mark.parametrize("isolation", ISOLATION)
async def test_a_bad_answer_is_the_references_error_and_an_unprintable_one_too(
    isolation: str,
) -> None:
    async with served(envs.make_answers, 1, lane_isolation=isolation) as address:

        def drive(kind: str) -> str:
            with Env(address) as env:
                env.reset(seed=1, options={"step": kind})
                with pytest.raises(EnvError) as caught:
                    env.step(1)
                return str(caught.value)

        texts = {
            kind: await trio.to_thread.run_sync(drive, kind)
            for kind in (
                "int-flag",
                "str-reward",
                "six",
                "unprintable-exception",
                "nested-exception",
            )
        }
    assert "step failed: TypeError: 'int' object is not an instance of 'bool'" in texts["int-flag"]
    assert "step failed: TypeError: must be real number, not str" in texts["str-reward"]
    assert "env.step() must return 4 legacy Gym values or 5 Gymnasium values, got 6" in texts["six"]
    assert "step failed: Unprintable: <exception str() failed>" in texts["unprintable-exception"]
    assert "step failed: Outer.Inner: inner" in texts["nested-exception"]


async def test_reset_passes_what_the_request_carries(caplog: pytest.LogCaptureFixture) -> None:
    async with served(envs.make_seed_only_reset, 1) as address:

        def drive() -> dict[str, Any]:
            with Env(address) as env:
                _, info = env.reset(seed=7, options={"a": 1})  # options dropped, warned
                return info

        with caplog.at_level(logging.WARNING, logger="rlmesh_trio.lanes"):
            info = await trio.to_thread.run_sync(drive)
    assert info == {"seed_seen": "7"}
    assert any("takes no options" in r.getMessage() for r in caplog.records)


def test_the_readers_alone() -> None:
    obs = np.zeros(2, np.float32)
    assert step_flag(np.bool_(False)) is False
    with pytest.raises(TypeError, match="'None' is not an instance of 'bool'"):
        step_flag(None)
    assert real_number(np.float32(0.5)) == 0.5 and real_number(3) == 3.0
    assert real_number(True) == 1.0
    with pytest.raises(TypeError, match="must be real number, not complex"):
        real_number(1j)
    assert step_parts((obs, 1, True, {})) == (obs, 1.0, True, False, {})
    assert step_parts((obs, 1, True, {"TimeLimit.truncated": True}))[2:4] == (False, True)
    assert step_parts((obs, 1, False, {"TimeLimit.truncated": True}))[2:4] == (False, False)
    with pytest.raises(TypeError, match="'list' object is not an instance of 'tuple'"):
        step_parts([obs, 1.0, False, False, {}])
    assert reset_parts(obs) == (obs, {})
    assert reset_parts((obs,)) == ((obs,), {})
    assert reset_parts((obs, None)) == (obs, None)
    pair = (obs, {"k": 1})  # a Tuple(Box, Dict) observation returned alone
    assert reset_parts(pair, pair_space=True) == (pair, {})
    assert reset_parts(((obs, {"k": 1}), {}), pair_space=True) == ((obs, {"k": 1}), {})
