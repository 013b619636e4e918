"""The one sans-IO gRPC framing (issue 18, item 2): ``frame``, ``MessageReader`` and the
``grpc-message`` codec, used by the server's request reader, the client and the probe."""

from __future__ import annotations

import itertools
import struct
import tracemalloc

import pytest
from grpclib.metadata import decode_grpc_message as grpclib_decode
from grpclib.metadata import encode_grpc_message as grpclib_encode
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh_trio._errors import FrameError, MessageTooLarge
from rlmesh_trio._wire import (
    SMALL_MESSAGE,
    MessageReader,
    decode_grpc_message,
    encode_grpc_message,
    frame,
)


def cut_all(reader: MessageReader, chunks: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for chunk in chunks:
        rest: bytes | memoryview | None = chunk
        while rest is not None:
            message, rest = reader.cut(rest)
            if message is not None:
                out.append(bytes(message))
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_chunking_gives_the_same_messages(messages: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(m) for m in messages)
    reader = MessageReader(1 << 20)
    assert cut_all(reader, split(stream, cuts)) == messages
    assert not reader.mid_message


def test_frame_is_the_grpc_prefix() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00" * 5


def test_a_big_message_across_many_chunks_and_a_truncated_end() -> None:
    body = bytes(range(256)) * ((SMALL_MESSAGE // 256) + 3)  # over SMALL_MESSAGE
    data = frame(body) + frame(b"tail")
    reader = MessageReader(len(body))
    chunks = [data[i : i + 65536] for i in range(0, len(data), 65536)]
    assert cut_all(reader, chunks) == [body, b"tail"]
    cut_all(reader, [frame(b"half")[:6]])
    assert reader.mid_message
    reader.clear()
    assert not reader.mid_message


def test_a_lying_prefix_allocates_only_what_arrived() -> None:
    reader = MessageReader(1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert reader.cut(struct.pack(">BI", 0, (1 << 30) - 1)) == (None, None)
        assert reader.cut(b"x" * 1000) == (None, None)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, grown
    assert reader.mid_message


@pytest.mark.parametrize(
    ("prefix", "error", "text"),
    [
        (b"\x01\x00\x00\x00\x01", FrameError, "compressed-flag but no grpc-encoding"),
        (b"\x07\x00\x00\x00\x01", FrameError, "invalid compression flag: 7"),
        (b"\x00\x00\x00\x01\x00", MessageTooLarge, "found 256 bytes, the limit is: 255"),
    ],
)
def test_bad_prefixes(prefix: bytes, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        MessageReader(255).cut(prefix + b"x")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_grpc_message_codec_agrees_with_grpclib(text: str) -> None:
    """Our trailers-only answers and grpclib's own must spell a message the same."""
    encoded = encode_grpc_message(text)
    assert encoded == grpclib_encode(text)
    assert encoded.isascii()
    assert decode_grpc_message(encoded) == text == grpclib_decode(encoded)


def test_grpc_message_decoding_never_fails() -> None:
    assert decode_grpc_message("%FF%zz caf%C3%A9") == "\ufffd%zz café"
