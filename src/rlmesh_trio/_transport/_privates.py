"""Every private name of grpclib and h2 the transport touches, as data (issue 29).

A library's private name can change in any release. Each one used in this package is a
:class:`Reach` in :data:`REACHES`: where it lives, whether we read, write, call or import
it, why, and what the transport does when it is not what the code expects. Nothing else
of the two libraries is private to us: ``tests/test_transport_privates.py`` resolves every
entry against real objects of the installed versions, and scans ``_transport/`` and the
client's ``_grpc.py`` (the one other module that drives h2) so that a private use missing
from this list fails the suite: an underscored name read, written, called or imported, a
``super()._x`` call, and a method of ours overriding a library class's private one. What
no scan sees, behaviour the libraries do not promise (an internal attribute without an
underscore, an object's class swapped), is listed too (``access="behaviour"``), each
checked on a real object.

The one path that needs h2's privates, the Join's direct DATA path (:mod:`._h2frames`),
is checked once per process before the first connection (:func:`direct_data_path`):
structurally (every name there, of the expected kind) and by behaviour (a frame taken and
a frame queued past h2 leave h2 exactly where its own ``receive_data`` / ``send_data``
leave it). When either check fails -- an h2 release that renamed or changed what we use --
the transport takes h2's public API instead, slower and never broken, and says so once
(a warning naming h2's version). ``RLMESH_TRIO_DIRECT_DATA=0`` in the environment forces
the public path (for tests, and for anyone who suspects the fast path).

grpclib's few privates each have their own fallback (:func:`dispatch_events`,
:func:`server_configuration`, and reflection's in :mod:`._shim`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

__all__ = [
    "DIRECT_DATA_ENV",
    "PUBLIC_DATA",
    "REACHES",
    "Reach",
    "check_h2",
    "direct_data_path",
    "dispatch_events",
    "library_version",
    "server_configuration",
]

log = logging.getLogger("rlmesh_trio.transport")

DIRECT_DATA_ENV = "RLMESH_TRIO_DIRECT_DATA"
"""Set to ``0`` to force h2's public path for the Join's DATA frames."""


@dataclass(frozen=True, slots=True)
class Reach:
    """One private name of a library the transport uses."""

    library: Literal["h2", "grpclib"]
    owner: str
    """Where the name lives: ``module`` or ``module:Class``."""
    name: str
    access: Literal["read", "write", "call", "import", "argument", "override", "behaviour"]
    """``override``: a method of ours replaces the library's private one (in a subclass);
    ``behaviour``: no underscore, but what the library does not promise (an attribute of
    its internals read or written, an object's class swapped)."""
    why: str
    fallback: str
    """What the transport does when the name is not what the code expects."""


PUBLIC_DATA = "h2's public receive_data / send_data for every frame (direct_data_path)"
"""The fallback of every reach of the direct DATA path: each is checked by name in
:func:`check_h2`."""
_PUBLIC_DATA = PUBLIC_DATA

REACHES: tuple[Reach, ...] = (
    # -- h2: the Join's direct DATA path (_h2frames.py)
    Reach(
        "h2",
        "h2.frame_buffer:FrameBuffer",
        "_data",
        "read",
        "h2 holds no partial frame: a frame may bypass it (h2_idle)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.frame_buffer:FrameBuffer",
        "_preamble_len",
        "read",
        "h2 expects no more of the client preface (h2_idle)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.frame_buffer:FrameBuffer",
        "_headers_buffer",
        "read",
        "h2 holds no header block waiting for its CONTINUATION (h2_idle)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.connection:H2Connection",
        "_inbound_flow_control_window_manager",
        "write",
        "a DATA frame taken past h2 shrinks the connection's receive window (take_plain_data)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.connection:H2Connection",
        "_data_to_send",
        "write",
        "a reply's DATA frame queued on h2's output without a frame object (put_plain_data); "
        "the client's request DATA frames likewise (client/_grpc.py: GrpcConnection._send_data)",
        _PUBLIC_DATA + "; the client: h2.send_data when it is not a bytearray or when "
        "RLMESH_TRIO_DIRECT_DATA=0",
    ),
    Reach(
        "h2",
        "h2.stream:H2Stream",
        "_inbound_window_manager",
        "write",
        "a DATA frame taken past h2 shrinks the stream's receive window (take_plain_data)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.stream:H2Stream",
        "_expected_content_length",
        "read",
        "a stream with a content-length is left to h2, which checks it (take_plain_data)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.stream:H2Stream",
        "_actual_content_length",
        "write",
        "the body bytes h2 counts on a stream (take_plain_data)",
        _PUBLIC_DATA,
    ),
    Reach(
        "h2",
        "h2.connection:H2ConnectionStateMachine",
        "state",
        "behaviour",
        "the connection's state read: a frame bypasses h2 only while it is SERVER_OPEN "
        "(h2_idle, put_plain_data); the client writes it back after a graceful GOAWAY "
        "(client/_grpc.py: _GracefulH2Connection)",
        _PUBLIC_DATA + "; the client: see _receive_goaway_frame",
    ),
    # -- h2: the streams past our advertised limit refused one by one (_connection.py)
    Reach(
        "h2",
        "h2.settings:Settings",
        "__class__",
        "behaviour",
        "a connection's local settings made an _EarlyStreams (a subclass of the public "
        "Settings) so that h2 admits streams past the advertised max_concurrent_streams, "
        "which the dispatcher then refuses alone (REFUSED_STREAM)",
        "left as h2 made them when they are not exactly h2.settings.Settings: h2 then "
        "refuses the streams past the advertised limit itself",
    ),
    # -- h2: the client keeps open streams after a graceful GOAWAY (client/_grpc.py)
    Reach(
        "h2",
        "h2.connection:H2Connection",
        "_receive_goaway_frame",
        "override",
        "after a GOAWAY(NO_ERROR) the client goes on reading the replies and trailers of "
        "the streams already open (h2 closes the connection at any GOAWAY)",
        "not called when renamed: a graceful stop ends the client's calls still open with "
        "h2's error, as any lost connection (tests/test_transport_privates.py checks the "
        "override is live)",
    ),
    # -- grpclib: building the request handler as grpclib's Server does (_dispatch.py,
    # _shim.server_config)
    Reach(
        "grpclib",
        "grpclib.events",
        "_DispatchServerEvents",
        "import",
        "the event dispatcher grpclib's Handler takes (no plugin listens to ours)",
        "the one of a throwaway grpclib Server (its __dispatch__, grpclib's plugin hook)",
    ),
    Reach(
        "grpclib",
        "grpclib.config:Configuration",
        "__for_server__",
        "call",
        "grpclib's server defaults (keepalive, windows) as its Server applies them",
        "Configuration() as constructed, with its window sizes",
    ),
    # -- grpclib: server reflection (_shim.reflection_servicers)
    Reach(
        "grpclib",
        "grpclib.reflection",
        "_deprecated",
        "import",
        "the v1alpha reflection servicer lives in this module",
        "grpc.reflection.v1alpha not served (v1 still is), with a warning",
    ),
    Reach(
        "grpclib",
        "grpclib.reflection.service:ServerReflection",
        "_service_names",
        "argument",
        "the service names reflection lists (the public extend() takes servicers)",
        "reflection not served, with a warning (--reflection is optional)",
    ),
    Reach(
        "grpclib",
        "grpclib.reflection.service:ServerReflection",
        "_pool",
        "write",
        "reflection answers from our own descriptor set, not protobuf's global pool",
        "reflection not served, with a warning (--reflection is optional)",
    ),
)


def library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(unknown version)"


# -- h2: the direct DATA path


def _h2_pair() -> tuple[Any, Any]:
    """Two server-side h2 connections in the same state: a client's preface, SETTINGS
    and a request's HEADERS on stream 1 received, their answers drained."""
    import h2.config
    import h2.connection

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(
        1, [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "x")]
    )
    opening = client.data_to_send()
    pair = []
    for _ in range(2):
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        server.receive_data(opening)
        server.data_to_send()
        pair.append(server)
    return pair[0], pair[1]


