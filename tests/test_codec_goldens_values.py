"""The codec against every captured value of the rlmesh 0.1.0 goldens (SPEC §3, §3.6, §3.7).

For each Join stream of a capture, requests are paired with their replies (by request_id,
in order) and:

* every observation slab in a reply decodes, and re-encodes (batched, and lane by lane then
  joined) to exactly the captured bytes;
* every action slab the reference accepted passes our validation and decodes to what the
  env saw (the captured ``action_seen`` / ``action_repr`` infos), and re-encodes to the
  captured bytes (MultiBinary bytes coerced to 0/1);
* every INVALID_ACTION text the codec is responsible for is reproduced from the captured
  leaves;
* every ``rlmesh.conformance.warning`` entry of a lane equals our soft-check candidate for
  that lane's decoded value (absent when we find none);
* the observation hard errors (fatal INTERNAL) and the strict-policy texts of
  conformance_* are reproduced from hand-built values of the captured cases.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from rlmesh_trio._codec import Candidate, SpaceCodec, spec_to_space
from rlmesh_trio._errors import ActionError
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

S = gym.spaces
GOLDENS = Path(__file__).resolve().parent / "goldens"
WARNING_KEY = "rlmesh.conformance.warning"
Code = env_v1.EnvErrorCode


@cache
def records(scenario: str) -> tuple[dict[str, Any], ...]:
    with (GOLDENS / f"{scenario}.jsonl").open(encoding="utf-8") as stream:
        return tuple(json.loads(line) for line in stream if line.strip())


@cache
def captured_contract(scenario: str) -> tuple[spaces_v1.SpaceSpec, spaces_v1.SpaceSpec, int] | None:
    """(action spec, observation spec, num_envs) from the scenario's own handshake."""
    for record in records(scenario):
        if record.get("msg_type") == "env.HandshakeResponse" and "hex" in record:
            contract = env_v1.HandshakeResponse.parse(bytes.fromhex(record["hex"])).env_contract
            if contract is not None and contract.spec is not None:
                return (
                    contract.spec.action_space,
                    contract.spec.observation_space,
                    contract.num_envs,
                )
    return None


# Captures made without a Handshake: the same env as another capture (the scenario the
# contract comes from, and the endpoint's lane count), or an env the driver names.
BORROWED: dict[str, tuple[str, int]] = {
    "cartpole_truncation": ("cartpole_scalar", 1),
    "lanes_extra": ("errors_lanes2", 2),
    "signedness": ("errors_lanes2", 2),
    "lane_reset_options": ("mixed_codec", 2),
    "probe_text_lanes2": ("probe_spaces_text_info", 2),
    "conformance_action_checks": ("conformance_scalar", 25),
    "conformance_obs_checks": ("conformance_scalar", 56),
    "conformance_lanes3": ("conformance_scalar", 3),
    "conformance_lanes2_single_lane_replies": ("conformance_scalar", 2),
    "conformance_policy_off": ("conformance_scalar", 2),
    "conformance_policy_strict": ("conformance_scalar", 2),
}
ECHO_SPACES: dict[str, tuple[Any, int]] = {
    # EchoEnv: observation = action, same space (driver/conformance_echo.driver.json).
    "conformance_echo_box2d": (S.Box(0, 1, (2, 2), np.float32), 1),
    "conformance_echo_tuple": (
        S.Tuple(
            (
                S.Box(-1, 1, (1,), np.float32),
                S.Text(3, min_length=1, charset="ab"),
                S.Tuple((S.MultiDiscrete([2]),)),
            )
        ),
        1,
    ),
    "conformance_echo_mb": (S.MultiBinary(3), 1),
    "conformance_vector_server": (S.Box(-1, 1, (3,), np.float32), 2),
}
THIRD_PARTY = ("fake_server_", "grpclib_server_")
VECTOR_SERVER = (
    "client_vector_server_sync3",
    "client_run_vector_server_sync3",
    "conformance_vector_server",
)
"""Natively served vector envs: warnings sit at the vector level, not per lane (§3.7.7)."""


@dataclass(frozen=True)
class Setup:
    action: SpaceCodec
    observation: SpaceCodec
    num_envs: int


