"""What ``serve`` and ``fleet`` (and ``probe``) share: the parser class, argparse types, the
env-source arguments and their loading (``--entrypoint``'s ``module:callable``; the
:class:`ImportFirst` factory that imports ``--package`` where the env is built), a
deprecated flag's alias, and the ready-fd writer."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import gymnasium as gym
    from _typeshed import SupportsWrite

__all__ = [
    "PROG",
    "DeprecatedFlag",
    "ImportFirst",
    "Parser",
    "UsageError",
    "add_env_source",
    "check_fd",
    "fd",
    "int_at_least",
    "json_object",
    "load_entrypoint",
    "load_env",
    "seconds",
    "write_ready_fd",
]

PROG = "rlmesh-trio"


class UsageError(Exception):
    """A bad argument combination found after parsing (exit code 2)."""


class Parser(argparse.ArgumentParser):
    """Usage and the message on stderr, exit code 2, for every parse error; a write that
    fails (stdout closed early) raises."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse's own swallows OSError: ``--help | head -c1`` would lose the output
        # silently and exit 0; the CLI's BrokenPipeError handling decides instead.
        if message:
            (file or sys.stderr).write(message)


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: hidden from ``--help``, stores into the new flag's dest,
    and says on stderr which flag replaces it."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.replacement: str = kwargs.pop("replacement")
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated (removed in 0.2); "
            f"use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def int_at_least(minimum: int, flag: str = "") -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (the message names ``flag`` when given)."""

    def parse(value: str) -> int:
        try:
            parsed = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
        if parsed < minimum:
            name = f"{flag} " if flag else ""
            raise argparse.ArgumentTypeError(f"{name}must be >= {minimum}, got {parsed}")
        return parsed

    return parse


def lane_list(value: str) -> tuple[int, ...]:
    """An argparse type: lane indices separated by commas (``0,3``), or ``all``."""
    if value.strip().lower() == "all":
        return ()
    try:
        lanes = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"lanes must be indices separated by commas (0,3) or 'all', got {value!r}"
        ) from None
    if any(lane < 0 for lane in lanes):
        raise argparse.ArgumentTypeError(f"lane indices must be >= 0, got {value!r}")
    return lanes


def json_object(value: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``--kwargs-json``)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("--kwargs-json must be a JSON object")
    return parsed


def seconds(minimum_exclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 or >= 0."""

    def parse(value: str) -> float:
        try:
            parsed = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {value!r}") from None
        if not math.isfinite(parsed) or parsed < 0 or (minimum_exclusive and parsed == 0):
            bound = "> 0" if minimum_exclusive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {value!r}")
        return parsed

    return parse


def add_seconds(parser: Any, flag: str, default: float, what: str) -> None:
    """Add ``flag S``: a finite number of seconds > 0, ``default`` shown in the help."""
    parser.add_argument(
        flag,
        type=seconds(minimum_exclusive=True),
        default=default,
        metavar="S",
        help=f"{what} (default {default:g})",
    )


def fd(value: str) -> int:
    """An argparse type: a file descriptor number (``--ready-fd``)."""
    try:
        parsed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid file descriptor: {value!r}") from None
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"invalid file descriptor: {value!r}")
    return parsed


def check_fd(number: int) -> None:
    """:class:`UsageError` unless ``number`` is an open file descriptor."""
    try:
        os.fstat(number)
    except OSError as exc:
        raise UsageError(f"--ready-fd {number}: {exc.strerror}") from None


def add_env_source(parser: argparse.ArgumentParser, *, where: str) -> None:
    """``--env`` | ``--entrypoint``, ``--kwargs-json``, ``--package``, ``--app-dir``.

    ``where`` says where the env is built (``serve``: "called once per lane"; ``fleet``:
    on every Ray node), for the help text.
    """
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--env", metavar="ID", help="gymnasium env id, e.g. CartPole-v1")
    source.add_argument(
        "--entrypoint",
        metavar="MODULE:CALLABLE",
        help=f"env factory in module:callable form, {where}",
    )
    parser.add_argument(
        "--kwargs-json",
        type=json_object,
        metavar="JSON",
        help="JSON object of keyword arguments for gymnasium.make / the entrypoint",
    )
    parser.add_argument(
        "--package",
        action="append",
        default=[],
        metavar="NAME",
        help="import this package first (e.g. one that registers env ids); repeatable",
    )
    parser.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="put DIR first on sys.path before importing --package / --entrypoint "
        "modules (default: the current directory)",
    )


def load_env(args: argparse.Namespace, *, in_other_processes: bool) -> Callable[..., Any] | str:
    """What ``serve_env`` / ``launch`` take for the env-source arguments: the id, or the
    loaded ``--entrypoint``; wrapped to import ``--package`` first in the process that
    builds the env when that is not this one (``in_other_processes``).

    Raises what importing ``--package`` / the entrypoint raises (and :func:`load_entrypoint`'s
    ``ValueError`` / ``TypeError``).
    """
    # As uvicorn's --app-dir: `rlmesh-trio serve --entrypoint mymod:make` finds mymod in
    # the current directory, as `python -m rlmesh_trio` does.
    app_dir = os.path.abspath(args.app_dir)
    if app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    for name in args.package:
        importlib.import_module(name)
    make_env: str | Callable[..., Any]
    make_env = args.env if args.env is not None else load_entrypoint(args.entrypoint)
    if in_other_processes and args.package:
        make_env = ImportFirst(tuple(args.package), make_env)
    return make_env


class ImportFirst:
    """A picklable env factory that imports packages first, in whichever process calls it.

    For ``rlmesh-trio serve --package ale_py --lane-isolation process`` (and the fleet's
    endpoints): the packages that register env ids must be imported in each process that
    builds an env, not only in this one. Unpickling it imports this module, which
    imports nothing of the server (the package's ``__init__`` imports the subcommands
    only when the command line runs), so a lane's child stays as light as before.
    """

    def __init__(self, packages: tuple[str, ...], make_env: str | Callable[..., Any]) -> None:
        self.packages = packages
        self.make_env = make_env

    def __call__(self, **kwargs: Any) -> gym.Env[Any, Any]:
        import gymnasium as gym

        for name in self.packages:
            importlib.import_module(name)
        if isinstance(self.make_env, str):
            return gym.make(self.make_env, **kwargs)
        env: gym.Env[Any, Any] = self.make_env(**kwargs)
        return env

    def __repr__(self) -> str:
        return f"ImportFirst({self.packages!r}, {self.make_env!r})"


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """Import ``module`` and return its (dotted) ``callable`` attribute.

    Raises :class:`ValueError` for a spec that is not ``module:callable``,
    :class:`TypeError` when the attribute is not callable, and whatever the import or
    the attribute lookup raises.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"--entrypoint must be module:callable, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def write_ready_fd(number: int, lines: Sequence[str]) -> None:
    """Machine-readable readiness: ``lines`` (the addresses), one per line, then EOF."""
    payload = "".join(f"{line}\n" for line in lines).encode()
    try:
        written = 0
        while written < len(payload):
            written += os.write(number, payload[written:])
    finally:
        os.close(number)


EXIT_INTERRUPTED = 128 + signal.SIGINT
"""The exit code of a Ctrl-C that stopped a command before it could stop gracefully (a
shell's convention: 130)."""
