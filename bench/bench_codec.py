"""Codec micro-benchmark: microseconds per encode / decode, next to rlmesh 0.1.0's own numbers.

Run: ``python bench/bench_codec.py`` (about half a minute; ``--quick`` for a smoke run).

Ours: median over many timed batches (``time.perf_counter_ns``, warm-up first) of the
per-call time, single thread. "values" rows time only the value codec (what a lane runs
in its decode / encode phase); "message" rows add the betterproto2 message work, i.e.
building the ``JoinResponse`` and ``bytes()`` of it, or ``JoinRequest.parse`` /
``JoinResponse.parse`` of real bytes.

Reference: the rlmesh 0.1.0 server's own phase timings, read from the golden captures in
``tests/goldens`` — ``JoinResponse`` field 11 ``decode_ns`` (wire action -> env value)
and field 13 ``encode_ns`` (env result -> wire form), medians over the captured replies.
For the image-sized observation there is no capture of that size, so the 16 MB
``phases_big_*`` captures are scaled per byte (a lower bound: their fixed per-call cost
is spread over 16 MB). The reference measures inside its server on another day and
machine, so compare orders of magnitude, not percentages. Info-dict rows have no
reference figure of their own (the reference folds info conversion into encode_ns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from rlmesh_trio._codec import SpaceCodec, from_meta_map, to_meta_map
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._wire import decode_join_request, encode_join_response

Row = tuple[str, tuple[float, float], str]

GOLDENS = Path(__file__).resolve().parent.parent / "tests" / "goldens"


# --------------------------------------------------------------------------- timing


def measure(fn: Callable[[], object], *, quick: bool) -> tuple[float, float]:
    """(median, min) microseconds per call of ``fn`` over timed batches of several calls."""
    target_ns = 1_000_000 if quick else 8_000_000
    repeats = 5 if quick else 41
    start = time.perf_counter_ns()
    fn()
    once = max(time.perf_counter_ns() - start, 1)
    batch = max(1, min(100_000, target_ns // once))
    for _ in range(2):  # warm-up batches
        for _ in range(batch):
            fn()
    per_call: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter_ns() - start) / batch)
    return statistics.median(per_call) / 1000.0, min(per_call) / 1000.0


# --------------------------------------------------------------------------- reference figures


def _records(scenario: str) -> Iterator[dict[str, Any]]:
    with (GOLDENS / f"{scenario}.jsonl").open(encoding="utf-8") as stream:
        for line in stream:
            record = json.loads(line)
            if record.get("kind") == "message":
                yield record


def _phase_ns(scenario: str, arm: str, field: str) -> list[int]:
    arm_key = {"reset": "1:reset", "step": "2:step"}[arm]
    out = []
    for record in _records(scenario):
        fields = record.get("fields") or {}
        if record.get("msg_type") == "env.JoinResponse" and arm_key in fields and field in fields:
            out.append(int(fields[field]))
    return out


def _captured_hex(scenario: str, arm: str, direction: str) -> bytes:
    arm_key = {"step": "2:step"}[arm]
    for record in _records(scenario):
        if record["dir"] == direction and arm_key in (record.get("fields") or {}):
            return bytes.fromhex(record["hex"])
    raise LookupError(f"no {direction} {arm} in {scenario}")


class Reference:
    def __init__(self) -> None:
        self.cartpole_decode_us = (
            statistics.median(_phase_ns("cartpole_scalar", "step", "11:decode_ns")) / 1000
        )
        self.cartpole_encode_us = (
            statistics.median(_phase_ns("cartpole_scalar", "step", "13:encode_ns")) / 1000
        )
        self.cartpole_steps = len(_phase_ns("cartpole_scalar", "step", "13:encode_ns"))
        big = 16_000_000
        (obs_reset_ns,) = _phase_ns("phases_big_observation", "reset", "13:encode_ns")
        (obs_step_ns,) = _phase_ns("phases_big_observation", "step", "13:encode_ns")
        (act_step_ns,) = _phase_ns("phases_big_action", "step", "11:decode_ns")
        self.encode_ns_per_byte = min(obs_reset_ns, obs_step_ns) / big
        self.decode_ns_per_byte = act_step_ns / big


# --------------------------------------------------------------------------- workloads


def _response(observation: list[bytes], n: int, infos: spaces_v1.MetaMap) -> env_v1.JoinResponse:
    return env_v1.JoinResponse(
        step=env_v1.StepResponse(
            observation=spaces_v1.SpaceValue(leaves=observation),
            rewards=[1.0] * n,
            terminated_mask=bytes(n),
            truncated_mask=bytes(n),
            infos=infos,
        ),
        request_id="grpc-req-12",
        # plausible timing fields, so the message is as large as the server's replies
        endpoint_total_ns=123_456,
        decode_ns=1_234,
        user_ns=45_678,
        encode_ns=9_876,
        queue_ns=3_210,
    )


def cartpole_rows(ref: Reference, quick: bool) -> list[Row]:
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=42)
    obs_codec = SpaceCodec(env.observation_space)
    act_codec = SpaceCodec(env.action_space)
    env.close()
    request_bytes = _captured_hex("cartpole_scalar", "step", "c2s")

    def encode_values() -> object:
        return obs_codec.encode(obs), to_meta_map({})

    def encode_message() -> bytes:
        leaves = obs_codec.encode(obs)
        return bytes(_response(leaves, 1, to_meta_map({})))

    leaves = env_v1.JoinRequest.parse(request_bytes).step.action.leaves  # type: ignore[union-attr]

    def decode_values() -> object:
        act_codec.validate_action(leaves, 1)
        return act_codec.decode_action(leaves, 1, 0, soft_checks=True)[0]

    def decode_message() -> object:
        request = env_v1.JoinRequest.parse(request_bytes)
        step = request.step
        assert step is not None
        assert step.action is not None
        act_codec.validate_action(step.action.leaves, 1)
        return act_codec.decode_action(step.action.leaves, 1, 0, soft_checks=True)[0]

    def encode_message_fast() -> bytes:
        leaves = obs_codec.encode(obs)
        return encode_join_response(_response(leaves, 1, to_meta_map({})))

    def decode_message_fast() -> object:
        request = decode_join_request(request_bytes)
        step = request.step
        assert step is not None
        assert step.action is not None
        act_codec.validate_action(step.action.leaves, 1)
        return act_codec.decode_action(step.action.leaves, 1, 0, soft_checks=True)[0]

    enc_ref = f"{ref.cartpole_encode_us:8.2f}  encode_ns, median of {ref.cartpole_steps} cartpole_scalar steps"
    dec_ref = f"{ref.cartpole_decode_us:8.2f}  decode_ns, median of {ref.cartpole_steps} cartpole_scalar steps"
    return [
        (
            "CartPole step encode: values (obs f32x4 + {} info)",
            measure(encode_values, quick=quick),
            enc_ref,
        ),
        (
            "CartPole step encode: + JoinResponse bytes()",
            measure(encode_message, quick=quick),
            enc_ref,
        ),
        (
            "CartPole step encode: + server wire path (_wire)",
            measure(encode_message_fast, quick=quick),
            enc_ref,
        ),
        ("CartPole action decode: values (Discrete)", measure(decode_values, quick=quick), dec_ref),
        (
            "CartPole action decode: JoinRequest.parse + values",
            measure(decode_message, quick=quick),
            dec_ref,
        ),
        (
            "CartPole action decode: server wire path (_wire) + values",
            measure(decode_message_fast, quick=quick),
            dec_ref,
        ),
    ]


def image_rows(ref: Reference, quick: bool) -> list[Row]:
    space = gym.spaces.Dict(
        {
            "image": gym.spaces.Box(0, 255, (84, 84, 3), np.uint8),
            "vec": gym.spaces.Box(-1.0, 1.0, (8,), np.float32),
        }
    )
    space.seed(0)
    codec = SpaceCodec(space)
    rows: list[Row] = []
    for n in (1, 8):
        values = [space.sample() for _ in range(n)]
        leaves = codec.encode(values[0]) if n == 1 else codec.encode_batch(values)
        nbytes = sum(len(leaf) for leaf in leaves)
        message = bytes(_response(leaves, n, to_meta_map({})))

        def encode_values(values: list[Any] = values) -> object:
            if len(values) == 1:
                return codec.encode(values[0])
            return codec.join([codec.encode(value) for value in values])  # one encode per lane

        def encode_batch(values: list[Any] = values) -> object:
            return codec.encode_batch(values)

        def encode_message(values: list[Any] = values, n: int = n) -> bytes:
            lanes = codec.join([codec.encode(value) for value in values])
            return bytes(_response(lanes, n, to_meta_map({})))

        def encode_message_fast(values: list[Any] = values, n: int = n) -> bytes:
            lanes = codec.join([codec.encode(value) for value in values])
            return encode_join_response(_response(lanes, n, to_meta_map({})))

        def decode_values(leaves: list[bytes] = leaves, n: int = n) -> object:
            return codec.decode(leaves, n)

        def decode_message(message: bytes = message, n: int = n) -> object:
            response = env_v1.JoinResponse.parse(message)
            assert response.step is not None
            assert response.step.observation is not None
            return codec.decode(response.step.observation.leaves, n)

        enc_ref = (
            f"{ref.encode_ns_per_byte * nbytes / 1000:8.1f}  encode_ns of phases_big_observation, "
            f"{ref.encode_ns_per_byte:.1f} ns/B x {nbytes} B"
        )
        dec_ref = (
            f"{ref.decode_ns_per_byte * nbytes / 1000:8.1f}  decode_ns of phases_big_action, "
            f"{ref.decode_ns_per_byte:.1f} ns/B x {nbytes} B"
        )
        label = f"Dict image 84x84x3 u8 + vec f32x8, N={n}"
        rows.append((f"{label} encode: values", measure(encode_values, quick=quick), enc_ref))
        if n > 1:
            rows.append(
                (f"{label} encode: encode_batch", measure(encode_batch, quick=quick), enc_ref)
            )
        rows.append(
            (
                f"{label} encode: + JoinResponse bytes()",
                measure(encode_message, quick=quick),
                enc_ref,
            )
        )
        rows.append(
            (
                f"{label} encode: + server wire path (_wire)",
                measure(encode_message_fast, quick=quick),
                enc_ref,
            )
        )
        rows.append((f"{label} decode: values", measure(decode_values, quick=quick), dec_ref))
        rows.append(
            (
                f"{label} decode: JoinResponse.parse + values",
                measure(decode_message, quick=quick),
                dec_ref,
            )
        )
    return rows


def _encode_info(info: dict[str, object]) -> bytes:
    return bytes(to_meta_map(info))


def _decode_info(data: bytes) -> dict[str, object]:
    return from_meta_map(spaces_v1.MetaMap.parse(data))


def info_rows(quick: bool) -> list[Row]:
    flat = {"t": 12, "x": 0.5, "flag": False, "name": "lane-0"}
    mixed = {
        "bytes": b"\x00\x01",
        "none": None,
        "np_i64": np.int64(-3),
        "list": [1, "two", 3.0],
        "arr_f32": np.array([1.0, 2.0], dtype=np.float32),
        "np_bool": np.bool_(True),
        "nested": {"a": 1, "b": {"c": [True, None]}},
        "np_f32": np.float32(1.25),
        "arr_i32_2d": np.array([[1, 2], [3, 4]], dtype=np.int32),
    }
    none = "      —   (the reference folds info conversion into encode_ns)"
    rows: list[Row] = []
    cases: list[tuple[str, dict[str, object]]] = [
        ("{}", {}),
        ("flat, 4 keys", flat),
        ("mixed_codec-like, 9 keys nested/numpy", mixed),
    ]
    for name, info in cases:
        meta = to_meta_map(info)
        data = bytes(meta)
        timed: list[tuple[str, Callable[[], object]]] = [
            ("to_meta_map", partial(to_meta_map, info)),
            ("from_meta_map", partial(from_meta_map, meta)),
            ("to_meta_map + MetaMap bytes()", partial(_encode_info, info)),
            ("MetaMap.parse + from_meta_map", partial(_decode_info, data)),
        ]
        for what, fn in timed:
            rows.append((f"info {name}: {what}", measure(fn, quick=quick), none))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few, short batches (smoke run)")
    args = parser.parse_args(argv)
    ref = Reference()
    rows = [*cartpole_rows(ref, args.quick), *image_rows(ref, args.quick), *info_rows(args.quick)]
    width = max(len(name) for name, _, _ in rows)
    print(f"rlmesh-trio codec benchmark (python {sys.version.split()[0]}, numpy {np.__version__})")
    print(f"{'case':<{width}}  {'ours µs':>9} {'(min)':>8}  {'ref µs':>8}  reference figure")
    print("-" * (width + 90))
    for name, (median, fastest), reference in rows:
        print(f"{name:<{width}}  {median:9.2f} {fastest:8.2f}  {reference}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
