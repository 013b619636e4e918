"""Address parsing (the forms rlmesh accepts) and binding the listening socket."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from rlmesh_trio._address import (
    DEFAULT_ADDRESS,
    TcpAddress,
    UnixAddress,
    bind,
    parse_address,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (DEFAULT_ADDRESS, TcpAddress("127.0.0.1", 0)),
        ("tcp://127.0.0.1:50051", TcpAddress("127.0.0.1", 50051)),
        ("TCP://localhost:0", TcpAddress("localhost", 0)),
        ("127.0.0.1:7", TcpAddress("127.0.0.1", 7)),
        ("0.0.0.0:65535", TcpAddress("0.0.0.0", 65535)),
        ("50051", TcpAddress("127.0.0.1", 50051)),
        ("0", TcpAddress("127.0.0.1", 0)),
        (":0", TcpAddress("127.0.0.1", 0)),
        ("tcp://:9", TcpAddress("127.0.0.1", 9)),
        ("[::1]:50051", TcpAddress("::1", 50051)),
        ("tcp://[::]:0", TcpAddress("::", 0)),
        ("tcp://[fe80::1%eth0]:5", TcpAddress("fe80::1%eth0", 5)),
        ("unix:///tmp/x.sock", UnixAddress("/tmp/x.sock")),
    ],
)
def test_parse_accepted_forms(text: str, expected: object) -> None:
    assert parse_address(text) == expected


def test_parse_relative_unix_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_address("unix://rel.sock") == UnixAddress(str(tmp_path / "rel.sock"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        (" 127.0.0.1:1", "whitespace"),
        ("garbage", "invalid port 'garbage'"),
        ("tcp://127.0.0.1", "invalid port '127.0.0.1'"),
        ("127.0.0.1:99999", "port 99999 out of range"),
        ("127.0.0.1:-1", "invalid port '-1'"),
        ("tcp://127.0.0.1:0/x", "invalid port '0/x'"),
        ("http://127.0.0.1:0", "unsupported address scheme 'http'"),
        ("unix://", "missing socket path"),
        ("::1:50051", "brackets"),
        ("[::1]", "expected ':port'"),
        ("[::1:5", "missing ']'"),
        ("[nothost]:5", "is not an IPv6 address"),
        ("my host:5", "invalid host"),
        ("127.0.0.1:٣", "invalid port"),
    ],
)
def test_parse_rejects_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match="invalid address") as info:
        parse_address(text)
    assert reason in str(info.value)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        parse_address(50051)  # type: ignore[arg-type]


def test_addresses_print_in_rlmesh_form() -> None:
    assert str(TcpAddress("127.0.0.1", 5)) == "tcp://127.0.0.1:5"
    assert str(TcpAddress("::1", 5)) == "tcp://[::1]:5"
    assert str(UnixAddress("/run/x.sock")) == "unix:///run/x.sock"


def test_bind_tcp_port_zero_reports_the_real_port() -> None:
    listener = bind(parse_address("tcp://127.0.0.1:0"))
    try:
        assert isinstance(listener.address, TcpAddress)
        assert listener.address.host == "127.0.0.1"
        assert listener.address.port > 0
        assert listener.sock.getsockname()[1] == listener.address.port
        # It listens already: a client can connect (and waits in the backlog).
        with socket.create_connection(("127.0.0.1", listener.address.port), timeout=5):
            pass
    finally:
        listener.cleanup()
    assert listener.sock.fileno() == -1


def test_bind_localhost_prefers_ipv4() -> None:
    listener = bind(parse_address("localhost:0"))
    try:
        assert listener.address == TcpAddress("127.0.0.1", listener.address.port)  # type: ignore[union-attr]
    finally:
        listener.cleanup()


def test_bind_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        listener = bind(parse_address("[::1]:0"))
    except OSError as exc:
        pytest.skip(f"IPv6 loopback unavailable: {exc}")
    try:
        assert str(listener.address).startswith("tcp://[::1]:")
    finally:
        listener.cleanup()


def test_bind_tcp_address_in_use() -> None:
    first = bind(parse_address("127.0.0.1:0"))
    try:
        with pytest.raises(OSError, match=r"cannot bind tcp://127\.0\.0\.1") as info:
            bind(first.address)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        first.cleanup()


def test_bind_unix_creates_and_cleanup_removes(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener = bind(parse_address(f"unix://{path}"))
    assert listener.address == UnixAddress(str(path))
    assert path.is_socket()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(path))
    finally:
        client.close()
    listener.cleanup()
    assert not path.exists()


def test_bind_unix_replaces_a_stale_socket_file(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens
    assert path.is_socket()
    listener = bind(UnixAddress(str(path)))
    try:
        assert path.is_socket()
    finally:
        listener.cleanup()


def test_bind_unix_refuses_a_live_socket(tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    first = bind(UnixAddress(str(path)))
    try:
        with pytest.raises(OSError, match="Address already in use") as info:
            bind(UnixAddress(str(path)))
        assert info.value.errno == errno.EADDRINUSE
        assert path.is_socket()  # still the first server's
    finally:
        first.cleanup()


def test_bind_unix_refuses_to_replace_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "file.sock"
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        bind(UnixAddress(str(path)))
    assert path.read_text() == "not a socket"


def test_cleanup_leaves_a_socket_file_someone_else_recreated(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener = bind(UnixAddress(str(path)))
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    try:
        listener.cleanup()
        assert path.is_socket()
    finally:
        other.close()