@cache
def setup(scenario: str) -> Setup | None:
    if scenario in ECHO_SPACES:
        space, num_envs = ECHO_SPACES[scenario]
        codec = SpaceCodec(space)
        return Setup(codec, codec, num_envs)
    if scenario in BORROWED:
        source, num_envs = BORROWED[scenario]
        contract = captured_contract(source)
        assert contract is not None
        return Setup(SpaceCodec.from_spec(contract[0]), SpaceCodec.from_spec(contract[1]), num_envs)
    contract = captured_contract(scenario)
    if contract is None:
        return None
    action, observation, num_envs = contract
    return Setup(
        SpaceCodec(spec_to_space(action)), SpaceCodec(spec_to_space(observation)), num_envs
    )


@dataclass(frozen=True)
class Exchange:
    scenario: str
    request: env_v1.JoinRequest
    response: env_v1.JoinResponse


def exchanges(scenario: str) -> Iterator[Exchange]:
    """Join requests paired with their replies (per stream, by request_id, first come first served)."""
    pending: dict[tuple[int, int], dict[str, deque[env_v1.JoinRequest]]] = defaultdict(
        lambda: defaultdict(deque)
    )
    for record in records(scenario):
        if record.get("kind") != "message" or not str(record.get("method", "")).endswith("/Join"):
            continue
        if "hex" not in record:
            continue
        stream = (record["conn"], record["stream"])
        data = bytes.fromhex(record["hex"])
        if record["dir"] == "c2s":
            try:
                request = env_v1.JoinRequest.parse(data)
            except Exception:
                continue  # deliberately malformed bytes (errors_scalar)
            pending[stream][request.request_id].append(request)
        else:
            response = env_v1.JoinResponse.parse(data)
            queue = pending[stream][response.request_id]
            if queue:
                yield Exchange(scenario, queue.popleft(), response)


def scenarios_with_values() -> list[str]:
    """Reference captures whose spaces are known and that carry Join traffic."""
    names = sorted(path.stem for path in GOLDENS.glob("*.jsonl"))
    return [
        name
        for name in names
        if not name.startswith(THIRD_PARTY)
        and setup(name) is not None
        and any(True for _ in exchanges(name))
    ]


def test_goldens_hold_many_scenarios() -> None:
    # Guards the parametrisations against silently finding nothing.
    assert len(scenarios_with_values()) >= 35


def lanes_of(exchange: Exchange, num_envs: int) -> int:
    request = exchange.request
    arm = request.reset if request.reset is not None else request.step
    assert arm is not None
    return len(arm.env_indices) if arm.env_indices else num_envs


def observation_of(response: env_v1.JoinResponse) -> spaces_v1.SpaceValue | None:
    if response.reset is not None:
        return response.reset.observation
    if response.step is not None:
        return response.step.observation
    return None


def infos_of(response: env_v1.JoinResponse) -> spaces_v1.MetaMap | None:
    if response.reset is not None:
        return response.reset.infos
    if response.step is not None:
        return response.step.infos
    return None


def lane_maps(infos: spaces_v1.MetaMap | None, lanes: int) -> list[dict[str, spaces_v1.MetaValue]]:
    """Each reply lane's info map: the top level for one lane, else ``final_info[i]``."""
    entries = dict(infos.entries) if infos is not None else {}
    if lanes == 1:
        return [entries]
    final = entries.get("final_info")
    assert final is not None and final.list is not None
    maps = [dict(item.map.entries) if item.map is not None else {} for item in final.list.items]
    assert len(maps) == lanes
    return maps


def warnings_in(lane_map: dict[str, spaces_v1.MetaValue]) -> list[Candidate]:
    value = lane_map.get(WARNING_KEY)
    if value is None or value.list is None:
        return []  # absent, or an env-owned non-list value passing through
    found = []
    for item in value.list.items:
        assert item.map is not None
        fields = {key: entry.text for key, entry in item.map.entries.items()}
        found.append(Candidate(kind=fields["kind"], path=fields["path"], detail=fields["detail"]))
    return found