def check_h2() -> list[str]:
    """What is wrong with the installed h2 for the direct DATA path (empty: nothing):
    each private of :data:`REACHES` of the expected kind, and a frame taken and a frame
    queued past h2 leaving h2 where its own API leaves it."""
    from ._h2frames import h2_idle, put_plain_data, take_plain_data

    problems: list[str] = []
    try:
        ours, theirs = _h2_pair()
        for server in (ours, theirs):
            server.send_headers(1, [(":status", "200")])
            server.data_to_send()
        buffer = ours.incoming_buffer
        stream = ours.streams[1]
        kinds: list[tuple[Any, str, tuple[type, ...]]] = [
            (buffer, "_data", (bytes, bytearray)),
            (buffer, "_preamble_len", (int,)),
            (buffer, "_headers_buffer", (list,)),
            (ours, "_data_to_send", (bytearray,)),
            (stream, "_actual_content_length", (int,)),
            (stream, "_expected_content_length", (int, type(None))),
        ]
        for obj, name, types in kinds:
            if not isinstance(getattr(obj, name, None), types):
                problems.append(f"{type(obj).__name__}.{name} is not a {types[0].__name__}")
        for obj, name in (
            (ours, "_inbound_flow_control_window_manager"),
            (stream, "_inbound_window_manager"),
        ):
            if not isinstance(getattr(getattr(obj, name, None), "current_window_size", None), int):
                problems.append(f"{type(obj).__name__}.{name} has no current_window_size")
        if problems:
            return problems
        # Behaviour: receive 40,000 bytes on stream 1 and give them back: the same
        # WINDOW_UPDATEs must follow, whether the frame went through h2 or past it.
        body = b"x" * 16_000
        frame = len(body).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01" + body
        if not h2_idle(ours):
            problems.append("h2 holds input after a whole frame (h2_idle)")
        for _ in range(3):
            theirs.receive_data(frame)
            if not take_plain_data(ours, 0, 0, 1, len(body)):
                problems.append("a plain DATA frame was not taken (take_plain_data)")
                return problems
        for server in (ours, theirs):
            server.acknowledge_received_data(3 * len(body), 1)
        if ours.data_to_send() != theirs.data_to_send():
            problems.append("receive windows differ from h2's own (take_plain_data)")
        # Send a reply both ways: the same bytes and the same windows after.
        payload = b"y" * 1000
        if not put_plain_data(ours, 1, payload):
            problems.append("a reply frame was not queued (put_plain_data)")
            return problems
        theirs.send_data(1, payload)
        if ours.data_to_send() != theirs.data_to_send():
            problems.append("a queued frame differs from h2's own (put_plain_data)")
        if ours.local_flow_control_window(1) != theirs.local_flow_control_window(1):
            problems.append("send windows differ from h2's own (put_plain_data)")
    except Exception as exc:  # anything at all: the public path is the answer
        problems.append(f"{type(exc).__name__}: {exc}")
    return problems


