"""The hand-written JoinResponse encoder and JoinRequest decoder agree with betterproto2."""

from __future__ import annotations

from typing import Any

import pytest
from goldens_util import fill_missing_map_values, message_records, payload, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st
from support.protobuf import field, scalar, varint

from rlmesh_trio._codec import from_meta_map
from rlmesh_trio._errors import MessageTooLarge
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._wire import DecodeError as WireDecodeError
from rlmesh_trio._wire import (
    decode_join_request,
    encode_join_response,
    encode_join_response_framed,
)

# Captures that are deliberately not a well-formed JoinRequest.
MALFORMED = {"ffffff"}


def _golden(msg_type: str) -> list[Any]:
    cases = []
    for scenario in scenarios():
        for rec in message_records(scenario, msg_type=msg_type):
            if "hex" in rec:
                cases.append(pytest.param(payload(rec), id=f"{scenario}-{rec['seq']}"))
    return cases


def grpc_framed(message: bytes) -> bytes:
    """A gRPC message as grpclib frames it: uncompressed flag, big-endian length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def test_framed_encoding_refuses_an_oversize_reply_before_joining() -> None:
    leaf = bytes(1000)
    message = env_v1.JoinResponse(
        step=env_v1.StepResponse(observation=spaces_v1.SpaceValue(leaves=[leaf, leaf]))
    )
    size = len(bytes(message))
    assert encode_join_response_framed(message, size) == grpc_framed(bytes(message))
    with pytest.raises(MessageTooLarge, match=f"{size}"):
        encode_join_response_framed(message, size - 1)


@pytest.mark.parametrize("data", _golden("env.JoinResponse"))
def test_golden_responses_encode_byte_identically(data: bytes) -> None:
    message = fill_missing_map_values(env_v1.JoinResponse.parse(data))
    assert isinstance(message, env_v1.JoinResponse)
    assert encode_join_response(message) == bytes(message)
    assert encode_join_response_framed(message, 1 << 30) == grpc_framed(bytes(message))


@pytest.mark.parametrize("data", _golden("env.JoinRequest"))
def test_golden_requests_decode_like_betterproto(data: bytes) -> None:
    if data.hex() in MALFORMED:
        with pytest.raises(WireDecodeError):
            decode_join_request(data)
        return
    ours = decode_join_request(data)
    theirs = env_v1.JoinRequest.parse(data)
    if theirs.reset is not None and theirs.reset.options is not None:
        # prost omits an empty MetaValue; betterproto2 reads that as None, we as MetaValue()
        assert ours.reset is not None
        assert from_meta_map(ours.reset.options) == from_meta_map(theirs.reset.options)
        fill_missing_map_values(theirs)
    theirs._unknown_fields = b""  # the deliberately unknown oneof arm: skipped by us
    assert ours == theirs


# --------------------------------------------------------------------------- generated


def meta_values(depth: int = 2) -> st.SearchStrategy[spaces_v1.MetaValue]:
    leaves = st.one_of(
        st.just(spaces_v1.MetaValue()),
        st.integers(-(2**63), 2**63 - 1).map(lambda v: spaces_v1.MetaValue(integer=v)),
        st.floats(allow_nan=False).map(lambda v: spaces_v1.MetaValue(number=v)),
        st.text(max_size=8).map(lambda v: spaces_v1.MetaValue(text=v)),
        st.booleans().map(lambda v: spaces_v1.MetaValue(bool=v)),
        st.binary(max_size=8).map(lambda v: spaces_v1.MetaValue(bytes=v)),
    )
    if depth == 0:
        return leaves
    inner = meta_values(depth - 1)
    return st.one_of(
        leaves,
        st.lists(inner, max_size=3).map(
            lambda items: spaces_v1.MetaValue(list=spaces_v1.MetaList(items=items))
        ),
        meta_maps(inner).map(lambda m: spaces_v1.MetaValue(map=m)),
    )


def meta_maps(
    values: st.SearchStrategy[spaces_v1.MetaValue] | None = None,
) -> st.SearchStrategy[spaces_v1.MetaMap]:
    return st.dictionaries(
        st.text(max_size=6), meta_values(1) if values is None else values, max_size=4
    ).map(lambda entries: spaces_v1.MetaMap(entries=entries))


u64 = st.integers(0, 2**64 - 1)
space_values = st.lists(st.binary(max_size=24), max_size=3).map(
    lambda leaves: spaces_v1.SpaceValue(leaves=leaves)
)
episodes = st.builds(
    env_v1.EpisodeMetadata,
    episode_id=st.text(max_size=8),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    env_index=st.integers(0, 2**32 - 1),
    step_count=st.integers(-(2**63), 2**63 - 1),
    cumulative_reward=st.floats(allow_nan=False),
    terminated=st.booleans(),
    truncated=st.booleans(),
    start_timestamp_ns=st.integers(0, 2**63 - 1),
    end_timestamp_ns=st.integers(0, 2**63 - 1),
    final_info=st.none() | meta_maps(),
)
kinds = st.one_of(
    st.builds(
        env_v1.ResetResponse, observation=st.none() | space_values, infos=st.none() | meta_maps()
    ).map(lambda r: {"reset": r}),
    st.builds(
        env_v1.StepResponse,
        observation=st.none() | space_values,
        rewards=st.lists(st.floats(allow_nan=False), max_size=3),
        terminated_mask=st.binary(max_size=3),
        truncated_mask=st.binary(max_size=3),
        infos=st.none() | meta_maps(),
        completed_episodes=st.lists(episodes, max_size=2),
        env_indices=st.lists(st.integers(0, 2**32 - 1), max_size=3),
    ).map(lambda r: {"step": r}),
    st.builds(
        env_v1.RenderResponse,
        frame=st.none() | st.binary(max_size=16),
        format=st.sampled_from(list(env_v1.RenderFormat)),
    ).map(lambda r: {"render": r}),
    st.builds(env_v1.CloseEnvsResponse, final_episodes=st.lists(episodes, max_size=2)).map(
        lambda r: {"close": r}
    ),
    st.just({"configure": env_v1.ConfigureEnvResponse()}),
    st.builds(
        env_v1.EnvError,
        code=st.sampled_from(list(env_v1.EnvErrorCode)),
        message=st.text(max_size=12),
        is_recoverable=st.booleans(),
        debug_info=st.text(max_size=4),
        interrupted_episodes=st.lists(episodes, max_size=1),
    ).map(lambda r: {"error": r}),
    st.just({}),
)


@settings(max_examples=300, deadline=None)
@given(
    kind=kinds,
    request_id=st.text(max_size=12),
    timings=st.lists(st.none() | u64, min_size=6, max_size=6),
)
def test_generated_responses_encode_byte_identically(
    kind: dict[str, Any], request_id: str, timings: list[int | None]
) -> None:
    names = ["endpoint_total_ns", "decode_ns", "user_ns", "encode_ns", "lane_skew_ns", "queue_ns"]
    message = env_v1.JoinResponse(
        request_id=request_id, **dict(zip(names, timings, strict=True)), **kind
    )
    assert encode_join_response(message) == bytes(message)
    assert encode_join_response_framed(message, 1 << 30) == grpc_framed(bytes(message))


request_kinds = st.one_of(
    st.builds(
        env_v1.ResetRequest,
        seeds=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
        options=st.none() | meta_maps(),
        timeout_ms=u64,
        env_indices=st.lists(st.integers(0, 2**32 - 1), max_size=3),
        episode_ids=st.lists(st.text(max_size=6), max_size=3),
    ).map(lambda r: {"reset": r}),
    st.builds(
        env_v1.StepRequest,
        action=st.none() | space_values,
        timeout_ms=u64,
        env_indices=st.lists(st.integers(0, 2**32 - 1), max_size=3),
        episode_ids=st.lists(st.text(max_size=6), max_size=3),
    ).map(lambda r: {"step": r}),
    st.builds(
        env_v1.RenderRequest,
        env_indices=st.lists(st.integers(0, 2**32 - 1), max_size=3),
        timeout_ms=u64,
    ).map(lambda r: {"render": r}),
    st.builds(env_v1.CloseEnvsRequest, reason=st.text(max_size=6)).map(lambda r: {"close": r}),
    st.builds(env_v1.ConfigureEnvRequest, selected_workflow_edition=st.text(max_size=8)).map(
        lambda r: {"configure": r}
    ),
    st.just({}),
)


@settings(max_examples=300, deadline=None)
@given(kind=request_kinds, request_id=st.text(max_size=12))
def test_generated_requests_round_trip(kind: dict[str, Any], request_id: str) -> None:
    message = env_v1.JoinRequest(request_id=request_id, **kind)
    data = bytes(message)
    assert decode_join_request(data) == message == env_v1.JoinRequest.parse(data)


def test_unpacked_repeated_scalars_and_unknown_fields_are_accepted() -> None:
    # env_indices 1 and 2 unpacked (tag 0x18 each), an unknown varint field 9, request id "x"
    step = b"\x18\x01\x18\x02\x48\x07"
    data = b"\x12" + bytes([len(step)]) + step + b"\x2a\x01x"
    request = decode_join_request(data)
    assert request.request_id == "x"
    assert request.step is not None
    assert request.step.env_indices == [1, 2]


def test_uint32_indices_keep_the_low_bits_and_seeds_are_signed() -> None:
    minus_one = b"\xff" * 9 + b"\x01"
    reset = b"\x08" + minus_one + b"\x20" + minus_one
    request = decode_join_request(b"\x0a" + bytes([len(reset)]) + reset)
    assert request.reset is not None
    assert request.reset.seeds == [-1]
    assert request.reset.env_indices == [4294967295]


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xff\xff",  # truncated varint
        b"\x2a\x05ab",  # length past the end
        b"\x12\x02\x0a",  # nested length past the end
        b"\x2a\x02\xff\xfe",  # request id not UTF-8
        b"\x0b",  # group wire type
        b"\x00\x01",  # field number 0
        b"\x28" + b"\xff" * 10 + b"\x01",  # varint longer than 10 bytes
    ],
)
def test_malformed_requests_are_refused(data: bytes) -> None:
    with pytest.raises(WireDecodeError):
        decode_join_request(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40))
def test_arbitrary_bytes_decode_or_raise_wire_decode_error(data: bytes) -> None:
    try:
        message = decode_join_request(data)
    except WireDecodeError:
        return
    # whatever was accepted is a real message: it survives its own round trip
    assert decode_join_request(bytes(message)) == message


@settings(max_examples=100, deadline=None)
@given(kind=request_kinds, cut=st.integers(0, 200))
def test_every_truncation_is_refused_or_a_shorter_message(kind: dict[str, Any], cut: int) -> None:
    data = bytes(env_v1.JoinRequest(request_id="id", **kind))
    prefix = data[: min(cut, len(data))]
    try:
        message = decode_join_request(prefix)
    except WireDecodeError:
        assert prefix != data  # the whole message always decodes
        return
    assert decode_join_request(bytes(message)) == message


@pytest.mark.parametrize("table", ["REQUEST_FIELDS", "RESPONSE_FIELDS"])
def test_hand_written_field_tables_match_the_generated_classes(table: str) -> None:
    """A field added to proto/ (and so to the generated classes) cannot be silently
    dropped by the hand-written decoder or encoder: their tables must list it."""
    from rlmesh_trio._wire import _decode, _encode
    from rlmesh_trio._wire._protobuf import schema

    module = _decode if table == "REQUEST_FIELDS" else _encode
    for cls, fields in getattr(module, table).items():
        assert fields == {n: f.name for n, f in schema(cls).items()}, cls.__name__


# ------------------------------------------------------------- the plain step's own path

_STEP_FIELDS = {
    "action": b"\x0a",
    "timeout": b"\x10",
    "indices": b"\x1a",
    "index": b"\x18",
    "episode": b"\x22",
    "unknown": b"\x28",
}


step_fields = st.one_of(
    st.builds(
        lambda leaves: field(1, b"".join(field(1, leaf) for leaf in leaves)),
        st.lists(st.binary(max_size=200), max_size=3),
    ),
    st.builds(lambda n: scalar(2, n), st.integers(0, (1 << 64) - 1)),
    st.builds(
        lambda lanes: field(3, b"".join(map(varint, lanes))),
        st.lists(st.integers(0, (1 << 64) - 1), max_size=2),
    ),
    st.builds(lambda n: scalar(3, n), st.integers(0, (1 << 40))),
    st.builds(lambda text: field(4, text), st.sampled_from((b"ep-1", b"\xff\xfe", b""))),
    st.builds(lambda n: scalar(5, n), st.integers(0, 300)),  # an unknown field
)


@st.composite
def join_requests(draw: st.DrawFn) -> bytes:
    """JoinRequests near the one-lane step's shape: its fields in any order, some
    repeated or missing, unknown ones, other arms, bad UTF-8, cut short."""
    if draw(st.integers(0, 9)) < 7:  # the shape the clients send, fields in any order
        leaves = draw(st.lists(st.binary(max_size=200), max_size=3))
        fields = [field(1, b"".join(field(1, leaf) for leaf in leaves))]
        lane = draw(st.integers(0, (1 << 64) - 1))
        fields.append(draw(st.sampled_from((field(3, varint(lane)), scalar(3, lane)))))
        if draw(st.booleans()):
            fields.append(scalar(2, draw(st.integers(0, 1 << 33))))
        if draw(st.booleans()):
            fields.append(field(4, b"01a228c7-ce08-7c11-970b-a714192022e2"))
        if draw(st.integers(0, 3)) == 0:
            fields.append(draw(step_fields))  # now and then one too many
        body = b"".join(draw(st.permutations(fields)))
    else:
        body = b"".join(draw(st.lists(step_fields, max_size=6)))
    parts = [field(2, body)]
    if draw(st.booleans()):
        parts.append(field(5, draw(st.sampled_from((b"grpc-req-5", b"", b"\xc3")))))
    extra = draw(
        st.sampled_from((b"",) * 8 + (b"\x12\x00", b"\x2a\x01r", b"\x1a\x00", b"\x08\x01"))
    )
    parts.insert(draw(st.integers(0, len(parts))), extra)
    data = b"".join(parts)
    cut = draw(st.integers(0, len(data)))
    return data[:cut] if draw(st.integers(0, 9)) == 0 else data


def _decoded(data: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    from rlmesh_trio._wire import _decode

    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(_decode, "_plain_step", lambda data: None)
        try:
            request = decode_join_request(data, num_envs=8)
        except WireDecodeError as exc:
            return ("error", str(exc))
    step = request.step
    fields = None
    if step is not None:
        action = None if step.action is None else [bytes(leaf) for leaf in step.action.leaves]
        fields = (action, step.timeout_ms, list(step.env_indices), list(step.episode_ids))
    return (request, fields, bytes(request))


@settings(max_examples=600, deadline=None)
@given(join_requests())
def test_the_plain_step_path_decodes_as_the_general_decoder(data: bytes) -> None:
    """Whatever the plain step's own path takes, it decodes exactly as the general
    decoder does (same message, same fields, same bytes again); what it declines, the
    general decoder decodes or refuses with prost's words."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _decoded(data, True, monkeypatch) == _decoded(data, False, monkeypatch)