def text_info(lane_map: dict[str, spaces_v1.MetaValue], key: str) -> str | None:
    value = lane_map.get(key)
    return value.text if value is not None else None


def plain(value: Any) -> Any:
    """How the capturing envs printed a value: arrays as lists, tuples as lists."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def check_lane_warning(
    lane_map: dict[str, spaces_v1.MetaValue], kind: str, ours: Candidate | None, where: str
) -> None:
    reported = [w for w in warnings_in(lane_map) if w.kind == kind]
    if ours is None:
        assert reported == [], f"{where}: reference reported {reported}, we found nothing"
    else:
        # At most one candidate per kind; de-duplication may have hidden it.
        assert reported in ([], [ours]), f"{where}: reference {reported}, ours {ours}"


def multibinary_leaf_indices(codec: SpaceCodec) -> set[int]:
    kinds: list[str] = []

    def walk(spec: spaces_v1.SpaceSpec) -> None:
        if spec.dict is not None:
            for child in spec.dict.spaces:
                walk(child)
        elif spec.tuple is not None:
            for child in spec.tuple.spaces:
                walk(child)
        else:
            kinds.append("mb" if spec.multi_binary is not None else "other")

    walk(codec.spec)
    return {i for i, kind in enumerate(kinds) if kind == "mb"}


CODEC_MESSAGE_PREFIXES = ("length mismatch", "expected ", "decode error", "$")
SOFT_FRAGMENTS = ("out of bounds", "text length", "not in charset")


def is_soft_text(message: str) -> bool:
    return any(fragment in message for fragment in SOFT_FRAGMENTS)


# ---- observations -------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", scenarios_with_values())
def test_observations_round_trip_and_warnings(scenario: str) -> None:
    config = setup(scenario)
    assert config is not None
    codec = config.observation
    seen = 0
    for exchange in exchanges(scenario):
        observation = observation_of(exchange.response)
        if observation is None:
            continue
        where = f"{scenario}/{exchange.request.request_id}"
        lanes = lanes_of(exchange, config.num_envs)
        leaves = list(observation.leaves)
        values = codec.decode(leaves, lanes)
        assert len(values) == lanes
        assert codec.encode_batch(values) == leaves, where
        assert codec.join([codec.encode(value) for value in values]) == leaves, where
        if scenario not in VECTOR_SERVER:
            for lane_map, value in zip(
                lane_maps(infos_of(exchange.response), lanes), values, strict=True
            ):
                _, ours = codec.encode_observation(value, soft_checks=True)
                check_lane_warning(lane_map, "observation", ours, where)
        seen += 1
    if seen == 0:
        pytest.skip(f"{scenario}: no observation with a full payload")


# ---- actions ------------------------------------------------------------------------------


def step_exchanges(scenario: str) -> Iterator[Exchange]:
    for exchange in exchanges(scenario):
        if exchange.request.step is not None:
            yield exchange


def codec_error_cases() -> list[Any]:
    """Every captured INVALID_ACTION text that the action codec produces (not subset-step ones)."""
    cases = []
    for scenario in scenarios_with_values():
        for exchange in step_exchanges(scenario):
            error = exchange.response.error
            if error is None or error.code != Code.INVALID_ACTION:
                continue
            if not error.message.startswith(CODEC_MESSAGE_PREFIXES) or is_soft_text(error.message):
                continue
            cases.append(pytest.param(exchange, id=f"{scenario}/{exchange.request.request_id}"))
    return cases


def test_goldens_hold_the_codec_error_texts() -> None:
    messages = {case.values[0].response.error.message for case in codec_error_cases()}
    for expected in (
        "expected 1 actions, got 0",
        "length mismatch: got 2 leaf slabs, spec expects 1",
        "length mismatch: slab: got 4 bytes, expected 1 lanes * 8",
        "length mismatch: slab: got 8 bytes, expected 2 lanes * 8",
        "$: value 5 not in range [0, 2)",
        "$.fire: value -1 not in range [0, 2)",
        "$.move: Box value at element 0 is NaN",
        "$.md: value[0] = 2 not in range [0, 2)",
        "$[2][0]: value[0] = 2 not in range [0, 2)",
        "length mismatch: text slab header truncated",
        "length mismatch: text slab count 2 != N 1",
        "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
    ):
        assert expected in messages


@pytest.mark.parametrize("exchange", codec_error_cases())
def test_invalid_action_texts_are_reproduced(exchange: Exchange) -> None:
    config = setup(exchange.scenario)
    assert config is not None and exchange.request.step is not None
    step = exchange.request.step
    leaves = list(step.action.leaves) if step.action is not None else None
    lanes = len(step.env_indices) if step.env_indices else config.num_envs
    with pytest.raises(ActionError) as info:
        config.action.validate_action(leaves, lanes)
    assert exchange.response.error is not None
    assert str(info.value) == exchange.response.error.message


@pytest.mark.parametrize("scenario", scenarios_with_values())
def test_accepted_actions_decode_to_what_the_env_saw(scenario: str) -> None:
    config = setup(scenario)
    assert config is not None
    codec = config.action
    binary = multibinary_leaf_indices(codec)
    for exchange in step_exchanges(scenario):
        response, step = exchange.response, exchange.request.step
        assert step is not None
        where = f"{scenario}/{exchange.request.request_id}"
        error = response.error
        if error is not None:
            if error.message.startswith(("subset step:", "partial reset:")):
                continue  # lane indices refused before the action was looked at
            if error.code == Code.INVALID_ACTION and not is_soft_text(error.message):
                continue  # a codec refusal: test_invalid_action_texts_are_reproduced
        leaves = list(step.action.leaves) if step.action is not None else None
        lanes = len(step.env_indices) if step.env_indices else config.num_envs
        codec.validate_action(leaves, lanes)
        assert leaves is not None
        values = codec.decode(leaves, lanes)
        rows = [codec.decode_action(leaves, lanes, row, soft_checks=True) for row in range(lanes)]
        for (value, _), full in zip(rows, values, strict=True):
            assert repr(plain(value)) == repr(plain(full)), where
        expected = [
            bytes(min(byte, 1) for byte in leaf) if i in binary else leaf
            for i, leaf in enumerate(leaves)
        ]
        assert codec.encode_batch(values) == expected, where
        if error is not None:
            if error.code == Code.INVALID_ACTION:
                # Strict policy: the lane's soft violation became the error.
                details = [c.detail for _, c in rows if c is not None]
                assert error.message in details, where
            continue
        if scenario in VECTOR_SERVER:
            continue
        for lane_map, (value, candidate) in zip(
            lane_maps(infos_of(response), lanes), rows, strict=True
        ):
            check_lane_warning(lane_map, "action", candidate, where)
            seen = text_info(lane_map, "action_seen") or text_info(lane_map, "action_repr")
            if seen is not None:
                # ConfEnv / MixedEnv print plain lists, EchoEnv the value's own repr.
                assert seen in (repr(plain(value)), repr(value)), where


# ---- observation hard errors and strict texts, from hand-built values ----------------------


@cache
def conf_clean_observation() -> dict[str, Any]:
    """ConfEnv's clean observation, as decoded from a captured clean reply."""
    config = setup("conformance_action_checks")
    assert config is not None
    for exchange in exchanges("conformance_action_checks"):
        if exchange.response.step is not None:
            (value,) = config.observation.decode(list(exchange.response.step.observation.leaves), 1)
            assert value["box"].tolist() == [0.0, 0.0, 0.0]
            return dict(value)
    raise AssertionError("no clean observation captured")


