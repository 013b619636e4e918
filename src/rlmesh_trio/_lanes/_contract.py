"""What a lane's env serves, and the check that every lane serves lane 0's contract."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import gymnasium as gym

from .._codec import SpaceCodec, from_meta_map, space_to_spec, to_meta_map
from .._errors import ContractMismatchError
from .._jobs import EnvContract
from .._proto.rlmesh.spaces import v1 as spaces_v1

UNKNOWN_ENV_ID: Final = "UnknownEnv-v1"
"""The env id served for an env without a gymnasium spec (SPEC §4.8)."""


@dataclass(frozen=True)
class EnvFacts:
    """What one lane would serve, computed on the lane's own thread."""

    env_id: str
    action_space: gym.spaces.Space[Any]
    observation_space: gym.spaces.Space[Any]
    action_spec: bytes
    observation_spec: bytes
    metadata: spaces_v1.MetaMap
    metadata_value: dict[str, object]
    render_mode: str


def lane_facts(env: gym.Env[Any, Any]) -> EnvFacts:
    spec = getattr(env, "spec", None)
    env_id = getattr(spec, "id", None) if spec is not None else None
    action_space = env.action_space
    observation_space = env.observation_space
    # The metadata is served as it is. Checked against rlmesh 0.1.0: it does not drop an
    # ``autoreset_mode`` entry (an env whose metadata holds AutoresetMode.NEXT_STEP is served
    # with ``autoreset_mode: "NextStep"`` and an AUTORESET_MODE_DISABLED contract), and
    # gymnasium 1.4's vector envs copy the metadata before adding that key, so building a
    # vector env in the same process leaves a scalar env's class-level metadata alone.
    raw_metadata = getattr(env, "metadata", None)
    metadata = to_meta_map(dict(raw_metadata) if raw_metadata else {})
    render_mode = getattr(env, "render_mode", None)
    return EnvFacts(
        env_id=env_id if isinstance(env_id, str) and env_id else UNKNOWN_ENV_ID,
        action_space=action_space,
        observation_space=observation_space,
        action_spec=bytes(space_to_spec(action_space)),
        observation_spec=bytes(space_to_spec(observation_space)),
        metadata=metadata,
        metadata_value=from_meta_map(metadata),
        render_mode=render_mode if isinstance(render_mode, str) else "",
    )


def _same_meta(a: object, b: object) -> bool:
    """Equality of decoded MetaMap values: exact types (``True`` is not ``1``), NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(_same_meta(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def contract_differences(lane0: EnvFacts, other: EnvFacts) -> list[str]:
    diffs: list[str] = []
    if other.env_id != lane0.env_id:
        diffs.append(f"env_id {other.env_id!r} != {lane0.env_id!r}")
    if other.action_spec != lane0.action_spec:
        diffs.append(f"action_space {other.action_space} != {lane0.action_space}")
    if other.observation_spec != lane0.observation_spec:
        diffs.append(f"observation_space {other.observation_space} != {lane0.observation_space}")
    if not _same_meta(other.metadata_value, lane0.metadata_value):
        diffs.append(f"metadata {other.metadata_value!r} != {lane0.metadata_value!r}")
    if other.render_mode != lane0.render_mode:
        diffs.append(f"render_mode {other.render_mode!r} != {lane0.render_mode!r}")
    return diffs


def agree(facts: list[EnvFacts]) -> EnvContract:
    """What every lane serves: lane 0's facts, when every other lane agrees with them.

    Raises :class:`~rlmesh_trio._errors.ContractMismatchError` naming the first lane that
    disagrees, or the codec's error for a space rlmesh-wire-v1 cannot express.
    """
    lane0 = facts[0]
    for index, other in enumerate(facts[1:], start=1):
        diffs = contract_differences(lane0, other)
        if diffs:
            raise ContractMismatchError(
                f"lane {index} disagrees with lane 0 on the env contract: {'; '.join(diffs)}"
            )
    return EnvContract(
        env_id=lane0.env_id,
        action_space=lane0.action_space,
        observation_space=lane0.observation_space,
        action_codec=SpaceCodec(lane0.action_space),
        observation_codec=SpaceCodec(lane0.observation_space),
        metadata=lane0.metadata,
        render_mode=lane0.render_mode,
    )
