"""``rlmesh-trio probe``: check an endpoint (health, handshake, env contract); exit 0 when
it serves, 1 otherwise, 2 for bad arguments."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from typing import Any

from .._address import parse_address
from .._credentials import AUTH_TOKEN_ENV
from ._args import PROG, DeprecatedFlag, add_seconds, seconds

__all__ = ["add_client_tls_arguments", "add_probe_parser", "client_tls_from_args", "probe_command"]

DEFAULT_TIMEOUT_SECONDS = 5.0


def add_probe_parser(commands: Any) -> None:
    """Register ``probe`` on the ``rlmesh-trio`` subparsers."""
    probe = commands.add_parser(
        "probe",
        help="check an endpoint: health, handshake, env contract",
        description="Check an rlmesh endpoint (rlmesh-trio or rlmesh 0.1.0): health, "
        "handshake and env contract. Exit 0 when it serves, 1 otherwise (a container "
        "health command).",
    )
    probe.add_argument("address", help="tcp://host:port, host:port, port or unix:///path")
    probe.add_argument("--json", action="store_true", help="print one JSON object")
    add_seconds(probe, "--timeout-seconds", DEFAULT_TIMEOUT_SECONDS, "seconds each call may take")
    probe.add_argument(
        "--timeout",
        action=DeprecatedFlag,
        replacement="--timeout-seconds",
        dest="timeout_seconds",
        type=seconds(minimum_exclusive=True),
        metavar="S",
    )
    probe.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help=f"bearer token of the endpoint (also: {AUTH_TOKEN_ENV})",
    )
    add_client_tls_arguments(probe)


def probe_command(args: argparse.Namespace) -> int:
    """Run ``rlmesh-trio probe``; return the exit code."""
    from ..client import probe

    try:
        parse_address(args.address)
        tls = client_tls_from_args(args)
    except ValueError as exc:
        print(f"{PROG} probe: error: {exc}", file=sys.stderr)
        return 2
    auth_token = args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
    try:
        result = probe(
            args.address, timeout_seconds=args.timeout_seconds, auth_token=auth_token, tls=tls
        )
    except ValueError as exc:  # e.g. --tls with a unix:// address
        print(f"{PROG} probe: error: {exc}", file=sys.stderr)
        return 2
    report = result.report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        width = max(len(key) for key in report) + 1
        for key, value in report.items():
            if isinstance(value, dict):
                shown = ", ".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, list):
                shown = ", ".join(str(v) for v in value)
            else:
                shown = str(value)
            print(f"{key + ':':<{width}} {shown}")
    return 0 if result.serving else 1


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """A client's TLS flags: system trust, a CA, a client certificate."""
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's CAs"
    )
    parser.add_argument(
        "--tls-ca-file",
        metavar="FILE",
        help="connect with TLS, trusting this CA (PEM) instead of the system's",
    )
    parser.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="mTLS: present this client certificate (PEM; with --tls-key-file)",
    )
    parser.add_argument(
        "--tls-key-file", metavar="FILE", help="the private key of --tls-cert-file (PEM)"
    )


def client_tls_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context the TLS flags ask for (None: plaintext); ValueError if unusable."""
    from .._tls import client_context_from_files

    if not (args.tls or args.tls_ca_file or args.tls_cert_file or args.tls_key_file):
        return None
    return client_context_from_files(
        args.tls_ca_file,
        args.tls_cert_file,
        args.tls_key_file,
        flags="--tls-cert-file and --tls-key-file",
    )
