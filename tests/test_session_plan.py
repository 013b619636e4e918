"""Request planning (SPEC §7.2, §7.4-§7.6, §7.10, §7.11) as tables: a request and a lane
count in, a plan or a refusal out. The texts are the reference's (the session tests and
the differential suite check them on the wire)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from rlmesh_trio._codec import SpaceCodec
from rlmesh_trio._errors import ActionError
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._session._plan import (
    Refusal,
    RenderPlan,
    ResetPlan,
    StepPlan,
    check_indices,
    deadline_ms,
    plan_configure,
    plan_render,
    plan_reset,
    plan_step,
)
from rlmesh_trio._wire._decode import Clipped

Code = env_v1.EnvErrorCode
ACTION = spaces_v1.SpaceValue(leaves=[b"\x00" * 16])
CODEC = SpaceCodec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
"""Checks the rows of a step: ACTION is two good rows of it."""


def still() -> int:
    return 0


def invalid(message: str) -> Refusal:
    return Refusal(Code.INVALID_ACTION, message)


@pytest.mark.parametrize(
    ("indices", "num_envs", "expected"),
    [
        ([], 2, None),
        ([1, 0], 2, None),
        ([2], 2, "p: env_index 2 out of range for num_envs 2"),
        ([4294967295], 1, "p: env_index 4294967295 out of range for num_envs 1"),
        ([0, 0], 2, "p: duplicate env_index 0"),
        ([1, 1, 5], 2, "p: duplicate env_index 1"),  # the first problem met speaks
        ([5, 1, 1], 2, "p: env_index 5 out of range for num_envs 2"),
    ],
)
def test_check_indices(indices: Sequence[int], num_envs: int, expected: str | None) -> None:
    assert check_indices("p", indices, num_envs) == expected


def partial(count: int, list_name: str, given: int, noun: str) -> str:
    return (
        f"partial reset: {list_name} length {given} does not match env_indices length {count} "
        f"(provide one {noun} per reset lane, or none)"
    )


@pytest.mark.parametrize(
    ("fields", "num_envs", "expected"),
    [
        pytest.param({}, 2, ResetPlan([0, 1], True, [None, None], ["", ""]), id="whole"),
        pytest.param(
            dict(seeds=[7], episode_ids=["a", "b", "c"]),
            2,
            ResetPlan([0, 1], True, [7, None], ["a", "b"]),
            id="whole: positional, short lists padded, long ones cut",
        ),
        pytest.param(
            dict(env_indices=[1], seeds=[3], episode_ids=["x"]),
            2,
            ResetPlan([1], False, [3], ["x"]),
            id="partial",
        ),
        pytest.param(
            dict(env_indices=[2, 0]),
            3,
            ResetPlan([2, 0], False, [None, None], ["", ""]),
            id="partial: the request's order",
        ),
        pytest.param(
            dict(env_indices=[0, 1], seeds=[1]),
            2,
            invalid(partial(2, "seeds", 1, "seed")),
            id="seeds length",
        ),
        pytest.param(
            dict(env_indices=[0, 1], episode_ids=["x"]),
            2,
            invalid(partial(2, "episode_ids", 1, "episode id")),
            id="episode_ids length",
        ),
        pytest.param(
            dict(env_indices=[0, 0], seeds=[1], episode_ids=["x"]),
            2,
            invalid(partial(2, "seeds", 1, "seed")),
            id="the lists speak before the indices, seeds first",
        ),
        pytest.param(
            dict(env_indices=[0, 0]),
            2,
            invalid("partial reset: duplicate env_index 0"),
            id="duplicate",
        ),
        pytest.param(
            dict(env_indices=[3], seeds=[1]),
            2,
            invalid("partial reset: env_index 3 out of range for num_envs 2"),
            id="out of range",
        ),
        pytest.param(
            dict(env_indices=[0], seeds=Clipped([1, 2], 70_000)),
            2,
            invalid(partial(1, "seeds", 70_000, "seed")),
            id="a clipped list counts at its full length",
        ),
    ],
)
def test_plan_reset(fields: dict[str, Any], num_envs: int, expected: object) -> None:
    assert plan_reset(env_v1.ResetRequest(**fields), num_envs) == expected


@pytest.mark.parametrize(
    ("fields", "num_envs", "expected"),
    [
        pytest.param(
            dict(action=ACTION),
            2,
            StepPlan([0, 1], True, ACTION.leaves, validate=True),
            id="whole: every row checked first",
        ),
        pytest.param(
            dict(action=ACTION),
            1,
            StepPlan([0], True, ACTION.leaves, validate=False),
            id="whole on one lane: the lane checks its row",
        ),
        pytest.param(
            dict(action=ACTION, env_indices=[1]),
            3,
            StepPlan([1], False, ACTION.leaves, validate=False),
            id="one lane",
        ),
        pytest.param(
            dict(action=ACTION, env_indices=[2, 0]),
            3,
            StepPlan([2, 0], False, ACTION.leaves, validate=True),
            id="subset: the request's order",
        ),
        pytest.param({}, 2, invalid("expected 2 actions, got 0"), id="no action"),
        pytest.param(
            dict(env_indices=[1]),
            2,
            invalid("expected 1 actions, got 0"),
            id="no action, one lane",
        ),
        pytest.param(
            dict(env_indices=[1, 1]),
            2,
            invalid("subset step: duplicate env_index 1"),
            id="the indices speak before the action",
        ),
        pytest.param(
            dict(action=ACTION, env_indices=[5]),
            2,
            invalid("subset step: env_index 5 out of range for num_envs 2"),
            id="out of range",
        ),
    ],
)
def test_plan_step(fields: dict[str, Any], num_envs: int, expected: object) -> None:
    assert plan_step(env_v1.StepRequest(**fields), num_envs, CODEC, still) == expected


def test_plan_step_checks_every_row_of_several_and_times_the_check() -> None:
    """Several rows are the codec's to check before any lane steps (its text refuses a
    bad one); the check's time is the plan's ``pre_decode_ns``. One row is its lane's."""
    clock = itertools.count(0, 7).__next__
    plan = plan_step(env_v1.StepRequest(action=ACTION), 2, CODEC, clock)
    assert plan == StepPlan([0, 1], True, ACTION.leaves, validate=True, pre_decode_ns=7)
    bad = spaces_v1.SpaceValue(leaves=[b"\x00" * 12])  # a slab one row and a half long
    with pytest.raises(ActionError) as raised:
        CODEC.validate_action(bad.leaves, 2)
    refused = plan_step(env_v1.StepRequest(action=bad), 2, CODEC, clock)
    assert refused == invalid(str(raised.value))
    one = plan_step(env_v1.StepRequest(action=bad, env_indices=[1]), 2, CODEC, clock)
    assert one == StepPlan([1], False, bad.leaves, validate=False)