Mutation = Callable[[dict[str, Any]], None]


def put(key: str, value: Any) -> Mutation:
    def mutate(obs: dict[str, Any]) -> None:
        obs[key] = value

    return mutate


def nest_t(index: int, value: Any) -> Mutation:
    def mutate(obs: dict[str, Any]) -> None:
        items = list(obs["nest"]["t"])
        items[index] = value
        obs["nest"] = {**obs["nest"], "t": tuple(items)}

    return mutate


def pair(index: int, value: Any) -> Mutation:
    def mutate(obs: dict[str, Any]) -> None:
        items = list(obs["pair"])
        items[index] = value
        obs["pair"] = tuple(items)

    return mutate


def every_leaf_violates(obs: dict[str, Any]) -> None:
    obs.update(
        box=np.array([2.0, 0, 0], np.float32),
        boxe=np.array([2.0, 0.0]),
        disc=4,
        ibox=np.array([6, 0], np.int16),
        md=np.array([2, 0]),
        txt="abcabd",
    )


# The ConfEnv case each captured request set up (driver/conformance_obs_checks "cases").
CONF_CASES: dict[str, Mutation] = {
    "lane55-reset-obs-disc-0-hard-error": put("disc", 0),
    "lane5-obs-case5-box-el0-NaN": put("box", np.array([np.nan, 0, 0], np.float32)),
    "lane12-obs-case12-disc-0-below-start-1": put("disc", 0),
    "lane13-obs-case13-disc-4-above-start-n": put("disc", 4),
    "lane14-obs-case14-md-el0-2-nvec-2": put("md", np.array([2, 0])),
    "lane15-obs-case15-md-el1-1": put("md", np.array([0, -1])),
    "lane17-obs-case17-mb-el1-1": put("mb", np.array([0, -1, 0], np.int8)),
    "lane23-obs-case23-pair-1-discrete-2": pair(1, 2),
    "lane27-obs-case27-box-shape-2-instead-of-3": put("box", np.zeros(2, np.float32)),
    "lane29-obs-case29-every-leaf-violates": every_leaf_violates,
    "lane33-obs-case33-nest-t-1-md-9": nest_t(1, np.array([9])),
    "lane36-obs-case36-ibox-float-array-6-5-0": put("ibox", np.array([6.5, 0.0])),
    "lane37-obs-case37-disc-numpy-int64-5": put("disc", np.int64(5)),
    "lane38-obs-case38-md-2-vs-nvec-shape-3": put("md", np.array([0, 0, 0])),
    "lane39-obs-case39-mb-shape-2": put("mb", np.array([0, 1])),
    "lane44-obs-case44-boxe-el0-NaN-float64": put("boxe", np.array([np.nan, 0.0])),
    "lane52-obs-case52-txt-non-str-value-7": put("txt", 7),
    "lane1-obs-disc-0": put("disc", 0),
    "lane0-obs-box-el0-above": put("box", np.array([2.0, 0, 0], np.float32)),
    "lane1-obs-txt-char-d": put("txt", "abd"),
    "whole-l1-obs-box-el0-above": put("box", np.array([2.0, 0, 0], np.float32)),
    "session2-whole-reset-obs-box": put("box", np.array([2.0, 0, 0], np.float32)),
}


