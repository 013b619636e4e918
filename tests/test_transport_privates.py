"""The transport's reach into grpclib's and h2's privates, as data (issue 29):
every entry of ``_transport/_privates.REACHES`` resolves against the installed
libraries, no private use in ``_transport/`` is missing from it, and when h2's privates
are not what the direct DATA path expects the server serves through h2's public API
(the same answers, one warning). The whole interop suite on the public path:
``nox -s public-path``; on an h2 whose privates differ (4.2.0): ``nox -s h2-fallback``."""

from __future__ import annotations

import ast
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio
from packaging.version import Version

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._transport import _connection, _privates
from rlmesh_trio.client import open_endpoint

pytestmark = pytest.mark.timeout(60)

TRANSPORT = Path(_privates.__file__).parent
ALSO_SCANNED: tuple[Path, ...] = (TRANSPORT.parent / "client" / "_grpc.py",)
"""Outside ``_transport/``, the one other module that drives h2 (the client's framing)."""
LIBRARIES = ("h2", "grpclib", "hyperframe", "hpack")
H2_HAS_OUR_PRIVATES = Version(_privates.library_version("h2")) >= Version("4.3")
PYTHON_DUNDERS = {*dir(object), *dir(type), *dir(BaseException()), "__dispatch__"}
"""Dunder names that are Python's (``super().__init__``, an exception's ``__cause__``), and
grpclib's plugin hook."""


@pytest.fixture(autouse=True)
def checked_afresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test decides the path itself (``nox -s public-path`` runs this module with
    the public path forced for the rest of the suite)."""
    monkeypatch.delenv(_privates.DIRECT_DATA_ENV, raising=False)
    _privates.direct_data_path.cache_clear()
    yield
    _privates.direct_data_path.cache_clear()


def _resolve(owner: str) -> object:
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


@pytest.mark.parametrize(
    "reach", _privates.REACHES, ids=[f"{r.owner}.{r.name}" for r in _privates.REACHES]
)
def test_every_listed_private_is_there_in_the_installed_library(
    reach: _privates.Reach,
) -> None:
    owner = _resolve(reach.owner)
    assert reach.why and reach.fallback
    if reach.access == "override":
        # A method of the library's that a subclass of ours replaces: still there, and
        # still called by the library (checked by behaviour where the override lives).
        assert isinstance(owner, type) and callable(getattr(owner, reach.name))
    elif reach.access == "behaviour":
        _check_behaviour(reach)
    elif reach.access == "import":
        assert (
            importlib.import_module(f"{reach.owner}.{reach.name}")
            if hasattr(owner, "__path__") and not hasattr(owner, reach.name)
            else getattr(owner, reach.name)
        )
    elif reach.library == "h2":
        if not H2_HAS_OUR_PRIVATES:
            pytest.skip("h2 before 4.3 differs here by design (nox -s public-path forces it)")
        # Instance attributes: check_h2 builds real connections and streams and checks
        # each of them, of its kind, and what the direct path does with them.
        assert _privates.check_h2() == []
    elif reach.access == "argument":
        assert isinstance(owner, type)
        instance = owner(**{reach.name: ("svc",)})
        assert instance is not None
    elif reach.access == "write":
        assert isinstance(owner, type)
        instance = owner(_service_names=("svc",))
        assert hasattr(instance, reach.name)
    else:
        assert callable(getattr(owner, reach.name))


def _check_behaviour(reach: _privates.Reach) -> None:
    """The behaviour reaches, each on a real object of the installed library."""
    import h2.config
    import h2.connection
    import h2.settings

    from rlmesh_trio._transport._connection import _EarlyStreams
    from rlmesh_trio._transport._flood import ADVERTISED_STREAMS, STREAMS_HARD_LIMIT

    if reach.name == "state":
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        assert isinstance(server.state_machine, h2.connection.H2ConnectionStateMachine)
        assert server.state_machine.state is h2.connection.ConnectionState.IDLE
    elif reach.name == "__class__":
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        settings = server.local_settings
        assert type(settings) is h2.settings.Settings
        settings.__class__ = _EarlyStreams
        # h2 now admits streams past the advertised limit (the dispatcher refuses them)
        assert settings.max_concurrent_streams == STREAMS_HARD_LIMIT > ADVERTISED_STREAMS
    else:
        raise AssertionError(f"no behaviour check for {reach.name}")


def test_the_clients_graceful_goaway_override_is_called_by_h2() -> None:
    """The client's _receive_goaway_frame: h2 still dispatches a GOAWAY to it, and after
    a graceful one the client still takes a stream's trailers."""
    import h2.config
    import h2.connection
    import h2.events

    from rlmesh_trio.client._grpc import _GracefulH2Connection

    client = _GracefulH2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    client.send_headers(
        1, [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "x")]
    )
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")])
    server.close_connection()  # GOAWAY(NO_ERROR)
    goaway = server.data_to_send()
    server.state_machine.state = h2.connection.ConnectionState.SERVER_OPEN
    server.send_headers(1, [("grpc-status", "0")], end_stream=True)
    events = client.receive_data(goaway + server.data_to_send())
    kinds = [type(event) for event in events]
    assert h2.events.ConnectionTerminated in kinds
    assert h2.events.StreamEnded in kinds, kinds


