"""gRPC server reflection behind ``--reflection`` (issue 17, item 5), with the suite's
own raw client: what grpcurl's ``list`` and ``describe`` ask, on v1 and v1alpha.

The requests and replies are built and parsed with grpclib's generated reflection
messages and protobuf's descriptor classes (the test side); the server under test is a
subprocess, as a user runs it.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import scripts, wire
from support.params import skip_without_ours
from support.refserver import ServerConfig, ServerPool

pytest.importorskip("google.protobuf")

from google.protobuf import descriptor_pb2, descriptor_pool
from grpclib.reflection.v1 import reflection_pb2 as v1
from grpclib.reflection.v1alpha import reflection_pb2 as v1alpha

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

PATHS = {
    "v1": ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", v1),
    "v1alpha": ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", v1alpha),
}
TOKEN = "r3fl-ect"


def config(*args: str) -> ServerConfig:
    return ServerConfig(
        entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1, ours_args=("--reflection", *args)
    )


def ask(
    address: str, version: str, requests: list[Any], headers: tuple[tuple[str, str], ...] = ()
) -> tuple[wire.CallEnd, list[Any]]:
    path, messages = PATHS[version]

    async def go() -> tuple[wire.CallEnd, list[bytes]]:
        async with wire.WireClient(address) as client:
            return await client.stream_call(
                path, [r.SerializeToString() for r in requests], extra_headers=headers
            )

    end, replies = wire.run(go())
    return end, [messages.ServerReflectionResponse.FromString(r) for r in replies]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
@skip_without_ours
def test_list_and_describe_every_service(servers: ServerPool, version: str) -> None:
    server = servers.get("ours", config())
    messages = PATHS[version][1]
    request = messages.ServerReflectionRequest
    end, replies = ask(
        server.address,
        version,
        [
            request(list_services=""),
            request(file_containing_symbol="rlmesh.env.v1.EnvService"),
            request(file_containing_symbol="rlmesh.env.v1.JoinRequest"),
            request(file_containing_symbol="grpc.health.v1.Health"),
            request(file_containing_symbol="no.such.Symbol"),
            request(file_by_filename="no/such/file.proto"),
        ],
    )
    assert end.status == 0, end
    assert len(replies) == 6
    services = {s.name for s in replies[0].list_services_response.service}
    assert services == {
        "rlmesh.env.v1.EnvService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    # Describe EnvService as grpcurl would: the file, then its imports by name, until
    # every type of every method resolves in a pool built from what the server sent.
    pool = descriptor_pool.DescriptorPool()
    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def take(reply: Any) -> None:
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            files[proto.name] = proto

    take(replies[1])
    take(replies[2])
    take(replies[3])
    missing = [d for f in list(files.values()) for d in f.dependency if d not in files]
    while missing:
        end, more = ask(server.address, version, [request(file_by_filename=m) for m in missing])
        assert end.status == 0
        for reply in more:
            assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
            take(reply)
        missing = [d for f in list(files.values()) for d in f.dependency if d not in files]

    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        for dependency in files[name].dependency:
            add(dependency)
        pool.Add(files[name])
        added.add(name)

    for name in list(files):
        add(name)
    service = pool.FindServiceByName("rlmesh.env.v1.EnvService")
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods["Join"] == ("rlmesh.env.v1.JoinRequest", "rlmesh.env.v1.JoinResponse")
    assert set(methods) == {"Handshake", "Join", "Shutdown"}
    join = pool.FindMethodByName("rlmesh.env.v1.EnvService.Join")
    assert join.client_streaming and join.server_streaming
    health = pool.FindServiceByName("grpc.health.v1.Health")
    assert [m.name for m in health.methods] == ["Check"]
    for reply in replies[4:]:
        assert reply.error_response.error_code == 5  # NOT_FOUND


@skip_without_ours
def test_reflection_is_off_by_default_and_needs_the_token(servers: ServerPool) -> None:
    plain = servers.get(
        "ours", ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    )
    request = v1.ServerReflectionRequest(list_services="")
    end, replies = ask(plain.address, "v1", [request])
    assert (end.status, replies) == (12, [])  # UNIMPLEMENTED, as any unknown method

    guarded = servers.fresh("ours", config("--auth-token", TOKEN), probe=False)
    end, _ = ask(guarded.address, "v1", [request])
    assert end.status == 16  # UNAUTHENTICATED: reflection is not exempt
    end, replies = ask(
        guarded.address, "v1", [request], headers=(("authorization", f"Bearer {TOKEN}"),)
    )
    assert end.status == 0 and len(replies[0].list_services_response.service) == 4


@skip_without_ours
def test_garbage_and_oversized_reflection_requests(servers: ServerPool) -> None:
    server = servers.get("ours", config())

    async def raw(payloads: list[bytes]) -> wire.CallEnd:
        async with wire.WireClient(server.address) as client:
            end, _ = await client.stream_call(PATHS["v1"][0], payloads)
            return end

    assert wire.run(raw([b"\xff\xff\xff"])).status == 3  # INVALID_ARGUMENT
    assert wire.run(raw([b"\x0a" + b"\x80" * 3 + b"\x01" + b"x" * (70 << 10)])).status == 8
    end, replies = ask(server.address, "v1", [v1.ServerReflectionRequest(host="h")])
    assert end.status == 0
    assert replies[0].error_response.error_code == 3  # no request arm: invalid argument
    wire.run(wire.probe_handshake(server.address, 10))  # serving on