def observation_error_cases() -> list[Any]:
    """Captured INTERNAL errors of the ConfEnv scenarios that come from encoding an observation."""
    cases = []
    for scenario in (
        "conformance_obs_checks",
        "conformance_policy_off",
        "conformance_policy_strict",
    ):
        for exchange in exchanges(scenario):
            error = exchange.response.error
            if error is None or error.code != Code.INTERNAL:
                continue
            cases.append(pytest.param(exchange, id=f"{scenario}/{exchange.request.request_id}"))
    return cases


def test_every_captured_observation_error_has_a_case() -> None:
    cases = observation_error_cases()
    assert len(cases) >= 20
    for case in cases:
        assert case.values[0].request.request_id in CONF_CASES


@pytest.mark.parametrize("exchange", observation_error_cases())
def test_observation_errors_are_reproduced(exchange: Exchange) -> None:
    config = setup(exchange.scenario)
    assert config is not None and exchange.response.error is not None
    message = exchange.response.error.message
    value = dict(conf_clean_observation())
    CONF_CASES[exchange.request.request_id](value)
    if is_soft_text(message) and " failed: " not in message:
        # Strict policy: the observation's soft violation is the (unprefixed) error text.
        _, candidate = config.observation.encode_observation(value, soft_checks=True)
        assert candidate is not None and candidate.kind == "observation"
        assert candidate.detail == message
        return
    operation = "reset" if exchange.request.reset is not None else "step"
    with pytest.raises((ValueError, TypeError)) as info:
        config.observation.encode_observation(value, soft_checks=True)
    assert f"{operation} failed: {type(info.value).__name__}: {info.value}" == message
