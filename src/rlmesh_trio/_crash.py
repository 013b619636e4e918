"""What ``rlmesh-trio serve`` says when the process dies of a native crash.

A segfault in an env's native code on a thread lane takes the whole process with it:
no Python code runs after the signal. Two things still speak for it:

* :mod:`faulthandler` (enabled by the CLI, for every thread): the C-level handler
  writes Python's "Fatal Python error" and every thread's stack to stderr as the
  process dies -- the lane thread's stack names the env's file and line;
* a *witness*: a tiny child process holding the read end of a pipe. It learns of the
  end of the server when the pipe closes; unless the server said goodbye first (a
  normal exit, :meth:`CrashWitness.dismiss`), it writes one line naming
  ``--lane-isolation process`` (each env in a process of its own: a crash costs one
  lane) after the dump.

``faulthandler`` is process-wide state: :func:`rlmesh_trio.serve_env` leaves it to the
embedding program; only the CLI arms it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import subprocess
import sys
from typing import IO

__all__ = ["CrashWitness"]

_WITNESS = r"""
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server
signal.signal(signal.SIGTERM, signal.SIG_IGN)
said = sys.stdin.buffer.read()
if said != b"bye":
    sys.stderr.write(sys.argv[1] + "\n")
    sys.stderr.flush()
"""


def _line(prog: str, isolation: str) -> str:
    if isolation == "process":
        return (
            f"{prog}: the server process died without stopping (a native crash in the "
            "server itself, or it was killed); the stacks above, if any, show where"
        )
    return (
        f"{prog}: the server died without stopping: a native crash (the stacks above show "
        "where: a rlmesh-trio-lane thread is an env) or a kill. With --lane-isolation "
        "process each env runs in a process of its own, and a crash costs only its lane"
    )


class CrashWitness:
    """Arms :mod:`faulthandler` and starts the witness; :meth:`dismiss` on a normal
    exit. Best effort: without a witness (no ``sys.executable``), the dump still comes."""

    def __init__(self, prog: str, isolation: str, stderr: IO[str] | None = None) -> None:
        stream = stderr if stderr is not None else sys.stderr
        self._enabled_here = False
        with contextlib.suppress(Exception):  # no fd behind stderr (embedded, captured)
            if not faulthandler.is_enabled():
                faulthandler.enable(file=stream, all_threads=True)
                self._enabled_here = True
        self._witness: subprocess.Popen[bytes] | None = None
        if sys.executable:
            with contextlib.suppress(OSError):
                self._witness = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _WITNESS, _line(prog, isolation)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    close_fds=True,
                )

    def dismiss(self) -> None:
        """The server stops normally: the witness exits without a word."""
        witness, self._witness = self._witness, None
        if witness is not None and witness.stdin is not None:
            with contextlib.suppress(OSError):
                witness.stdin.write(b"bye")
                witness.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                witness.wait(timeout=5)
        if self._enabled_here:
            faulthandler.disable()
            self._enabled_here = False
