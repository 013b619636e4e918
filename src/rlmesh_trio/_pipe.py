"""One end of a socketpair to a child process of the server: whole pickled messages.

What a process lane (:mod:`rlmesh_trio._lanes._process`) and the dataset recorder's
writer process (:mod:`rlmesh_trio._record._child`) speak with their children, and how a
child dies with its parent. A plain child started with ``python -m`` and a socketpair,
not ``multiprocessing``: ``fork`` is out (the server has threads) and ``spawn`` re-runs
the caller's ``__main__``, which breaks any program embedding ``serve_env`` without a
``__main__`` guard.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
from typing import Any, Final

from ._options import MAX_MESSAGE_BYTES

__all__ = [
    "FRAME_LIMIT",
    "PIPE_MESSAGE_CAP",
    "RECV_CHUNK",
    "PipeEnd",
    "PipeViolation",
    "die_with_parent",
    "start_child",
]

_LENGTH = struct.Struct("!I")
FRAME_LIMIT: Final = (1 << 32) - 1
"""The longest message the 4-byte length can frame."""
RECV_CHUNK = 1 << 16
"""Bytes asked of the socket at once: a step's whole message (header and body) in one
read, a big observation in as few as its size needs."""

PIPE_MESSAGE_CAP: Final = MAX_MESSAGE_BYTES + (16 << 20)
"""The largest message a lane's pipe carries (bytes of pickle): 272 MiB; a longer one is
a protocol violation (:class:`PipeViolation`).

A message is one lane's share of one request or reply: a step's action leaves, a
result's observation leaves and info map (as bytes), a PNG frame, an exception's text.
The server refuses a gRPC message over ``max_message_bytes`` (256 MiB by default,
:data:`~rlmesh_trio._options.MAX_MESSAGE_BYTES`) either way, so a legit message is at
most that plus pickle's framing (a few bytes per leaf); 16 MiB above it is room to
spare, far above an Atari frame (100 KiB) or a big observation dict, and far below what
a buggy env writing 4 stray bytes could otherwise announce (up to 4 GiB)."""


class PipeViolation(Exception):
    """The other end of a lane's pipe broke the protocol: a length over the cap, bytes
    past a message, a message that does not unpickle. The text says what it sent."""


class PipeEnd:
    """One end of a lane's socketpair: whole pickled messages, each a 4-byte big-endian
    length and the pickle.

    What ``multiprocessing.connection.Connection`` does over a socket, in one read per
    message instead of two (the length, then the body) and without its buffering
    layers: a step's job and its result cross in one syscall each way. Messages are
    strictly request/answer, so a read never holds the start of the next one. EOFError
    when the other end is gone; ``send`` pickles before it writes, so an object that
    cannot be pickled raises and nothing is sent.

    The other end is not trusted (env code in a child can write anything to its fd): a
    longer message's buffer grows with the bytes that arrived (at most twice them), never
    from the length the peer announced, and :class:`PipeViolation` is raised for a length
    over :data:`PIPE_MESSAGE_CAP`, bytes past a message, or bytes that do not unpickle.
    """

    __slots__ = ("_cap", "_sock", "_trusted")

    def __init__(
        self, sock: socket.socket, cap: int = PIPE_MESSAGE_CAP, *, trusted: bool = False
    ) -> None:
        self._sock = sock
        self._cap = cap
        """The longest message this end accepts (a child trusts its parent more)."""
        self._trusted = trusted
        """The peer is the server: a long message's buffer is made at its announced size
        at once (no growing copies), up to ``cap``."""

    def send(self, obj: Any) -> None:
        self.send_pickled(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def send_pickled(self, data: bytes) -> None:
        """Send one message already pickled (by a pickler of the caller's own). A message
        over :data:`FRAME_LIMIT` bytes cannot be framed: ``ValueError``, nothing sent."""
        if len(data) > FRAME_LIMIT:
            raise ValueError(
                f"a {len(data)}-byte message is over the pipe's {FRAME_LIMIT}-byte frame limit"
            )
        header = _LENGTH.pack(len(data))
        if len(data) < RECV_CHUNK:  # a step's messages: one syscall
            self._sock.sendall(header + data)
        else:  # a big one: not copied once more to prepend 4 bytes
            self._sock.sendall(header)
            self._sock.sendall(data)

    def recv(self) -> Any:
        chunk = self._sock.recv(RECV_CHUNK)
        if len(chunk) >= 4 and _LENGTH.unpack_from(chunk)[0] == len(chunk) - 4:
            try:  # the common case: the whole message in one read
                return pickle.loads(memoryview(chunk)[4:])
            except Exception as exc:
                raise _garbage(len(chunk) - 4, exc) from None
        return self._recv_rest(chunk)

    def _recv_rest(self, chunk: bytes) -> Any:
        """A message longer than one read, or a header split across reads."""
        sock = self._sock
        head = chunk
        while len(head) < 4:
            more = sock.recv(RECV_CHUNK)
            if not more:
                raise EOFError
            head += more
        (size,) = _LENGTH.unpack_from(head)
        if size > self._cap:
            raise PipeViolation(f"announced a {size}-byte message; the cap is {self._cap} bytes")
        have = len(head) - 4
        if have > size:  # never, with one message in flight
            raise PipeViolation(f"sent {have - size} bytes past a {size}-byte message")
        # Sized from what arrived, not from ``size``: a peer that announces 200 MiB and
        # sends 3 bytes costs one read's worth; the buffer doubles as the bytes come.
        # (A trusted peer's announced size is believed: one buffer, no growing copies.)
        body = bytearray(size if self._trusted else min(size, max(2 * have, RECV_CHUNK)))
        body[:have] = memoryview(head)[4:]
        del head, chunk
        while have < size:
            if have == len(body):
                grown = bytearray(min(size, 2 * have))
                grown[:have] = body
                body = grown
            got = sock.recv_into(memoryview(body)[have:])
            if not got:
                raise EOFError
            have += got
        try:
            return pickle.loads(body)
        except Exception as exc:
            raise _garbage(size, exc) from None

    def close(self) -> None:
        self._sock.close()


def _garbage(size: int, exc: Exception) -> PipeViolation:
    return PipeViolation(
        f"sent a {size}-byte message that does not unpickle ({type(exc).__name__}: {exc})"
    )


def start_child(module: str, name: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """``python -m MODULE FD PARENT_PID NAME`` (``NAME`` only labels it in ``ps``) with
    one end of a new socketpair as ``FD``; the child and the server's end."""
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid()), name],
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs us when the thread that forked us exits; elsewhere (and
    as a backstop) the pipe's EOF ends the main loop."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        except Exception:
            pass
    if os.getppid() != parent_pid:  # the parent died before the prctl
        os._exit(1)
