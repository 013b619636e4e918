"""``rlmesh-trio serve`` / ``python -m rlmesh_trio``: arguments, readiness, signals, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wire
from support.refserver import ROOT, TESTS_DIR

from rlmesh_trio._cli import _hints, _serve, build_parser, main

pytestmark = pytest.mark.timeout(60)

BOUND = 30.0
"""Seconds a subprocess may take to start or stop (imports included, on a shared box)."""


# --------------------------------------------------------------------------- arguments


def test_parser_defaults_and_flags() -> None:
    args = build_parser().parse_args(["serve", "--env", "CartPole-v1"])
    assert args.command == "serve"
    assert args.env == "CartPole-v1"
    assert args.entrypoint is None
    assert args.num_envs == 1
    assert args.transport == "tcp"
    assert args.address is None
    assert args.package == []
    assert args.kwargs_json is None
    assert not args.allow_remote_shutdown
    assert args.idle_timeout_seconds is None
    assert args.log_level == "warning"
    assert args.on_lane_fault == "error"
    assert args.lane_timeout_seconds is None
    assert args.max_abandoned_lanes == 8
    assert args.max_given_up_lanes == 0
    assert args.min_serving_lanes == 1
    assert args.lane_isolation == "thread"
    args = build_parser().parse_args(
        [
            "serve",
            "--entrypoint",
            "support.envs:make_slow",
            "--num-envs",
            "4",
            "--kwargs-json",
            '{"a": 1}',
            "--package",
            "p1",
            "--package",
            "p2",
            "--allow-remote-shutdown",
            "--idle-timeout-seconds",
            "2.5",
            "--drain-timeout-seconds",
            "0",
            "--close-timeout-seconds",
            "1",
            "--workflow-edition",
            "2026.06",
            "--validation-policy",
            "strict",
            "--ready-fd",
            "7",
            "--on-lane-fault",
            "truncate",
            "--lane-timeout-seconds",
            "30",
            "--max-abandoned-lanes",
            "2",
            "--max-given-up-lanes",
            "3",
            "--min-serving-lanes",
            "2",
            "--lane-isolation",
            "process",
        ]
    )
    assert args.entrypoint == "support.envs:make_slow"
    assert args.num_envs == 4
    assert args.kwargs_json == {"a": 1}
    assert args.package == ["p1", "p2"]
    assert args.allow_remote_shutdown
    assert args.idle_timeout_seconds == 2.5
    assert args.drain_timeout_seconds == 0.0
    assert args.close_timeout_seconds == 1.0
    assert args.workflow_edition == "2026.06"
    assert args.validation_policy == "strict"
    assert args.ready_fd == 7
    assert args.on_lane_fault == "truncate"
    assert args.lane_timeout_seconds == 30.0
    assert args.max_abandoned_lanes == 2
    assert args.max_given_up_lanes == 3
    assert args.min_serving_lanes == 2
    assert args.lane_isolation == "process"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["serve"], "one of the arguments --env --entrypoint is required"),
        (["serve", "--env", "A", "--entrypoint", "m:f"], "not allowed with"),
        (["serve", "--env", "A", "--num-envs", "0"], "--num-envs must be >= 1"),
        (["serve", "--env", "A", "--kwargs-json", "[1]"], "must be a JSON object"),
        (["serve", "--env", "A", "--kwargs-json", "{"], "invalid JSON"),
        (["serve", "--env", "A", "--idle-timeout-seconds", "0"], "> 0"),
        (["serve", "--env", "A", "--drain-timeout-seconds", "-1"], ">= 0"),
        (["serve", "--env", "A", "--drain-timeout-seconds", "nan"], "finite"),
        (["serve", "--env", "A", "--validation-policy", "loud"], "invalid choice"),
        (["serve", "--env", "A", "--address", "http://x:1"], "unsupported address scheme"),
        (["serve", "--env", "A", "--transport", "unix", "--address", "tcp://x:1"], "socket path"),
        (["serve", "--env", "A", "--ready-fd", "987654"], "--ready-fd 987654"),
        (["serve", "--env", "A", "--vectorization-mode", "sync"], "unrecognized arguments"),
        (["serve", "--env", "A", "--on-lane-fault", "retry"], "invalid choice"),
        (["serve", "--env", "A", "--lane-timeout-seconds", "0"], "> 0"),
        (["serve", "--env", "A", "--max-abandoned-lanes", "-1"], "must be >= 0"),
        (["serve", "--env", "A", "--max-given-up-lanes", "-1"], "must be >= 0"),
        (["serve", "--env", "A", "--max-given-up-lanes", "all"], "invalid int value"),
        (["serve", "--env", "A", "--lane-isolation", "vm"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--entrypoint" in out
    assert "--ready-fd" in out


def test_unix_transport_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--env", "A", "--transport", "unix", "--address", "x.sock"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLMESH_ADDRESS", raising=False)
    monkeypatch.delenv("RLMESH_PORT", raising=False)
    assert _serve._resolve_address(args) == ("unix://x.sock", None)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    args = parser.parse_args(["serve", "--env", "My/Env-v1", "--transport", "unix"])
    assert _serve._resolve_address(args) == (
        f"unix://{tmp_path}/rlmesh-trio/rlmesh-trio-my_env-v1.sock",
        None,
    )
    assert (tmp_path / "rlmesh-trio").stat().st_mode & 0o777 == 0o700
    args = parser.parse_args(["serve", "--env", "A"])
    assert _serve._resolve_address(args) == ("tcp://127.0.0.1:0", None)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        # rlmesh 0.1.0's bind contract: RLMESH_ADDRESS (any form) wins over RLMESH_PORT ...
        ([], {"RLMESH_ADDRESS": "0.0.0.0:6000"}, ("0.0.0.0:6000", "RLMESH_ADDRESS")),
        ([], {"RLMESH_ADDRESS": "6001"}, ("6001", "RLMESH_ADDRESS")),
        ([], {"RLMESH_ADDRESS": "tcp://[::1]:6002"}, ("tcp://[::1]:6002", "RLMESH_ADDRESS")),
        (
            [],
            {"RLMESH_ADDRESS": "unix:///run/env.sock"},
            ("unix:///run/env.sock", "RLMESH_ADDRESS"),
        ),
        (
            [],
            {"RLMESH_ADDRESS": "127.0.0.1:6003", "RLMESH_PORT": "7000"},
            ("127.0.0.1:6003", "RLMESH_ADDRESS"),
        ),
        # ... RLMESH_PORT is a port on all interfaces ...
        ([], {"RLMESH_PORT": "7001"}, ("0.0.0.0:7001", "RLMESH_PORT")),
        ([], {"RLMESH_ADDRESS": "", "RLMESH_PORT": "7002"}, ("0.0.0.0:7002", "RLMESH_PORT")),
        # ... --address wins over both, and with none of the three the default stays.
        (
            ["--address", "127.0.0.1:8000"],
            {"RLMESH_ADDRESS": "0.0.0.0:1", "RLMESH_PORT": "2"},
            ("127.0.0.1:8000", None),
        ),
        ([], {}, ("tcp://127.0.0.1:0", None)),
        ([], {"RLMESH_PORT": ""}, ("tcp://127.0.0.1:0", None)),
    ],
)
def test_the_bind_address_from_rlmesh_address_and_rlmesh_port(
    argv: list[str],
    env: dict[str, str],
    expected: tuple[str, str | None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RLMESH_ADDRESS", raising=False)
    monkeypatch.delenv("RLMESH_PORT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", "--env", "A", *argv])
    assert _serve._resolve_address(args) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RLMESH_PORT": "http"}, "RLMESH_PORT='http' is not a TCP port"),
        ({"RLMESH_PORT": "70000"}, "RLMESH_PORT='70000' is not a TCP port"),
        ({"RLMESH_ADDRESS": "http://x:1"}, r"unsupported address scheme.*\(from RLMESH_ADDRESS\)"),
    ],
)
def test_a_bad_bind_variable_is_a_usage_error(
    env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLMESH_ADDRESS", raising=False)
    monkeypatch.delenv("RLMESH_PORT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", "--env", "A"])
    with pytest.raises(_serve.UsageError, match=message):
        _serve._resolve_address(args)


def test_serve_binds_rlmesh_address_and_says_so(procs: list[subprocess.Popen[bytes]]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**cli_env(), "RLMESH_ADDRESS": f"127.0.0.1:{port}", "RLMESH_PORT": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", "serve", "--env", "CartPole-v1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    procs.append(proc)
    assert proc.stderr is not None
    first = proc.stderr.readline().decode()
    assert first == f"rlmesh-trio: binding 127.0.0.1:{port} (from RLMESH_ADDRESS)\n"
    second = proc.stderr.readline().decode()
    assert second.startswith(f"rlmesh-trio: serving CartPole-v1 x1 lane on tcp://127.0.0.1:{port}")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=BOUND)
    assert proc.returncode == 0


def test_a_non_ascii_token_is_a_startup_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--env", "CartPole-v1", "--auth-token", "café"]) in (1, 2)
    err = capsys.readouterr().err
    assert "visible ASCII" in err and "café" not in err


def test_startup_failures_exit_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--env", "NoSuchEnv-v9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("rlmesh-trio: error: cannot serve: NameNotFound:")
    assert main(["serve", "--entrypoint", "no_such_module_h4:make"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "rlmesh-trio: error: cannot load the environment: "
        "ModuleNotFoundError: No module named 'no_such_module_h4'"
    ]
    assert main(["serve", "--entrypoint", "nocolon"]) == 1
    assert "module:callable" in capsys.readouterr().err
    assert main(["serve", "--env", "CartPole-v1", "--package", "no_such_package_h4"]) == 1
    assert "no_such_package_h4" in capsys.readouterr().err


# --------------------------------------------------------------------------- in-process serve


def read_ready(fd: int, timeout: float = BOUND) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as ready:
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no address on the ready fd"
            readable, _, _ = select.select([ready], [], [], remaining)
            if readable:
                chunk = ready.read(4096)
                if not chunk:
                    return data.decode()
                data += chunk


def test_serve_in_process_with_package_entrypoint_kwargs_and_ready_fd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A package that registers an env id, and an entrypoint taking keyword arguments.
    (tmp_path / "h4_cli_pkg.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('H4Cli-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    read_fd, write_fd = os.pipe()
    seen: dict[str, Any] = {}

    async def client(address: str) -> None:
        async with wire.WireClient(address) as c:
            seen["handshake"] = await c.handshake()
            seen["shutdown"] = await c.shutdown("test over")

    def drive() -> None:
        try:
            seen["ready"] = read_ready(read_fd)
            asyncio.run(client(seen["ready"].strip()))
        except BaseException as exc:
            seen["error"] = exc

    thread = threading.Thread(target=drive)
    thread.start()
    try:
        code = main(
            [
                "serve",
                "--package",
                "h4_cli_pkg",
                "--env",
                "H4Cli-v0",
                "--num-envs",
                "2",
                "--kwargs-json",
                '{"render_mode": "rgb_array"}',
                "--ready-fd",
                str(write_fd),
                "--allow-remote-shutdown",
            ]
        )
    finally:
        thread.join(BOUND)
    assert "error" not in seen, seen.get("error")
    assert code == 0
    assert seen["ready"].endswith("\n")
    address = seen["ready"].strip()
    assert address.startswith("tcp://127.0.0.1:")
    contract = seen["handshake"].env_contract
    assert contract.spec.id == "H4Cli-v0"
    assert contract.num_envs == 2
    assert contract.render_mode == "rgb_array"
    assert seen["shutdown"].base.accepted
    err = capsys.readouterr().err
    assert f"rlmesh-trio: serving H4Cli-v0 x2 lanes on {address}\n" in err
    with pytest.raises(OSError):
        os.fstat(write_fd)  # the ready fd was closed


def test_package_is_imported_first_where_the_env_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--package`` with process lanes (or the fleet): the env factory, pickled to the
    process that builds the env, imports the package there first. Unpickling it imports
    the command line's ``_args`` and nothing of the server."""
    import pickle

    from rlmesh_trio._cli._args import ImportFirst, load_env

    (tmp_path / "h4_first_pkg.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('H4First-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["serve", "--package", "h4_first_pkg", "--env", "H4First-v0"]
    args = build_parser().parse_args([*argv, "--app-dir", str(tmp_path)])
    assert load_env(args, in_other_processes=False) == "H4First-v0"
    factory = load_env(args, in_other_processes=True)
    assert isinstance(factory, ImportFirst) and factory.packages == ("h4_first_pkg",)
    script = (
        "import pickle, sys\n"
        "factory = pickle.loads(sys.stdin.buffer.read())\n"
        "server = ('trio', 'rlmesh_trio._serve', 'rlmesh_trio._cli._serve', 'h4_first_pkg')\n"
        "print(sorted(set(server) & set(sys.modules)), factory().spec.id)\n"
    )
    path = os.pathsep.join([str(tmp_path), *sys.path])
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps(factory),
        capture_output=True,
        timeout=BOUND,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == ["[]", "H4First-v0"]


# --------------------------------------------------------------------------- subprocesses


def cli_env() -> dict[str, str]:
    """The environment of a CLI subprocess: ours, with tests/ importable (support.envs)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    return env


def spawn(*args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    env = cli_env()
    return subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        pass_fds=pass_fds,
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=BOUND)


def start_serving(procs: list[subprocess.Popen[bytes]], *args: str) -> tuple[Any, str]:
    read_fd, write_fd = os.pipe()
    try:
        proc = spawn("serve", *args, "--ready-fd", str(write_fd), pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    procs.append(proc)
    address = read_ready(read_fd).strip()
    assert address, proc.communicate(timeout=BOUND)
    return proc, address


def test_python_m_help() -> None:
    proc = spawn("--help")
    out, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    assert b"usage: rlmesh-trio" in out


def test_sigint_once_drains_and_exits_0(procs: list[subprocess.Popen[bytes]]) -> None:
    proc, address = start_serving(
        procs, "--env", "CartPole-v1", "--num-envs", "2", "--drain-timeout-seconds", "5"
    )

    async def use_and_leave_join_open_then_close() -> Any:
        async with wire.WireClient(address) as client:
            reply = await client.handshake()
            async with client.join() as join:
                await join.call(wire.reset())
            return reply

    assert wire.run(use_and_leave_join_open_then_close()).env_contract.num_envs == 2
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    assert time.monotonic() - started < BOUND
    lines = err.decode().splitlines()
    assert lines[0] == f"rlmesh-trio: serving CartPole-v1 x2 lanes on {address}"
    assert "rlmesh-trio: SIGINT: draining and stopping" in lines
    assert lines[-1] == "rlmesh-trio: stopped: SIGINT"  # every stop says why
    assert "Traceback" not in err.decode()


def test_second_signal_exits_at_once(procs: list[subprocess.Popen[bytes]]) -> None:
    proc, address = start_serving(
        procs,
        "--entrypoint",
        "support.envs:make_hang",
        "--drain-timeout-seconds",
        "25",
        "--close-timeout-seconds",
        "25",
    )
    hung = threading.Event()

    async def hang_a_step() -> None:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([b"\x01" + b"\x00" * 7]))
            hung.set()
            await join.recv(timeout=BOUND)

    client = threading.Thread(target=lambda: wire.run(hang_a_step()))
    client.start()
    try:
        assert hung.wait(BOUND)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # drains: the open Join holds the server
        time.sleep(0.5)
        assert proc.poll() is None
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=BOUND)
        assert time.monotonic() - started < 5.0
        assert proc.returncode == 128 + signal.SIGTERM
        assert "second SIGTERM: exiting now" in err.decode()
        # An exit asked for, not a crash: the crash witness says nothing.
        assert "died without stopping" not in err.decode()
    finally:
        client.join(BOUND)


def test_ctrl_c_while_starting_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A Ctrl-C while the server is still starting (its entrypoint's module being
    imported): rc 130, one line, no traceback, no crash report."""
    marker = tmp_path / "importing"
    env = {**cli_env(), "RLT_SLOW_IMPORT_MARKER": str(marker), "RLT_SLOW_IMPORT_SECONDS": "30"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", "serve", "--entrypoint", "support.slow_import:make"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + BOUND
        while not marker.exists():  # no event to wait on across the process boundary
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = err.decode()
    assert proc.returncode == 130, text
    assert "rlmesh-trio: interrupted while starting" in text
    assert "Traceback" not in text and "died without stopping" not in text


def test_startup_failure_in_a_subprocess_exits_1() -> None:
    proc = spawn("serve", "--env", "NoSuchEnv-v9", "--address", "127.0.0.1:0")
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 1
    text = err.decode().strip().splitlines()
    assert len(text) == 1
    assert text[0].startswith("rlmesh-trio: error: cannot serve: NameNotFound")


# --------------------------------------------------------------------------- operability


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from rlmesh_trio import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlmesh-trio {__version__}"


def test_app_dir_makes_a_local_module_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--entrypoint mymod:make`` from the directory mymod.py is in (as uvicorn's
    --app-dir): the console script, unlike ``python -m``, has no cwd on sys.path."""
    (tmp_path / "appdir_probe_mod.py").write_text(
        "import gymnasium as gym\n\ndef make():\n    return gym.make('CartPole-v1')\n"
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    args = build_parser().parse_args(
        ["serve", "--entrypoint", "appdir_probe_mod:make", "--app-dir", str(tmp_path)]
    )
    config = _serve._configure(args, "tcp://127.0.0.1:0")
    assert callable(config.make_env) and config.make_env.__module__ == "appdir_probe_mod"
    monkeypatch.delitem(sys.modules, "appdir_probe_mod")


def test_the_lane_health_flags_reach_serve_options() -> None:
    parse = build_parser().parse_args
    config = _serve._configure(parse(["serve", "--env", "CartPole-v1"]), "tcp://127.0.0.1:0")
    options = config.options
    assert (options.max_given_up_lanes, options.min_serving_lanes) == (0, 1)
    assert options.max_abandoned_lanes == 8
    argv = ["serve", "--env", "CartPole-v1", "--num-envs", "4", "--max-given-up-lanes", "4"]
    argv += ["--min-serving-lanes", "2", "--max-abandoned-lanes", "64"]
    options = _serve._configure(parse(argv), "tcp://127.0.0.1:0").options
    assert (options.max_given_up_lanes, options.min_serving_lanes) == (4, 2)
    assert options.max_abandoned_lanes == 64


def test_an_unregistered_namespace_names_the_fix() -> None:
    import gymnasium

    with pytest.raises(gymnasium.error.NamespaceNotFound) as info:
        gymnasium.make("ALE/Pong-v5")
    text = _hints.describe(info.value)
    assert text.startswith("NamespaceNotFound: Namespace ALE not found")
    assert "--package ale_py" in text and "ale_py:ALE/" in text
    other = _hints.describe(gymnasium.error.NamespaceNotFound("Namespace Nope not found."))
    assert "--package PACKAGE" in other
    minigrid = _hints.describe(
        gymnasium.error.NameNotFound("Environment `MiniGrid-Empty-5x5` doesn't exist.")
    )
    assert "--package minigrid" in minigrid
    assert "--package" not in _hints.describe(
        gymnasium.error.NameNotFound("Environment `NoSuch` doesn't exist.")
    )


async def _fail_step_then_bad_action(address: str) -> list[Any]:
    async with wire.joined(address, wire.reset(seeds=[1])) as join:
        bad = await join.call(wire.step([wire.i64([9])]))  # Discrete(4): refused
        boom = await join.call(wire.step([wire.i64([2])]))  # BOOM_STEP_ACTION: the env raises
        return [bad.error, boom.error]


def test_env_failures_and_refusals_reach_the_log_and_the_stop_is_told(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    proc, address = start_serving(
        procs, "--entrypoint", "support.envs:make_boom", "--idle-timeout-seconds", "1"
    )
    bad, boom = wire.run(_fail_step_then_bad_action(address))
    assert bad is not None and boom is not None and not boom.is_recoverable
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    text = err.decode()
    lines = text.splitlines()
    assert lines[0] == (
        "rlmesh-trio: serving support.envs:make_boom (no env spec, served as UnknownEnv-v1)"
        f" x1 lane on {address}"
    )
    assert (
        "WARNING rlmesh_trio.requests: step request '' rejected: INVALID_ACTION $: value 9" in text
    )
    assert "ERROR rlmesh_trio.env: lane 0: step failed (request_id=''): step failed: " in text
    assert "RuntimeError: boom in step" in text and "Traceback (most recent call last)" in text
    assert lines[-1] == "rlmesh-trio: stopped: idle for 1 s"


def test_json_log_format_is_one_object_per_line(procs: list[subprocess.Popen[bytes]]) -> None:
    import json

    proc, address = start_serving(
        procs,
        "--entrypoint",
        "support.envs:make_boom",
        "--idle-timeout-seconds",
        "1",
        "--log-format",
        "json",
        "--log-level",
        "info",
    )
    wire.run(_fail_step_then_bad_action(address))
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.decode().splitlines()]
    said = [r["message"] for r in records if r["logger"] == "rlmesh_trio.cli"]
    assert said[0].startswith("serving support.envs:make_boom (no env spec")
    (fault,) = [r for r in records if r["logger"] == "rlmesh_trio.env"]
    assert fault["level"] == "ERROR" and fault["lane"] == 0 and fault["verb"] == "step"
    assert "RuntimeError: boom in step" in fault["traceback"]
    assert records[-1]["message"] == "stopped: idle for 1 s"
    assert not [r for r in records if r["logger"].startswith(("hpack", "h2", "grpclib"))]


def run_probe(*args: str) -> tuple[int, str, str]:
    proc = spawn("probe", *args)
    out, err = proc.communicate(timeout=BOUND)
    return proc.returncode, out.decode(), err.decode()


def test_probe_a_live_server(procs: list[subprocess.Popen[bytes]]) -> None:
    import json

    _, address = start_serving(procs, "--env", "CartPole-v1", "--num-envs", "2")
    code, out, err = run_probe(address)
    assert code == 0, (out, err)
    assert "health:" in out and "SERVING" in out
    assert "env_id:" in out and "CartPole-v1" in out
    assert "lanes:" in out and "0=serving, 1=serving" in out
    code, out, _ = run_probe(address, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["serving"] is True and report["health"] == "SERVING"
    assert report["env_id"] == "CartPole-v1" and report["num_envs"] == 2
    assert report["action_space"] == "Discrete(2)"
    assert report["observation_space"].startswith("Box(")
    assert report["capabilities"] == {"subset_step": "true"}
    assert report["server"].startswith("rlmesh-trio ")
    assert report["lanes"] == {"0": "serving", "1": "serving"}


def test_probe_fails_without_a_server_or_the_token(procs: list[subprocess.Popen[bytes]]) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    code, out, _ = run_probe(f"127.0.0.1:{free}", "--timeout-seconds", "2")
    assert code == 1 and "unreachable" in out
    _, address = start_serving(procs, "--env", "CartPole-v1", "--auth-token", "t0k")
    code, out, _ = run_probe(address, "--json")
    assert code == 1 and "UNAUTHENTICATED" in out
    code, out, _ = run_probe(address, "--json", "--auth-token", "t0k")
    assert code == 0, out
    assert run_probe("not an address")[0] == 2


@pytest.mark.interop
def test_probe_the_reference_server() -> None:
    """rlmesh 0.1.0 has no health service: a compatible Handshake counts as serving."""
    from support.refserver import ServerConfig, start_server

    server = start_server("ref", ServerConfig(entrypoint="support.envs:make_cartpole"))
    try:
        code, out, _ = run_probe(server.address)
    finally:
        server.stop()
    assert code == 0, out
    assert "no health service" in out and "CartPole-v1" in out


def test_a_native_crash_on_a_thread_lane_is_not_silent(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Issue 19, finding 3: a segfault on a thread lane killed the server with nothing on
    stderr after the serving line. Now: faulthandler's dump of every thread, then one
    line naming --lane-isolation process."""
    proc, address = start_serving(procs, "--entrypoint", "support.crashy:make_crashy")

    async def crash() -> None:
        async with wire.joined(address, wire.reset(seeds=[1])) as join:
            await join.send(wire.step([wire.i64([1])]))  # SEGFAULT
            await join.recv(timeout=BOUND)

    with contextlib.suppress(Exception):
        wire.run(crash())
    _, err = proc.communicate(timeout=BOUND)
    text = err.decode()
    assert proc.returncode == -signal.SIGSEGV, text
    assert "Fatal Python error: Segmentation fault" in text
    assert "crashy.py" in text  # the env's own line, in the lane thread's stack
    last = text.strip().splitlines()[-1]
    assert "--lane-isolation process" in last, text


def test_a_normal_stop_says_nothing_of_crashes(procs: list[subprocess.Popen[bytes]]) -> None:
    proc, _ = start_serving(procs, "--entrypoint", "support.crashy:make_crashy")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0
    assert "--lane-isolation" not in err.decode()


def test_health_follows_the_lanes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Issue 19, finding 2: with every lane dead (process lanes, policy error, segfaults)
    health said SERVING and the probe exited 0. Now NOT_SERVING once fewer lanes can serve
    than --min-serving-lanes (default 1): here all 3 must, so losing one is enough."""
    import json

    _, address = start_serving(
        procs,
        "--entrypoint",
        "support.crashy:make_crashy",
        "--num-envs",
        "3",
        "--lane-isolation",
        "process",
        "--min-serving-lanes",
        "3",
    )

    async def segfault(lanes: list[int]) -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2, 3])) as join:
            for lane in lanes:
                reply = await join.call(wire.step([wire.i64([1])], env_indices=[lane]))
                assert reply.error is not None, reply

    code, out, _ = run_probe(address, "--json")
    assert code == 0 and json.loads(out)["health"] == "SERVING", out
    wire.run(segfault([0]))
    code, out, _ = run_probe(address, "--json")
    report = json.loads(out)
    assert code == 1 and report["health"] == "NOT_SERVING", out
    assert report["lanes"] == {"0": "dead", "1": "serving", "2": "serving"}


def test_health_is_not_serving_once_no_lane_can_serve(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """With --max-given-up-lanes 2 (a lane-scoped user's rule: lanes lost for good are
    tolerated; by default the first one turns health NOT_SERVING), --min-serving-lanes
    (default 1) alone decides."""
    _, address = start_serving(
        procs,
        "--entrypoint",
        "support.crashy:make_crashy",
        "--num-envs",
        "2",
        "--lane-isolation",
        "process",
        "--max-given-up-lanes",
        "2",
    )

    async def segfault() -> None:
        async with wire.joined(address, wire.reset(seeds=[1, 2])) as join:
            for lane in (0, 1):
                if lane == 1:  # one lane left: still serving
                    code, out, _ = run_probe(address)
                    assert code == 0 and "0=dead, 1=serving" in out, out
                reply = await join.call(wire.step([wire.i64([1])], env_indices=[lane]))
                assert reply.error is not None, reply

    wire.run(segfault())
    code, out, _ = run_probe(address)
    assert code == 1 and "NOT_SERVING" in out and "0=dead, 1=dead" in out, out


def test_min_serving_lanes_is_checked(procs: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn("serve", "--env", "CartPole-v1", "--min-serving-lanes", "2")
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode != 0 and b"min_serving_lanes=2 is more than the 1 lanes" in err
    proc = spawn("serve", "--env", "CartPole-v1", "--min-serving-lanes", "0")
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 2 and b"--min-serving-lanes" in err


# --------------------------------------------------------------------------- stdout closed early

QUIET_EXIT = 128 + signal.SIGPIPE
"""What the CLI exits with when stdout's reader went away (what a shell reports for a
command SIGPIPE killed)."""

NOISE = (b"Traceback", b"BrokenPipeError", b"Exception ignored")


def spawn_into_pipe(*args: str, read: int) -> tuple[int, bytes, bytes]:
    """Run ``rlmesh-trio ARGS`` with stdout a pipe of which we read ``read`` bytes and then
    close the read end (0: close it before the command can write anything, so that its
    first write fails for certain); return the exit code, what was read, and stderr."""
    read_fd, write_fd = os.pipe()
    env = cli_env()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh_trio", *args],
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
    finally:
        os.close(write_fd)
    got = b""
    with os.fdopen(read_fd, "rb", buffering=0) as reader:
        while len(got) < read:
            readable, _, _ = select.select([reader], [], [], BOUND)
            assert readable, "nothing on stdout"
            chunk = reader.read(read - len(got))
            if not chunk:
                break
            got += chunk
    _, err = proc.communicate(timeout=BOUND)
    return proc.returncode, got, err


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args",
    [["--version"], ["--help"], ["probe", "{address}"], ["probe", "{address}", "--json"]],
    ids=["version", "help", "probe", "probe-json"],
)
def test_stdout_closed_early_exits_quietly(
    procs: list[subprocess.Popen[bytes]], args: list[str]
) -> None:
    """``rlmesh-trio probe ADDR | head -1`` printed a BrokenPipeError traceback in 2 of 10
    runs. A reader that is gone before the first write makes the failure certain (exit
    141, nothing on stderr); one that reads a byte and leaves races the writer, as head
    does: whichever wins, stderr stays clean -- ten times over."""
    if any("{address}" in a for a in args):
        _, address = start_serving(procs, "--env", "CartPole-v1")
        args = [a.format(address=address) for a in args]
    code, got, err = spawn_into_pipe(*args, read=0)
    assert (code, got) == (QUIET_EXIT, b""), err
    assert err == b""
    for _ in range(10):
        code, got, err = spawn_into_pipe(*args, read=1)
        assert len(got) == 1
        assert code in (0, QUIET_EXIT), err
        assert not [n for n in NOISE if n in err], err.decode()


def test_stdout_closed_early_through_a_shell_pipeline(procs: list[subprocess.Popen[bytes]]) -> None:
    """The user's own words: ``... | head -1``, through a shell."""
    _, address = start_serving(procs, "--env", "CartPole-v1")
    env = cli_env()
    command = f'set -o pipefail; "{sys.executable}" -m rlmesh_trio probe {address} | head -1'
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, env=env, cwd=ROOT, timeout=BOUND
    )
    assert done.returncode in (0, QUIET_EXIT), done.stderr
    assert done.stdout.decode().startswith("address: ") and address in done.stdout.decode()
    assert done.stderr == b""