@functools.cache
def direct_data_path() -> bool:
    """Whether the Join's DATA frames may bypass h2 (checked once per process)."""
    if os.environ.get(DIRECT_DATA_ENV, "").strip() == "0":
        log.info("%s=0: the Join's DATA frames go through h2's public API", DIRECT_DATA_ENV)
        return False
    problems = check_h2()
    if problems:
        log.warning(
            "h2 %s is not what the direct DATA path expects (%s): serving through h2's "
            "public API instead (correct, somewhat slower)",
            library_version("h2"),
            "; ".join(problems),
        )
        return False
    return True


# -- grpclib


def dispatch_events() -> Any:
    """The event dispatcher grpclib's ``Handler`` takes, as its ``Server`` builds it."""
    try:
        from grpclib.events import _DispatchServerEvents

        return _DispatchServerEvents()
    except ImportError:
        pass
    from grpclib.server import Server

    log.warning(
        "grpclib %s has no grpclib.events._DispatchServerEvents: using a Server's",
        library_version("grpclib"),
    )
    return Server([]).__dispatch__


def server_configuration() -> Any:
    """grpclib's server configuration, with its server defaults where it has them."""
    from grpclib.config import Configuration

    config = Configuration()
    for_server = getattr(config, "__for_server__", None)
    if for_server is None:
        log.warning(
            "grpclib %s has no Configuration.__for_server__: its defaults as constructed",
            library_version("grpclib"),
        )
        return config
    return for_server()
