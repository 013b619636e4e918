"""``rlmesh-trio fleet``: launch K endpoints of N lanes on Ray, print them, stay up.

Kept apart from ``rlmesh_trio._cli`` (which only registers the subcommand and calls
:func:`fleet_command`): Ray is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

PROG = "rlmesh-trio fleet"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def add_fleet_parser(
    commands: Any,
    *,
    num_envs: Any,
    json_object: Any,
    fd: Any,
    positive_seconds: Any,
) -> argparse.ArgumentParser:
    """Register ``fleet`` on the ``rlmesh-trio`` subparsers (argparse types passed in by ``_cli``)."""
    fleet = commands.add_parser(
        "fleet",
        help="launch K endpoints of N lanes on Ray and keep them up",
        description="Launch K rlmesh-trio endpoints of N lanes each as Ray actors "
        "(placement group, restarts, health supervision), print their addresses, and "
        "keep them up until Ctrl-C (SIGINT) or SIGTERM. Needs the ray extra.",
    )
    source = fleet.add_mutually_exclusive_group(required=True)
    source.add_argument("--env", metavar="ID", help="gymnasium env id, e.g. CartPole-v1")
    source.add_argument(
        "--entrypoint",
        metavar="MODULE:CALLABLE",
        help="env factory in module:callable form (importable on every Ray node)",
    )
    fleet.add_argument(
        "--endpoints", type=num_envs, required=True, metavar="K", help="how many endpoints"
    )
    fleet.add_argument(
        "--num-envs", type=num_envs, default=1, metavar="N", help="lanes per endpoint (default 1)"
    )
    fleet.add_argument(
        "--kwargs-json",
        type=json_object,
        metavar="JSON",
        help="JSON object of keyword arguments for gymnasium.make / the entrypoint",
    )
    fleet.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="join this Ray cluster (ray.init(address=ADDR), e.g. auto or ray://host:10001); "
        "default: start a local Ray for the life of the command",
    )
    fleet.add_argument(
        "--bind",
        default="node",
        metavar="HOST",
        help="node (default: each node's IP as Ray reports it), 127.0.0.1, 0.0.0.0, ...",
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
    fleet.add_argument(
        "--health-period-seconds",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="how often the supervisor probes each endpoint (default 5)",
    )
    fleet.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help="the endpoints' bearer token (also: RLMESH_TRIO_AUTH_TOKEN); beyond loopback "
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
    fleet.add_argument("--json", action="store_true", help="print the endpoints as JSON")
    fleet.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="logging level (default: warning; restarts are logged at warning)",
    )
    return fleet  # type: ignore[no-any-return]


def fleet_command(args: argparse.Namespace) -> int:
    """Run ``rlmesh-trio fleet``; returns the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    token = args.auth_token or os.environ.get("RLMESH_TRIO_AUTH_TOKEN") or None
    if args.no_auth and (token or args.token_file):
        return _usage("--no-auth contradicts --auth-token / --token-file")
    if not args.cpus_per_endpoint > 0:
        return _usage("--cpus-per-endpoint must be > 0")
    if args.max_restarts < -1:
        return _usage("--max-restarts must be >= -1")
    if args.ready_fd is not None:
        try:
            os.fstat(args.ready_fd)
        except OSError as exc:
            return _usage(f"--ready-fd {args.ready_fd}: {exc.strerror}")
    try:
        probe_tls = _probe_tls(args)
    except ValueError as exc:
        return _usage(str(exc))
    try:
        import ray

        from .ray import _is_loopback, launch
    except ImportError as exc:
        print(
            f"{PROG}: error: needs Ray: pip install ray (the ray extra; from a clone of "
            f"rlmesh-trio: pip install '.[ray]') ({exc})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    env: Any = args.env
    if args.entrypoint is not None:
        from .._entrypoint import load_entrypoint

        try:
            env = load_entrypoint(args.entrypoint)
        except Exception as exc:
            print(f"{PROG}: error: cannot load {args.entrypoint}: {exc}", file=sys.stderr)
            return EXIT_FAILED

    started_ray = False
    try:
        if not ray.is_initialized():
            if args.ray_address:
                ray.init(address=args.ray_address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
                started_ray = True
        node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
        host = node_ip if args.bind == "node" else args.bind
        beyond = not _is_loopback(host)
        if beyond and not (token or args.token_file or args.no_auth):
            print(
                f"{PROG}: error: the endpoints bind beyond loopback ({host}): give "
                "--auth-token (or RLMESH_TRIO_AUTH_TOKEN), --token-file PATH to have one "
                "generated, or --no-auth on a network you trust",
                file=sys.stderr,
            )
            return EXIT_USAGE
        fleet = launch(
            env,
            endpoints=args.endpoints,
            lanes=args.num_envs,
            env_kwargs=args.kwargs_json,
            resources={"CPU": args.cpus_per_endpoint},
            placement=args.placement,
            max_restarts=args.max_restarts,
            health_period_s=args.health_period_seconds,
            bind=args.bind,
            auth_token=token,
            require_auth=False if args.no_auth else (True if token or beyond else None),
            tls=probe_tls,
            tls_cert_file=args.tls_cert_file,
            tls_key_file=args.tls_key_file,
            tls_client_ca_file=args.tls_client_ca_file,
        )
    except KeyboardInterrupt:  # Ctrl-C while launching: launch() removed what it made
        print(f"{PROG}: interrupted while launching", file=sys.stderr)
        if started_ray:
            ray.shutdown()
        return 128 + signal.SIGINT
    except Exception as exc:
        print(f"{PROG}: error: cannot launch the fleet: {_first_line(exc)}", file=sys.stderr)
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
            fd = os.open(args.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(fleet.auth_token + "\n")
        _report(fleet, args.json)
        if args.ready_fd is not None:
            _write_ready(args.ready_fd, fleet.addresses)
        print(
            f"rlmesh-trio: fleet of {len(fleet)} x{args.num_envs} lanes up; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        states = [(e.address, e.state) for e in fleet.endpoints]
        while not stop.wait(1.0):
            now = [(e.address, e.state) for e in fleet.endpoints]
            if now != states:  # restarts move addresses: say so, machine-readably
                states = now
                _report(fleet, args.json)
        print("rlmesh-trio: stopping the fleet", file=sys.stderr, flush=True)
        return EXIT_OK
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        fleet.close()
        if started_ray:
            ray.shutdown()


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


def _report(fleet: Any, as_json: bool) -> None:
    if as_json:
        rows = [
            {
                "index": e.index,
                "address": e.address,
                "lanes": e.lanes,
                "state": e.state,
                "restarts": e.restarts,
                "node": e.node,
            }
            for e in fleet.endpoints
        ]
        print(json.dumps({"endpoints": rows}), flush=True)
    else:
        for endpoint in fleet.endpoints:
            print(endpoint.address, flush=True)


def _write_ready(fd: int, addresses: list[str]) -> None:
    payload = "".join(f"{a}\n" for a in addresses).encode()
    try:
        written = 0
        while written < len(payload):
            written += os.write(fd, payload[written:])
    finally:
        os.close(fd)


def _usage(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
