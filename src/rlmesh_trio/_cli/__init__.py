"""The ``rlmesh-trio`` command line (and ``python -m rlmesh_trio``).

One module per subcommand -- ``_serve`` (``serve``), ``_probe`` (``probe``), ``_fleet``
(``fleet``: Ray is imported only when it runs) -- over ``_args`` (what they share: argparse
types, the env-source arguments and the entrypoint loader, the ``--package`` factory
``ImportFirst``, the ready-fd writer) and ``_hints`` (one-line errors with their fix);
the subcommands are imported when the command line runs, so that unpickling an
``ImportFirst`` (in a lane's child) imports no more than ``_args``. The fleet library
(``rlmesh_trio.fleet``) has no command-line code.

Exit codes: 0 done, 1 failed, 2 bad arguments, 128 + N after signal N; when stdout's
reader goes away early (``rlmesh-trio probe ADDR | head -1``) the command exits quietly
with 141 (128 + SIGPIPE, what a shell reports for a command killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from .._version import __version__
from ._args import EXIT_INTERRUPTED, PROG, Parser

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "build_parser", "main"]

EXIT_BROKEN_PIPE = 128 + getattr(signal, "SIGPIPE", 13)
"""The exit code when stdout's reader closed it before we were done writing."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rlmesh-trio`` argument parser: ``serve``, ``probe``, ``fleet``."""
    # The subcommands are imported here, not at the top: a lane's child process that
    # unpickles an :class:`~._args.ImportFirst` imports this package, and only that.
    from ._fleet import add_fleet_parser
    from ._probe import add_probe_parser
    from ._serve import add_serve_parser

    parser = Parser(
        prog=PROG,
        description="Serve gymnasium environments over rlmesh-wire-v1 (rlmesh 0.1.0 clients).",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True
    add_serve_parser(commands)
    add_probe_parser(commands)
    add_fleet_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlmesh-trio``; return the process exit code."""
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is ours to handle
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        # A Ctrl-C before a command's own handling of signals (its imports, say): the
        # shell's convention, without a traceback.
        print("rlmesh-trio: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a parse error (2, already printed)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "probe":
        from ._probe import probe_command

        return probe_command(args)
    if args.command == "fleet":
        from ._fleet import fleet_command

        return fleet_command(args)
    from ._serve import serve_command

    return serve_command(args)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still
    buffered fails nowhere (else: ``Exception ignored ... BrokenPipeError`` at exit)."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (pytest's capture)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- stdout lives until exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fileno)
    finally:
        os.close(devnull)