def _our_names() -> set[str]:
    """Private names this package defines itself (attributes, methods, slots)."""
    names: set[str] = set()
    for path in Path(_privates.__file__).parents[1].rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.isidentifier()  # __slots__ entries
            ):
                names.add(node.value)
    return names


def _is_super_call(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _library_names(tree: ast.Module) -> dict[str, str]:
    """The names a module binds to the libraries, as dotted paths: ``from h2.connection
    import H2Connection as C`` binds C to ``h2.connection.H2Connection``; ``import
    h2.settings`` binds h2 to ``h2``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    bound = alias.asname or alias.name.split(".")[0]
                    names[bound] = alias.name if alias.asname else bound
    return names


def _resolve_dotted(dotted: str) -> object | None:
    """The object at ``dotted`` (a module path, then attributes), None if not there."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute, None)
            if obj is None:
                return None
        return obj
    return None


def _library_overrides(
    file: str, node: ast.ClassDef, library_names: dict[str, str]
) -> list[tuple[str, int, str]]:
    """Underscored methods of a class of ours that replace one of a library base's:
    an override of a private is a reach into it (it must still be called)."""
    bases: list[object] = []
    for base in node.bases:
        dotted = ast.unparse(base)
        root, _, rest = dotted.partition(".")
        if root in library_names:
            resolved = _resolve_dotted(f"{library_names[root]}.{rest}".rstrip("."))
            if isinstance(resolved, type):
                bases.append(resolved)
    found = []
    for item in node.body:
        if (
            isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            and item.name.startswith("_")
            and item.name not in PYTHON_DUNDERS
            and any(hasattr(base, item.name) for base in bases)
        ):
            found.append((file, item.lineno, item.name))
    return found


def _private_uses() -> list[tuple[str, int, str]]:
    """(file, line, name) of every private of another library used in ``_transport/``
    and the client's ``_grpc.py``:
    an underscored attribute of anything but ``self``/``cls`` that the package does not
    define itself, every underscored name imported from the libraries, every
    ``super()._x``, and every underscored method of ours that overrides a library base
    class's."""
    ours = _our_names()
    uses: list[tuple[str, int, str]] = []
    for path in [*sorted(TRANSPORT.glob("*.py")), *ALSO_SCANNED]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        library_names = _library_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                root = node.module.split(".")[0]
                parts = node.module.split(".")
                if root in LIBRARIES:
                    for part in parts[1:]:
                        if part.startswith("_"):
                            uses.append((path.name, node.lineno, part))
                    for alias in node.names:
                        if alias.name.startswith("_"):
                            uses.append((path.name, node.lineno, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in LIBRARIES:
                        uses.extend(
                            (path.name, node.lineno, part)
                            for part in alias.name.split(".")[1:]
                            if part.startswith("_")
                        )
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                if _is_super_call(base) and node.attr not in PYTHON_DUNDERS:
                    # super()._x: the library's private, whatever our subclass defines
                    uses.append((path.name, node.lineno, node.attr))
                    continue
                if node.attr.startswith("__") and node.attr.endswith("__"):
                    if node.attr in PYTHON_DUNDERS:
                        continue  # Python's own, and grpclib's documented plugin hook
                elif node.attr in ours:
                    continue
                uses.append((path.name, node.lineno, node.attr))
            elif isinstance(node, ast.ClassDef):
                uses.extend(_library_overrides(path.name, node, library_names))
            elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
                uses.append((path.name, node.value.lineno, node.arg))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_")
                and node.args[1].value not in ours
            ):
                uses.append((path.name, node.lineno, node.args[1].value))
    return uses


def test_no_private_use_in_the_transport_is_missing_from_the_list() -> None:
    listed = {reach.name for reach in _privates.REACHES}
    missing = [use for use in _private_uses() if use[2] not in listed]
    assert not missing, f"private uses not in _privates.REACHES: {missing}"


def test_the_scan_sees_a_private_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan itself: a new underscored reach in a transport module is found."""
    probe = tmp_path / "_probe.py"
    probe.write_text(
        "import h2.connection\n"
        "from grpclib.protocol import _Secret\n"
        "def f(conn):\n"
        "    return conn._connection_internals, getattr(conn, '_hidden_thing')\n"
        "class C(h2.connection.H2Connection):\n"
        "    def _receive_ping_frame(self, frame):\n"
        "        return super()._receive_ping_frame(frame)\n"
        "    def _a_helper_of_ours(self):\n"
        "        return super()._open_streams(lambda s: True)\n"
    )
    monkeypatch.setattr(f"{__name__}.TRANSPORT", tmp_path)  # only the probe is scanned
    monkeypatch.setattr(f"{__name__}.ALSO_SCANNED", ())
    uses = _private_uses()
    names = {name for _, _, name in uses}
    assert names == {
        "_Secret",
        "_connection_internals",
        "_hidden_thing",
        "_receive_ping_frame",  # the override, and its super() call
        "_open_streams",  # super() from a helper of ours
    }
    assert ("_probe.py", 6, "_receive_ping_frame") in uses  # the def line


def test_every_h2_reach_is_in_the_structural_check() -> None:
    """check_h2 checks each h2 entry of the direct DATA path by name (those whose
    fallback is the public path): a new one cannot be listed unchecked. The others are
    checked here, each by its access: :func:`_check_behaviour`, an override's test."""
    source = Path(_privates.__file__).read_text(encoding="utf-8")
    check = source[source.index("def check_h2") : source.index("def direct_data_path")]
    for reach in _privates.REACHES:
        direct = reach.fallback.startswith(_privates.PUBLIC_DATA)
        if reach.library == "h2" and direct and reach.access in ("read", "write"):
            assert f'"{reach.name}"' in check, reach.name


async def _a_session(address: str) -> list[float]:
    with trio.fail_after(30):
        async with open_endpoint(address) as endpoint:
            observations, _ = await endpoint.reset(seeds=[3, 4])
            rewards: list[float] = []
            for step in range(8):  # well inside an episode
                actions = np.array([step % 2, (step // 2) % 2], dtype=np.int64)
                observations, reward, *_ = await endpoint.step(actions)
                rewards.extend(reward.tolist())
            return [*observations.ravel().tolist(), *rewards]


async def _served_session() -> list[float]:
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            info = await nursery.start(
                lambda task_status: serve_env(
                    "CartPole-v1", num_envs=2, options=ServeOptions(), task_status=task_status
                )
            )
        try:
            return await _a_session(info.address)
        finally:
            nursery.cancel_scope.cancel()


async def test_a_renamed_h2_private_falls_back_to_the_public_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated: the structural check finds a private renamed (as h2 4.2.0's frame
    buffer is ``data``, not ``_data``). The server then serves every frame through h2's
    public API -- the same observations and rewards -- and says so once."""
    baseline = await _served_session()
    caplog.clear()  # (an h2 whose privates really differ has said so already)
    real = _privates.check_h2
    monkeypatch.setattr(_privates, "check_h2", lambda: ["FrameBuffer._data is not a bytes"])
    _privates.direct_data_path.cache_clear()
    taken: list[int] = []
    route = _connection.route_frames

    def counted(*args: object, **kwargs: object) -> bool:
        taken.append(1)
        return route(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_connection, "route_frames", counted)
    try:
        with caplog.at_level(logging.WARNING, logger="rlmesh_trio.transport"):
            assert await _served_session() == baseline
            assert await _served_session() == baseline
        assert taken == []  # never past h2
        warnings = [r.getMessage() for r in caplog.records if "direct DATA path" in r.getMessage()]
        assert len(warnings) == 1 and "public API" in warnings[0]
        assert f"h2 {_privates.library_version('h2')}" in warnings[0]
    finally:
        monkeypatch.setattr(_privates, "check_h2", real)
        _privates.direct_data_path.cache_clear()


def test_the_public_path_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    _privates.direct_data_path.cache_clear()
    monkeypatch.setenv(_privates.DIRECT_DATA_ENV, "0")
    _privates.direct_data_path.cache_clear()
    try:
        assert _privates.direct_data_path() is False
    finally:
        monkeypatch.delenv(_privates.DIRECT_DATA_ENV)
        _privates.direct_data_path.cache_clear()
    assert _privates.direct_data_path() is (not _privates.check_h2())
    _privates.direct_data_path.cache_clear()


def test_grpclib_fallbacks_build_what_the_handler_needs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    import grpclib.config
    import grpclib.events

    async def on_a_loop() -> object:  # as the transport builds it: on its loop
        return _privates.dispatch_events()

    normal = asyncio.run(on_a_loop())
    monkeypatch.delattr(grpclib.events, "_DispatchServerEvents")
    events = asyncio.run(on_a_loop())
    assert type(events) is type(normal)  # a throwaway Server's, the same kind
    monkeypatch.undo()
    monkeypatch.delattr(grpclib.config.Configuration, "__for_server__")
    config = _privates.server_configuration()
    assert config.http2_stream_window_size > 0
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "_DispatchServerEvents" in messages and "__for_server__" in messages


def test_the_installed_h2_takes_the_path_its_privates_allow() -> None:
    """h2 before 4.3 keeps its frame buffer in ``data``, not ``_data`` (``nox -s
    public-path`` forces 4.2.0 in): there the public path serves; from 4.3 the direct
    one. Whichever h2 is installed, the choice is the check's, not a version number's."""
    _privates.direct_data_path.cache_clear()
    try:
        assert _privates.direct_data_path() is H2_HAS_OUR_PRIVATES
    finally:
        _privates.direct_data_path.cache_clear()