@pytest.mark.parametrize(
    ("indices", "num_envs", "expected"),
    [
        ([], 2, RenderPlan(0)),
        ([0], 2, RenderPlan(0)),
        ([1], 2, invalid("single-env render only supports env_index 0, got 1")),
        # Past the lanes: the lane engine's fatal INTERNAL, as the reference's.
        ([2], 2, RenderPlan(2)),
        ([1], 1, RenderPlan(1)),
        ([0, 0], 2, Refusal(Code.UNSUPPORTED, "render requests support at most one env_index")),
        ([5, 1], 2, Refusal(Code.UNSUPPORTED, "render requests support at most one env_index")),
    ],
)
def test_plan_render(indices: list[int], num_envs: int, expected: object) -> None:
    assert plan_render(env_v1.RenderRequest(env_indices=indices), num_envs) == expected


def test_plans_copy_the_request_lists() -> None:
    """A plan's lists are its own, not the request message's (the session's Op keeps
    them)."""
    body = env_v1.StepRequest(action=ACTION, env_indices=[1, 0])
    plan = plan_step(body, 2, CODEC, still)
    assert isinstance(plan, StepPlan)
    assert plan.lanes is not body.env_indices and plan.leaves is not ACTION.leaves
    reset_body = env_v1.ResetRequest(env_indices=[1])
    reset = plan_reset(reset_body, 2)
    assert isinstance(reset, ResetPlan)
    assert reset.lanes == [1] and reset.lanes is not reset_body.env_indices


def unimplemented(shown: str) -> Refusal:
    return invalid(
        f"runtime pinned this env to workflow edition {shown}, which this env build does not "
        'implement (implements ["2026.06"])'
    )


@pytest.mark.parametrize(
    ("edition", "expected"),
    [
        ("", None),
        ("2026.06", None),
        (" 2026.06\u3000", None),  # trimmed of Unicode whitespace, as Rust's str::trim
        ("2026.06-dev.abc", None),  # a cohort spelling
        ("1999.01", unimplemented('"1999.01"')),
        ("2026.06x", unimplemented('"2026.06x"')),
        ("a\tb", unimplemented('"a\\tb"')),  # shown as Rust's {:?} shows it
    ],
)
def test_plan_configure(edition: str, expected: Refusal | None) -> None:
    body = env_v1.ConfigureEnvRequest(selected_workflow_edition=edition)
    assert plan_configure(body, "2026.06") == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(reset=env_v1.ResetRequest()), 0),  # set although all-default (falsy)
        (dict(reset=env_v1.ResetRequest(timeout_ms=5)), 5),
        (dict(step=env_v1.StepRequest(timeout_ms=7, env_indices=[0])), 7),
        (dict(render=env_v1.RenderRequest(timeout_ms=9)), 9),
        (dict(close=env_v1.CloseEnvsRequest()), 0),
        (dict(configure=env_v1.ConfigureEnvRequest()), 0),
        ({}, 0),
    ],
)
def test_deadline_ms(fields: dict[str, Any], expected: int) -> None:
    assert deadline_ms(env_v1.JoinRequest(request_id="r", **fields)) == expected
