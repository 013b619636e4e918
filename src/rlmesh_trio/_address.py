"""Server addresses: the forms rlmesh accepts, and binding the listening socket.

Accepted (like ``rlmesh.EnvServer``): ``tcp://host:port``, ``host:port``, a bare
``port`` (host ``127.0.0.1``), ``unix:///path/to.sock`` (a relative path after
``unix://`` is taken from the working directory). An empty host means ``127.0.0.1``.
IPv6 hosts go in brackets: ``[::1]:50051`` (rlmesh 0.1.0 itself cannot bind those).
Port ``0`` asks the kernel for a free port; :func:`bind` reports the real one.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass

DEFAULT_ADDRESS = "tcp://127.0.0.1:0"
DEFAULT_HOST = "127.0.0.1"
LISTEN_BACKLOG = 128
_UNIX_PROBE_TIMEOUT = 1.0
"""Seconds to wait when checking whether an existing unix socket file is still served."""


@dataclass(frozen=True)
class TcpAddress:
    host: str
    """A host name or an IP address, IPv6 without brackets."""
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True)
class UnixAddress:
    path: str
    """Absolute path of the socket file."""

    def __str__(self) -> str:
        return f"unix://{self.path}"


Address = TcpAddress | UnixAddress


def parse_address(address: str) -> Address:
    """Parse an address string; raise ValueError with a readable reason otherwise."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, not {type(address).__name__}")
    if not address or address != address.strip():
        raise ValueError(f"invalid address {address!r}: empty or surrounded by whitespace")
    scheme, sep, rest = address.partition("://")
    if not sep:
        return _parse_host_port(address, address)
    scheme = scheme.lower()
    if scheme == "unix":
        if not rest:
            raise ValueError(f"invalid address {address!r}: missing socket path after unix://")
        if "\x00" in rest:
            raise ValueError(f"invalid address {address!r}: NUL byte in socket path")
        return UnixAddress(os.path.abspath(rest))
    if scheme == "tcp":
        return _parse_host_port(rest, address)
    raise ValueError(
        f"invalid address {address!r}: unsupported address scheme {scheme!r} "
        "(use tcp://host:port, host:port, port or unix:///path)"
    )


def _parse_host_port(text: str, original: str) -> TcpAddress:
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"invalid address {original!r}: missing ']' after the IPv6 host")
        host, after = text[1:close], text[close + 1 :]
        if not after.startswith(":"):
            raise ValueError(f"invalid address {original!r}: expected ':port' after [{host}]")
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(
                f"invalid address {original!r}: {host!r} is not an IPv6 address"
            ) from None
        return TcpAddress(host, _parse_port(after[1:], original))
    if text.count(":") > 1:
        raise ValueError(
            f"invalid address {original!r}: put an IPv6 host in brackets, e.g. tcp://[::1]:50051"
        )
    host, sep, port = text.rpartition(":")
    if not sep:
        return TcpAddress(DEFAULT_HOST, _parse_port(text, original))
    if any(ch.isspace() or ch in "/?#@[]" for ch in host):
        raise ValueError(f"invalid address {original!r}: invalid host {host!r}")
    return TcpAddress(host or DEFAULT_HOST, _parse_port(port, original))


def _parse_port(text: str, original: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"invalid address {original!r}: invalid port {text!r}")
    port = int(text)
    if port > 65535:
        raise ValueError(f"invalid address {original!r}: port {port} out of range 0-65535")
    return port


def endpoint_addresses(address: Address, count: int) -> list[Address]:
    """The addresses of ``count`` endpoints served from ``address``: one is the address
    itself; several take consecutive ports from a TCP address's port (port 0: a free port
    each) or, from ``unix:///dir/name.sock``, the sockets ``name-0.sock``,
    ``name-1.sock``, ... beside it."""
    if count == 1:
        return [address]
    if isinstance(address, UnixAddress):
        root, ext = os.path.splitext(address.path)
        return [UnixAddress(f"{root}-{k}{ext}") for k in range(count)]
    if address.port == 0:
        return [address] * count
    last = address.port + count - 1
    if last > 65535:
        raise ValueError(
            f"{count} endpoints from port {address.port} need ports up to {last}, past 65535"
        )
    return [TcpAddress(address.host, address.port + k) for k in range(count)]


@dataclass
class Listener:
    """A bound, listening server socket and the address it really has."""

    sock: socket.socket
    address: Address
    _unix_inode: tuple[int, int] | None = None

    def cleanup(self) -> None:
        """Close the socket (idempotent) and remove a unix socket file we created."""
        self.sock.close()
        if isinstance(self.address, UnixAddress) and self._unix_inode is not None:
            try:
                st = os.stat(self.address.path)
            except OSError:
                return
            if (st.st_dev, st.st_ino) == self._unix_inode:
                with contextlib.suppress(OSError):
                    os.unlink(self.address.path)


def bind(address: Address) -> Listener:
    """Create the server socket, bind it and listen; raise OSError naming the address.

    Listening at once makes "address in use" fail here, reliably (on Linux two
    ``SO_REUSEADDR`` sockets may both *bind* one port; only one can listen). Clients
    that connect before the transport serves wait in the backlog.
    """
    if isinstance(address, UnixAddress):
        return _bind_unix(address)
    return _bind_tcp(address)


def _bind_tcp(address: TcpAddress) -> Listener:
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot bind {address}: {exc.strerror}") from exc
    # Prefer IPv4 for names such as "localhost", like the reference server does.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        if os.name == "posix":
            # Rebinding a port whose previous owner left TIME_WAIT connections; a live
            # listener on the port still makes bind() fail with EADDRINUSE.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {address}: {exc.strerror}") from exc
    host, port = sock.getsockname()[:2]
    return Listener(sock, TcpAddress(host, port))


def _bind_unix(address: UnixAddress) -> Listener:
    path = address.path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(
                errno.EEXIST, f"cannot bind {address}: the path exists and is not a socket"
            )
        if _unix_socket_alive(path):
            raise OSError(errno.EADDRINUSE, f"cannot bind {address}: Address already in use")
        # A stale socket file left by a server that is gone.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {address}: {exc.strerror or exc}") from exc
    st = os.stat(path)
    listener = Listener(sock, address, (st.st_dev, st.st_ino))
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        listener.cleanup()
        raise OSError(exc.errno, f"cannot listen on {address}: {exc.strerror or exc}") from exc
    return listener


def _unix_socket_alive(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_UNIX_PROBE_TIMEOUT)
    try:
        probe.connect(path)
    except OSError:
        return False
    else:
        return True
    finally:
        probe.close()


def is_loopback(address: Address) -> bool:
    """Whether only this machine can reach ``address``: a unix socket, a loopback IP or
    ``localhost``. A wildcard (``0.0.0.0``, ``::``), any other IP and any other host
    name count as reachable from elsewhere."""
    return isinstance(address, UnixAddress) or is_loopback_host(address.host)


def is_loopback_host(host: str) -> bool:
    """Whether a TCP host is reachable from this machine only: a loopback IP or
    ``localhost`` (see :func:`is_loopback`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
