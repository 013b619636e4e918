"""``rlmesh-trio fleet``: launch K endpoints of N lanes on Ray, print them, stay up.

Ray (and :mod:`rlmesh_trio.fleet.ray`) is imported only when the command runs. stdout
carries only the addresses (or ``--json``'s objects): while the command runs, anything
else written to ``sys.stdout`` -- Ray's driver prints its ``(raylet) ...`` lines there --
goes to stderr. When stdout's reader goes away (``rlmesh-trio fleet --json | head -1``)
the fleet is stopped and the command exits quietly (:data:`~rlmesh_trio._cli.EXIT_BROKEN_PIPE`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import stat
import sys
import threading
from typing import Any, TextIO

from .._address import is_loopback_host, parse_address
from .._credentials import AUTH_TOKEN_ENV
from ._args import (
    PROG,
    UsageError,
    add_env_source,
    add_seconds,
    check_fd,
    fd,
    int_at_least,
    load_env,
    write_ready_fd,
)
from ._hints import describe

__all__ = ["add_fleet_parser", "fleet_command"]

COMMAND = f"{PROG} fleet"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_HEALTH_PERIOD_SECONDS = 5.0
DEFAULT_HEALTH_TIMEOUT_SECONDS = 2.0
DEFAULT_UNHEALTHY_AFTER = 3
DEFAULT_READY_TIMEOUT_SECONDS = 120.0
DEFAULT_STOP_TIMEOUT_SECONDS = 15.0
"""``launch()``'s defaults (a test compares them), spelled here so that ``--help`` works
without importing Ray."""


def add_fleet_parser(commands: Any) -> None:
    """Register ``fleet`` on the ``rlmesh-trio`` subparsers."""
    fleet = commands.add_parser(
        "fleet",
        help="launch K endpoints of N lanes on Ray and keep them up",
        description="Launch K rlmesh-trio endpoints of N lanes each as Ray actors "
        "(placement group, restarts, health supervision), print their addresses, and "
        "keep them up until Ctrl-C (SIGINT) or SIGTERM. Needs the ray extra.",
    )
    add_env_source(
        fleet,
        where="called once per lane, on the Ray nodes (--package and the module must be "
        "importable there too)",
    )
    fleet.add_argument(
        "--endpoints", type=int_at_least(1), required=True, metavar="K", help="how many endpoints"
    )
    fleet.add_argument(
        "--num-envs",
        type=int_at_least(1, "--num-envs"),
        default=1,
        metavar="N",
        help="lanes per endpoint (default 1)",
    )
    fleet.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join this Ray cluster (ray.init(address=ADDR), e.g. auto or ray://host:10001); "
        "default: start a local Ray for the life of the command",
    )
    fleet.add_argument(
        "--bind",
        default="auto",
        metavar="HOST",
        help="auto (default: 127.0.0.1 when the Ray cluster is local -- started by this "
        "command, or one node on this machine -- else each node's IP), node (each node's "
        "IP as Ray reports it), 127.0.0.1, 0.0.0.0, ...",
    )
    fleet.add_argument(
        "--cpus-per-endpoint",
        type=float,
        default=1.0,
        metavar="C",
        help="CPUs each endpoint's placement bundle reserves (default 1)",
    )
    fleet.add_argument(
        "--placement",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        default="SPREAD",
        help="placement group strategy (default SPREAD)",
    )
    fleet.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="R",
        help="Ray restarts per endpoint (-1: forever; default 3)",
    )
    add_seconds(
        fleet,
        "--health-period-seconds",
        DEFAULT_HEALTH_PERIOD_SECONDS,
        "how often the supervisor probes each endpoint",
    )
    add_seconds(
        fleet, "--health-timeout-seconds", DEFAULT_HEALTH_TIMEOUT_SECONDS, "the bound of each probe"
    )
    fleet.add_argument(
        "--unhealthy-after",
        type=int_at_least(1, "--unhealthy-after"),
        default=DEFAULT_UNHEALTHY_AFTER,
        metavar="N",
        help="failed probes in a row after which an endpoint is restarted "
        f"(default {DEFAULT_UNHEALTHY_AFTER})",
    )
    add_seconds(
        fleet,
        "--ready-timeout-seconds",
        DEFAULT_READY_TIMEOUT_SECONDS,
        "how long an endpoint may take to serve, at launch and after a restart",
    )
    add_seconds(
        fleet,
        "--stop-timeout-seconds",
        DEFAULT_STOP_TIMEOUT_SECONDS,
        "the bound of stopping the fleet",
    )
    fleet.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help=f"the endpoints' bearer token (also: {AUTH_TOKEN_ENV}); beyond loopback "
        "one is required: give it, or --token-file, or --no-auth",
    )
    fleet.add_argument(
        "--token-file",
        metavar="PATH",
        help="write the generated bearer token to PATH (mode 0600)",
    )
    fleet.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without a token even beyond loopback (rlmesh 0.1.0 clients send none; "
        "only on a network you trust)",
    )
    tls = fleet.add_argument_group(
        "TLS",
        "the endpoints serve TLS (as 'rlmesh-trio serve'); the supervisor's probes "
        "connect with --tls-ca-file (and a client certificate under mTLS)",
    )
    tls.add_argument("--tls-cert-file", metavar="FILE", help="the endpoints' certificate (PEM)")
    tls.add_argument("--tls-key-file", metavar="FILE", help="its private key (PEM)")
    tls.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="mTLS: the endpoints refuse clients without a certificate signed by this CA",
    )
    tls.add_argument(
        "--tls-ca-file",
        metavar="FILE",
        help="the CA the probes trust (default with TLS: the system's)",
    )
    tls.add_argument(
        "--tls-client-cert-file",
        metavar="FILE",
        help="mTLS: the certificate the probes present (PEM; with --tls-client-key-file)",
    )
    tls.add_argument("--tls-client-key-file", metavar="FILE", help="its private key (PEM)")
    fleet.add_argument(
        "--ready-fd",
        type=fd,
        metavar="FD",
        help="write the addresses, one per line, to this file descriptor, then close it",
    )
    fleet.add_argument(
        "--json", action="store_true", help="print the endpoints as JSON (one object per report)"
    )
    fleet.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="logging level (default: warning; restarts are logged at warning)",
    )


def fleet_command(args: argparse.Namespace) -> int:
    """Run ``rlmesh-trio fleet``; returns the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(name)s: %(message)s", stream=sys.stderr
    )
    auth_token = args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
    try:
        if args.no_auth and (auth_token or args.token_file):
            raise UsageError("--no-auth contradicts --auth-token / --token-file")
        if not args.cpus_per_endpoint > 0:
            raise UsageError("--cpus-per-endpoint must be > 0")
        if args.max_restarts < -1:
            raise UsageError("--max-restarts must be >= -1")
        if args.ready_fd is not None:
            check_fd(args.ready_fd)
        if args.bind not in ("auto", "node"):
            parse_address(f"{args.bind}:1")  # a host to bind, or ValueError (before Ray)
        probe_tls = _probe_tls(args)
    except (UsageError, ValueError) as exc:
        return _usage(str(exc))
    try:
        from ..fleet.ray import ray_output_to_stderr
    except ImportError as exc:
        print(
            f"{COMMAND}: error: needs Ray: pip install ray (the ray extra; from a clone of "
            f"rlmesh-trio: pip install '.[ray]') ({exc})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    with ray_output_to_stderr() as out:  # stdout: the reports, nothing else
        return _run(args, auth_token, probe_tls, out)


def _run(args: argparse.Namespace, auth_token: str | None, probe_tls: Any, out: TextIO) -> int:
    import ray

    from ..fleet.ray import launch, resolve_bind

    try:
        env = load_env(args, in_other_processes=True)
    except Exception as exc:
        print(f"{COMMAND}: error: cannot load the environment: {describe(exc)}", file=sys.stderr)
        return EXIT_FAILED

    started_ray = False
    try:
        if not ray.is_initialized():
            if args.ray_address:
                ray.init(address=args.ray_address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
                started_ray = True
        host = resolve_bind(args.bind)
        beyond = host == "node" or not is_loopback_host(host)
        if beyond and not (auth_token or args.token_file or args.no_auth):
            shown = "each node's IP" if host == "node" else host
            print(
                f"{COMMAND}: error: the endpoints bind beyond loopback ({shown}): give "
                f"--auth-token (or {AUTH_TOKEN_ENV}), --token-file PATH to have one "
                "generated, or --no-auth on a network you trust",
                file=sys.stderr,
            )
            return EXIT_USAGE
        fleet = launch(
            env,
            endpoints=args.endpoints,
            num_envs=args.num_envs,
            env_kwargs=args.kwargs_json,
            resources={"CPU": args.cpus_per_endpoint},
            placement=args.placement,
            max_restarts=args.max_restarts,
            health_period_seconds=args.health_period_seconds,
            health_timeout_seconds=args.health_timeout_seconds,
            unhealthy_after=args.unhealthy_after,
            ready_timeout_seconds=args.ready_timeout_seconds,
            stop_timeout_seconds=args.stop_timeout_seconds,
            bind=host,
            auth_token=auth_token,
            require_auth=False if args.no_auth else (True if auth_token or beyond else None),
            tls=probe_tls,
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            tls_client_ca_file=args.tls_client_ca_file,
        )
    except KeyboardInterrupt:  # Ctrl-C while launching: launch() removed what it made
        print(f"{COMMAND}: interrupted while launching", file=sys.stderr)
        if started_ray:
            ray.shutdown()
        return 128 + signal.SIGINT
    except Exception as exc:
        print(f"{COMMAND}: error: cannot launch the fleet: {describe(exc)}", file=sys.stderr)
        if started_ray:
            ray.shutdown()
        return EXIT_FAILED
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        if args.token_file and fleet.auth_token:
            token_fd = os.open(args.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(token_fd, "w") as file:
                file.write(fleet.auth_token + "\n")
        _report(fleet, args.json, out)
        if args.ready_fd is not None:
            write_ready_fd(args.ready_fd, fleet.addresses)
        print(
            f"{PROG}: fleet of {len(fleet)} x{args.num_envs} lanes up; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        states = [(e.address, e.state, e.restarts) for e in fleet.endpoints]
        while not stop.wait(1.0):
            if _reader_gone(out):
                raise BrokenPipeError("stdout's reader went away")
            now = [(e.address, e.state, e.restarts) for e in fleet.endpoints]
            if now != states:  # restarts may move addresses: say so, machine-readably
                states = now
                _report(fleet, args.json, out)
        print(f"{PROG}: stopping the fleet", file=sys.stderr, flush=True)
        return EXIT_OK
    except BrokenPipeError:  # stdout is gone: stop the fleet, exit as the CLI does then
        print(f"{PROG}: stdout closed: stopping the fleet", file=sys.stderr, flush=True)
        raise
    except OSError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        fleet.close()
        if started_ray:
            ray.shutdown()


def _reader_gone(out: TextIO) -> bool:
    """Whether ``out`` is a pipe or socket whose reader closed it (poll says POLLERR)."""
    if not hasattr(select, "poll"):
        return False
    try:
        fileno = out.fileno()
        mode = os.fstat(fileno).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    poller = select.poll()
    poller.register(fileno, 0)  # POLLERR and POLLHUP are reported whatever the mask
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _probe_tls(args: argparse.Namespace) -> Any:
    """The supervisor's client TLS context when the endpoints serve TLS (else None)."""
    from .._tls import client_context_from_files

    if args.tls_cert_file is None and args.tls_key_file is None:
        if args.tls_ca_file or args.tls_client_cert_file or args.tls_client_ca_file:
            raise ValueError("the TLS client flags need --tls-cert-file and --tls-key-file")
        return None
    if args.tls_client_ca_file and not args.tls_client_cert_file:
        raise ValueError(
            "with --tls-client-ca-file (mTLS) the probes need a client certificate: "
            "--tls-client-cert-file and --tls-client-key-file"
        )
    return client_context_from_files(
        args.tls_ca_file,
        args.tls_client_cert_file,
        args.tls_client_key_file,
        flags="--tls-client-cert-file and --tls-client-key-file",
    )


def _report(fleet: Any, as_json: bool, out: TextIO) -> None:
    if as_json:
        rows = [
            {
                "index": e.index,
                "address": e.address,
                "num_envs": e.num_envs,
                "lanes": e.num_envs,  # the old key, until 0.2
                "state": e.state,
                "restarts": e.restarts,
                "node": e.node,
            }
            for e in fleet.endpoints
        ]
        print(json.dumps({"endpoints": rows}), file=out, flush=True)
    else:
        for endpoint in fleet.endpoints:
            print(endpoint.address, file=out, flush=True)


def _usage(message: str) -> int:
    print(f"{COMMAND}: error: {message}", file=sys.stderr)
    return EXIT_USAGE
