"""The endpoint actor: one Ray actor process serving one endpoint.

:class:`EndpointActor` runs :func:`rlmesh_trio.serve_env` under ``trio.run`` on a thread
of its own; its constructor returns once the endpoint serves. :class:`EndpointInfo` is
what it reports about itself. A pinned port (a small file on the node) brings a
restarted actor back on the same port.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray

from ..._address import TcpAddress, parse_address
from ..._credentials import AUTH_TOKEN_ENV
from ..._deprecation import renamed_attribute
from ..._options import ServeOptions, resolve

log = logging.getLogger("rlmesh_trio.fleet.ray")

_PORT_DIR = "rlmesh-trio-fleet"
"""Under the node's temp dir: one small file per endpoint with its pinned port."""


@dataclass(frozen=True)
class ActorConfig:
    fleet_id: str
    index: int
    env: str | Callable[..., Any]
    env_kwargs: Mapping[str, Any]
    num_envs: int
    bind: str
    """``"node"`` (the node's IP), or the host to bind (``"auto"`` is resolved by launch)."""
    options: ServeOptions
    pin_ports: bool
    ready_timeout_seconds: float
    tls_pem: TlsPem | None = None
    """The endpoints' certificate, key and client CA, read on the driver: written to a
    private directory on the actor's node (so the files need not be there already)."""


@dataclass(frozen=True)
class TlsPem:
    cert: bytes
    key: bytes
    client_ca: bytes | None

    @classmethod
    def read(cls, cert: Any, key: Any, client_ca: Any) -> TlsPem:
        def load(path: Any) -> bytes:
            with open(os.fspath(path), "rb") as file:
                return file.read()

        return cls(load(cert), load(key), None if client_ca is None else load(client_ca))

    def materialize(self, options: ServeOptions) -> tuple[ServeOptions, str]:
        """``options`` pointing at the PEMs written to a fresh 0700 directory (returned)."""
        directory = tempfile.mkdtemp(prefix="rlmesh-trio-tls-")
        paths: dict[str, str | None] = {}
        for name, data in (("cert", self.cert), ("key", self.key), ("client_ca", self.client_ca)):
            if data is None:
                paths[name] = None
                continue
            path = os.path.join(directory, f"{name}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            paths[name] = path
        return (
            replace(
                options,
                tls_cert_file=paths["cert"],
                tls_key_file=paths["key"],
                tls_client_ca_file=paths["client_ca"],
            ),
            directory,
        )


@dataclass(frozen=True)
class EndpointInfo:
    """What an endpoint actor reports about itself (one constructor run):
    :meth:`RayFleet.info <rlmesh_trio.fleet.ray.RayFleet.info>`."""

    address: str
    """Where it serves, ``tcp://host:port``."""
    node: str
    """The Ray node id it runs on."""
    pid: int
    """Its process id (on that node)."""
    instance: str
    """Unique per start: a new value means the actor was restarted."""
    niceness: int
    """Its process's nice value."""
    env_id: str
    """The env it serves (the gymnasium id, or the factory's name)."""
    num_envs: int
    """How many lanes (envs) it serves."""

    lanes = renamed_attribute("num_envs", owner="EndpointInfo", old="lanes")


def _port_file(fleet_id: str, index: int) -> str:
    return os.path.join(tempfile.gettempdir(), _PORT_DIR, f"{fleet_id}-{index}.json")


class EndpointActor:
    """One endpoint: ``serve_env`` under ``trio.run`` on a thread of this actor process.

    The constructor returns once the endpoint serves (every lane built, the socket
    listening): Ray then runs the method calls. On a restart Ray runs it again with
    the same arguments; the port file makes it come back on the same port.
    """

    def __init__(self, config: ActorConfig) -> None:
        import trio

        from ..._serve import ServerInfo, serve_env

        # Machine-readable output is the driver's stdout: what the endpoint (or the env)
        # prints goes to the worker's stderr, which Ray relays to the driver's stderr.
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            os.dup2(2, 1)

        self._config = config
        self._tls_dir: str | None = None
        if config.tls_pem is not None:
            options, self._tls_dir = config.tls_pem.materialize(config.options)
            config = replace(config, options=options)
        if config.options.auth_token is None:
            # launch() decided on auth; a token in the workers' environment would make
            # the endpoint refuse the fleet's own probes (and be restarted forever).
            os.environ.pop(AUTH_TOKEN_ENV, None)
        self._ready: queue.Queue[ServerInfo | BaseException] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
        host = node_ip if config.bind == "node" else config.bind
        port = self._pinned_port() if config.pin_ports else 0

        async def main(port: int) -> bool:
            """Serve until stopped; False at once if the pinned ``port`` is taken."""
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                try:
                    info = await nursery.start(
                        functools.partial(
                            serve_env,
                            config.env,
                            num_envs=config.num_envs,
                            address=str(TcpAddress(host, port)),
                            options=config.options,
                            env_kwargs=config.env_kwargs,
                        )
                    )
                except OSError as exc:
                    if port == 0:
                        raise
                    log.warning("pinned port %d unavailable (%s): using a new one", port, exc)
                    return False
                self._ready.put(info)
            return True

        def thread_main() -> None:
            try:
                if not trio.run(main, port) and port:
                    trio.run(main, 0)
            except BaseException as exc:
                self._ready.put(exc)

        self._thread = threading.Thread(target=thread_main, name="rlmesh-trio-serve", daemon=True)
        self._thread.start()
        try:
            item = self._ready.get(timeout=config.ready_timeout_seconds)
        except queue.Empty:
            raise TimeoutError(
                f"endpoint {config.index} did not serve within {config.ready_timeout_seconds} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        self._server: ServerInfo = item
        self._stop_bound = resolve(config.options).stop_bound
        self._info = EndpointInfo(
            address=item.address,
            node=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex,
            niceness=os.nice(0),
            env_id=item.env_id,
            num_envs=item.num_envs,
        )
        if config.pin_ports:
            self._pin(parse_address(item.address))

    def _pinned_port(self) -> int:
        try:
            with open(_port_file(self._config.fleet_id, self._config.index)) as file:
                port = int(json.load(file)["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        return port if 0 < port < 65536 else 0

    def _pin(self, address: Any) -> None:
        path = _port_file(self._config.fleet_id, self._config.index)
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            temporary = f"{path}.{os.getpid()}"
            with open(temporary, "w") as file:
                json.dump({"port": address.port}, file)
            os.replace(temporary, path)

    def info(self) -> EndpointInfo:
        return self._info

    def stop(self) -> bool:
        """Stop serving (drain, close the lanes; bounded) and forget the pinned port."""
        token, scope = self._token, self._scope
        if token is not None and scope is not None:
            with contextlib.suppress(RuntimeError):  # the run already ended
                token.run_sync_soon(scope.cancel)
        self._thread.join(self._stop_bound + 1.0)
        with contextlib.suppress(OSError):
            os.remove(_port_file(self._config.fleet_id, self._config.index))
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
        return not self._thread.is_alive()
