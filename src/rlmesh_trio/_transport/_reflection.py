"""gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``), behind ``--reflection``.

grpclib's own reflection servicers answer (``grpclib.reflection``: list services, file
by name, file containing a symbol, extensions), from a descriptor pool of this server's
own: the ``FileDescriptorSet`` that ``nox -s codegen`` writes from ``proto/``
(``_proto/descriptors.binpb``: the rlmesh services and ``grpc.health.v1``), plus the
reflection protocol's own files. Nothing is added to protobuf's process-wide default
pool, so an embedding program's descriptors are never touched.

The servicers speak protobuf messages; the transport moves bytes (``RawCodec``).
:class:`_MessageStream` is the servicer's view of one call: requests parsed as they
arrive, replies serialized as they are sent, each request bounded in size.

Needs the ``protobuf`` package (the ``reflection`` extra); asking for reflection
without it is a startup error that says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from ._shim import read_message, reflection_servicers

__all__ = ["REFLECTION_MAX_BYTES", "SERVICE_NAMES", "ReflectionServices"]

SERVICE_NAMES = (
    "rlmesh.env.v1.EnvService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
)
"""What ``list`` answers: every service this server has when reflection is on."""

V1_PATH = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
V1ALPHA_PATH = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

REFLECTION_MAX_BYTES = 64 << 10
"""The largest reflection request read: a symbol or file name, a few hundred bytes."""


def _protobuf() -> Any:
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool
    except ImportError as exc:
        raise RuntimeError(
            "server reflection needs protobuf: pip install '.[reflection]' from a clone "
            "(or 'protobuf>=5.29')"
        ) from exc
    return descriptor_pb2, descriptor_pool


class _MessageStream:
    """One reflection call as grpclib's servicer sees a stream: ``async for`` over the
    parsed requests, ``send_message`` of a reply message."""

    def __init__(self, stream: Stream[bytes, bytes], parse: Callable[[bytes], Any]) -> None:
        self._stream = stream
        self._parse = parse

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._requests()

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            data = await read_message(self._stream, REFLECTION_MAX_BYTES)
            if data is None:
                return
            try:
                request = self._parse(bytes(data))
            except Exception as exc:  # protobuf's DecodeError, whatever its module
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "unreadable ServerReflectionRequest"
                ) from exc
            yield request

    async def send_message(self, message: Any) -> None:
        await self._stream.send_message(message.SerializeToString())


class ReflectionServices:
    """The v1 and v1alpha reflection servicers over this server's descriptors; built
    once at startup (raises :class:`RuntimeError` without protobuf)."""

    def __init__(self) -> None:
        descriptor_pb2, descriptor_pool = _protobuf()
        from grpclib.reflection.v1 import reflection_pb2 as v1_messages
        from grpclib.reflection.v1alpha import reflection_pb2 as v1alpha_messages

        pool = descriptor_pool.DescriptorPool()
        files = descriptor_pb2.FileDescriptorSet.FromString(
            resources.files("rlmesh_trio._proto").joinpath("descriptors.binpb").read_bytes()
        )
        for file in files.file:
            pool.Add(file)
        for module in (v1_messages, v1alpha_messages):
            pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
        self._v1, self._v1alpha = reflection_servicers(SERVICE_NAMES, pool)
        self._parse_v1 = v1_messages.ServerReflectionRequest.FromString
        self._parse_v1alpha = v1alpha_messages.ServerReflectionRequest.FromString

    def handlers(self) -> list[tuple[str, Any]]:
        """(path, handler) of each reflection service this grpclib can serve."""
        served = [(V1_PATH, self._v1, self.v1), (V1ALPHA_PATH, self._v1alpha, self.v1alpha)]
        return [(path, handler) for path, servicer, handler in served if servicer is not None]

    async def v1(self, stream: Stream[bytes, bytes]) -> None:
        await self._v1.ServerReflectionInfo(_MessageStream(stream, self._parse_v1))
        await stream.send_trailing_metadata()

    async def v1alpha(self, stream: Stream[bytes, bytes]) -> None:
        await self._v1alpha.ServerReflectionInfo(_MessageStream(stream, self._parse_v1alpha))
        await stream.send_trailing_metadata()