# --------------------------------------------------------------------------- the documented path

DOCUMENTED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """Every ``rlmesh-trio ...`` command line the README and docs/ show (a ``$`` line of a
    console block, with its ``\\`` continuations; in the README an inline code span too:
    elsewhere those are fragments in prose), as argv, the optional ``[...]`` parts left
    out; with the whole span (synopses included)."""
    import re
    import shlex

    found: list[tuple[str, str, list[str]]] = []
    for path in DOCUMENTED:
        text = path.read_text(encoding="utf-8")
        lines = re.sub(r"\\\n\s*", " ", text).splitlines()
        spans = [line[2:] for line in lines if line.startswith("$ rlmesh-trio ")]
        if path.name == "README.md":
            inline = r"`((?:[A-Z_]+=\S+ )*rlmesh-trio (?:serve|probe|fleet) [^`]*)`"
            spans += re.findall(inline, text)
        for whole in spans:
            span = whole
            while re.search(r"\[[^\[\]]*\]", span):
                span = re.sub(r"\s*\[[^\[\]]*\]", "", span)
            argv = shlex.split(span)
            while "=" in argv[0]:  # MUJOCO_GL=egl rlmesh-trio ...
                argv.pop(0)
            found.append((f"{path.name}: {span}", whole, argv[1:]))
    return found