def test_the_plain_step_path_takes_what_the_clients_send() -> None:
    from rlmesh_trio._wire import _decode

    # rlmesh.run's step of lane 1 (tests/goldens: client_run_lanes3), and ours.
    captured = bytes.fromhex(
        "12390a0a0a08000000000000000010e0a7121a0101222430316132323863372d636530382d376331"
        "312d393730622d6137313431393230323265322a0a677270632d7265712d35"
    )
    ours = bytes(
        env_v1.JoinRequest(
            request_id="7",
            step=env_v1.StepRequest(
                action=spaces_v1.SpaceValue(leaves=[b"\x01" + bytes(7)]), env_indices=[3]
            ),
        )
    )
    for data in (captured, ours):
        fast = _decode._plain_step(data)
        assert fast is not None
        assert fast == decode_join_request(data, num_envs=8)
    # rlmesh.run's whole-vector step at N = 1 (client_run_scalar) is taken too; two lanes,
    # or no action, are the general decoder's.
    scalar = bytes.fromhex(
        "12360a0a0a08000000000000000010e0a712222430316132323863372d636231312d373434322d38"
        "3432342d6338303630323033613336392a0a677270632d7265712d33"
    )
    fast = _decode._plain_step(scalar)
    assert fast is not None and fast.step is not None and fast.step.env_indices == []
    assert fast == decode_join_request(scalar, num_envs=1)
    two = bytes(
        env_v1.JoinRequest(
            step=env_v1.StepRequest(action=spaces_v1.SpaceValue(), env_indices=[0, 1])
        )
    )
    bare = bytes(env_v1.JoinRequest(step=env_v1.StepRequest(env_indices=[0])))
    assert _decode._plain_step(two) is None
    assert _decode._plain_step(bare) is None