def test_the_documented_commands_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """Each command line the README and docs/ show is one the parser takes, with no
    deprecated flag (a deprecated flag says so on stderr); each flag a synopsis names
    (``[--json]``) is one the subcommand shows in its help."""
    import re

    commands = documented_commands()
    assert len(commands) >= 10, commands
    assert any(argv[0] == "fleet" for _, _, argv in commands)
    subcommands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for where, whole, argv in commands:
        code: object = 0
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:  # --help: 0
            code = exc.code
        err = capsys.readouterr().err
        assert code == 0 and err == "", f"{where}: {err}"
        shown = {
            flag
            for action in subcommands.choices[argv[0]]._actions
            if action.help != argparse.SUPPRESS
            for flag in action.option_strings
        }
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", whole))
        assert named <= shown, f"{where}: {sorted(named - shown)}"


README_SERVE = ("serve", "--env", "CartPole-v1", "--num-envs", "4")


def test_the_readme_first_command_as_written(procs: list[subprocess.Popen[bytes]]) -> None:
    """``rlmesh-trio serve --env CartPole-v1 --num-envs 4 --address 127.0.0.1:50051``
    through the console script the package installs, saying what the README says it
    says (on a free port here: 50051 may be taken on a test machine)."""
    import re
    import shutil

    script = shutil.which("rlmesh-trio", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no rlmesh-trio console script next to this python")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert (
        "$ rlmesh-trio serve --env CartPole-v1 --num-envs 4 --address 127.0.0.1:50051\n" in readme
    )
    said = re.search(
        r"^rlmesh-trio: serving CartPole-v1 x4 lanes on tcp://127\.0\.0\.1:50051$", readme, re.M
    )
    assert said is not None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = cli_env()
    proc = subprocess.Popen(
        [script, *README_SERVE, "--address", f"127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    procs.append(proc)
    assert proc.stderr is not None
    readable, _, _ = select.select([proc.stderr], [], [], BOUND)
    assert readable, "no serving line"
    line = proc.stderr.readline().decode()
    assert line == f"rlmesh-trio: serving CartPole-v1 x4 lanes on tcp://127.0.0.1:{port}\n"
    address = line.rsplit(" ", 1)[1].strip()
    code, out, _ = run_probe(address, "--json")
    assert code == 0 and '"num_envs": 4' in out
    proc.send_signal(signal.SIGINT)
    out_bytes, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, err
    assert out_bytes == b""  # serve says everything on stderr


def test_probe_timeout_seconds_and_its_deprecated_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["probe", "127.0.0.1:1"])
    assert args.timeout_seconds == 5.0  # the default
    assert capsys.readouterr().err == ""
    args = build_parser().parse_args(["probe", "127.0.0.1:1", "--timeout-seconds", "2.5"])
    assert args.timeout_seconds == 2.5
    assert capsys.readouterr().err == ""
    args = build_parser().parse_args(["probe", "127.0.0.1:1", "--timeout", "3"])
    assert args.timeout_seconds == 3.0  # the old flag still does its job ...
    err = capsys.readouterr().err
    assert "--timeout is deprecated" in err and "--timeout-seconds" in err  # ... and says so
    assert main(["probe", "--help"]) == 0
    shown = capsys.readouterr().out
    assert "--timeout-seconds" in shown and "--timeout " not in shown  # hidden from help
    assert main(["probe", "127.0.0.1:1", "--timeout", "0"]) == 2  # and checked as before


def test_fleet_defaults_name_the_fields() -> None:
    """The fleet's flags parse onto launch()'s field names, --bind defaulting to auto."""
    args = build_parser().parse_args(["fleet", "--env", "CartPole-v1", "--endpoints", "4"])
    assert args.bind == "auto"
    assert args.num_envs == 1
    assert args.health_period_seconds == 5.0
    assert args.health_timeout_seconds == 2.0 and args.unhealthy_after == 3
    assert args.ready_timeout_seconds == 120.0 and args.stop_timeout_seconds == 15.0
    assert args.package == [] and args.app_dir == "." and args.kwargs_json is None
    assert args.auth_token is None and not args.no_auth and not args.json


@pytest.mark.parametrize(
    "flag",
    [
        "--health-timeout-seconds",
        "--ready-timeout-seconds",
        "--stop-timeout-seconds",
        "--unhealthy-after",
    ],
)
def test_fleet_bounds_are_checked_before_ray(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["fleet", "--env", "CartPole-v1", "--endpoints", "2", flag, "0"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
