"""The package layering, pinned: who may import whom inside ``rlmesh_trio``.

Imports are read with ``ast`` from the source (every ``import`` statement, also those
inside functions and under ``TYPE_CHECKING``), so a rule holds for the code, not only for
what one run happens to import. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import rlmesh_trio

ROOT = Path(rlmesh_trio.__file__).parent
PACKAGE = "rlmesh_trio"

IO_MODULES = frozenset({"trio", "asyncio", "socket", "threading", "selectors", "ssl", "uvloop"})
"""What a sans-IO layer must not import (nor anything that owns a thread or a socket)."""

NOT_THE_SERVER = frozenset({"client", "fleet", "_cli", "__main__", "__init__", "_proto"})
"""Top-level units that are not the server's own packages (the client, the fleet, the
command line, the package's face, the generated messages)."""


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            yield base
            # ``from . import _engine`` imports a module, not a name of the package
            for alias in node.names:
                yield f"{base}.{alias.name}"


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module -> the modules of this package it imports."""
    modules = {_module_of(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, frozenset[str]] = {}
    for module, path in modules.items():
        edges[module] = frozenset(name for name in _imports(path) if name in modules)
    return edges


@cache
def external(module: str) -> frozenset[str]:
    """The top-level names of the modules outside this package that ``module`` imports."""
    path = next(p for p in ROOT.rglob("*.py") if _module_of(p) == module)
    return frozenset(name.split(".")[0] for name in _imports(path) if name.split(".")[0] != PACKAGE)


def unit(module: str) -> str:
    """The top-level package or module of ``rlmesh_trio`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def crossings(source: str, targets: set[str]) -> list[str]:
    """Imports from the unit ``source`` into any of the units ``targets``."""
    return sorted(
        f"{module} -> {imported}"
        for module, imported_set in graph().items()
        if unit(module) == source
        for imported in imported_set
        if unit(imported) in targets
    )


def test_the_reader_sees_the_imports_it_must() -> None:
    """The rules below are only as good as the parser: check it on known imports."""
    edges = graph()
    # a relative import of a sibling module, resolved
    assert "rlmesh_trio._lanes._state" in edges["rlmesh_trio._lanes._lane"]
    # a function-level import: the fleet command imports the Ray launcher inside a function
    assert "rlmesh_trio.fleet.ray" in edges["rlmesh_trio._cli._fleet"]
    # ``from . import _engine`` inside a function of the package's __init__
    assert "rlmesh_trio._lanes._engine" in edges["rlmesh_trio._lanes"]
    assert "trio" in external("rlmesh_trio._lanes._engine")


def test_the_session_never_imports_lanes_transport_or_bridge() -> None:
    assert crossings("_session", {"_lanes", "_transport", "_bridge"}) == []


def test_the_fleet_never_imports_the_transport() -> None:
    assert crossings("fleet", {"_transport"}) == []


THE_SERVER = frozenset(
    {"_transport", "_lanes", "_serve", "_session", "_bridge", "_logging", "_metrics"}
)
"""The server's own units: what a client program never needs to import."""


def reach(module: str) -> set[str]:
    """Every module of the package that importing ``module`` may import, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for imported in graph()[todo.pop()]:
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def test_the_client_imports_nothing_of_the_server() -> None:
    """The client stands on the floors below the server (the wire, the codec, the
    address forms, TLS, the credential filter), never on the server itself: neither
    directly nor through a module it imports."""
    assert crossings("client", set(THE_SERVER)) == []
    offenders = sorted(
        f"{module} ~> {reached}"
        for module in graph()
        if unit(module) == "client"
        for reached in reach(module)
        if unit(reached) in THE_SERVER
    )
    assert offenders == []
    # it sees the edges it rules on
    assert "rlmesh_trio._credentials" in graph()["rlmesh_trio.client._settings"]
    assert "rlmesh_trio._wire._protocol" in reach("rlmesh_trio.client._endpoint")


def test_the_credentials_are_a_leaf() -> None:
    """Client and server both install the credential filter: it imports nothing of the
    package, so neither stands on the other to reach it."""
    assert graph()["rlmesh_trio._credentials"] == frozenset()


@pytest.mark.parametrize("layer", ["_wire", "_codec"])
def test_the_sans_io_layers_import_no_io(layer: str) -> None:
    offenders = sorted(
        f"{module}: {name}"
        for module in graph()
        if unit(module) == layer
        for name in external(module) & IO_MODULES
    )
    assert offenders == []
    # nor do they reach IO through the package's own IO layers
    assert crossings(layer, {"_transport", "_lanes", "_bridge", "_serve", "client"}) == []


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``edges`` closes, as ``[a, b, ..., a]``."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_among_the_servers_packages() -> None:
    units: dict[str, set[str]] = {}
    for module, imported in graph().items():
        source = unit(module)
        if source in NOT_THE_SERVER:
            continue
        targets = units.setdefault(source, set())
        targets.update(unit(m) for m in imported if unit(m) not in NOT_THE_SERVER)
        targets.discard(source)
    cycles = find_cycles(units)
    assert cycles == [], " ; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_fleet_is_a_library_without_command_line_code() -> None:
    """The command line imports the fleet (``_cli._fleet``, Ray's part only when it runs),
    never the other way round; nothing of the fleet parses arguments."""
    assert crossings("fleet", {"_cli", "__main__"}) == []
    offenders = sorted(m for m in graph() if unit(m) == "fleet" and "argparse" in external(m))
    assert offenders == []


def test_no_import_cycle_among_the_command_lines_and_the_fleets_modules() -> None:
    """Module by module (not only package by package), also from inside a function: the
    command line's modules and the fleet's import no one that imports them back (the CLI
    and the fleet's CLI used to import each other)."""
    mine = {m for m in graph() if unit(m) in ("_cli", "fleet", "__main__")}
    # not an edge: a module to its own package (``from . import _run`` names the package
    # to reach a sibling; the package is always imported before its modules)
    edges = {
        m: {i for i in graph()[m] & mine if i != m and not m.startswith(f"{i}.")} for m in mine
    }
    cycles = find_cycles(edges)
    assert cycles == [], " ; ".join(" -> ".join(cycle) for cycle in cycles)
    assert "rlmesh_trio._cli._args" in edges["rlmesh_trio._cli._serve"]  # it sees the edges
    assert "rlmesh_trio._cli._args" in edges["rlmesh_trio._cli._fleet"]


def test_only_the_transport_package_imports_asyncio_grpclib_or_h2() -> None:
    """STYLE 2: the wire format, the session, the lanes, the bridge and serve never
    import the asyncio stack; the transport package holds all of it. The one exception:
    the client's sans-IO HTTP/2 layer (``client/_grpc.py``) drives the ``h2`` state
    machine itself, on Trio or a plain socket, and imports nothing of asyncio's."""
    root = Path(rlmesh_trio.__file__).parent
    banned = {"asyncio", "grpclib", "h2", "hyperframe", "hpack", "uvloop"}
    offenders = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] in ("_transport", "_proto"):
            continue
        allowed = {"h2"} if parts == ("client", "_grpc.py") else set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n.split(".")[0] in banned and n.split(".")[0] not in allowed
            ]
    assert offenders == []


def test_no_import_cycle_anywhere_in_the_package() -> None:
    """Module by module over all of ``src/`` (imports inside functions and under
    ``TYPE_CHECKING`` included): no module imports one that imports it back. An edge from
    a module to a package it lives in is not counted (the package is always imported
    before its modules; ``from . import _x`` names it to reach a sibling); an edge from a
    package's ``__init__`` down into its own modules is."""
    edges = {
        m: {i for i in imported if i != m and not m.startswith(f"{i}.")}
        for m, imported in graph().items()
    }
    cycles = find_cycles(edges)
    assert cycles == [], " ; ".join(" -> ".join(cycle) for cycle in cycles)
    assert "rlmesh_trio._serve" in edges["rlmesh_trio"]  # it sees the lazy import


def _module_rows() -> dict[str, str]:
    """docs/architecture.md's module table: first cell (a module or a package) -> row."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(
        encoding="utf-8"
    )
    rows: dict[str, str] = {}
    for line in doc.splitlines():
        if line.startswith("| `") and line.count("|") >= 4:
            first = line.split("|")[1]
            for name in first.split("`")[
                1::2
            ]:  # every name the cell gives (`_cli/`, `__main__.py`)
                rows[name] = line
    return rows


def test_the_architecture_doc_names_every_module() -> None:
    """Each module has its row (a top-level one) or is named in its package's row, so
    the picture a newcomer reads first stays whole as modules come and go."""
    rows = _module_rows()
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] == "_proto" or path.name == "__init__.py":
            continue
        if len(parts) == 1:
            if path.name not in rows:
                missing.append(path.name)
            continue
        row = rows.get(f"{parts[0]}/", "")
        if f"`{path.name}`" not in row and f"{path.name}" not in row:
            missing.append("/".join(parts))
    assert missing == []


def _layer_figure() -> list[list[str]]:
    """The units of docs/architecture.md's layer figure, one list per floor, the ground
    floor first (the fenced block after the ``<!-- layers`` line)."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- layers"))
    assert lines[start + 1] == "```", lines[start + 1]
    floors = []
    for line in lines[start + 2 :]:
        if line == "```":
            break
        names = line.split("(")[0].replace(",", " ").split()
        assert names, line
        floors.append(names)
    return floors


def test_the_layer_figure_is_the_code() -> None:
    """Every unit of the package stands once in the figure, on a floor above everything
    it imports: the figure a newcomer reads is the code's own layering."""
    floors = _layer_figure()
    floor_of = {name: k for k, names in enumerate(floors) for name in names}
    assert sum(len(names) for names in floors) == len(floor_of), "a unit drawn twice"
    units = {unit(module) for module in graph()}
    assert set(floor_of) == units, (set(floor_of) - units, units - set(floor_of))
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imported_set in graph().items()
        for imported in imported_set
        if unit(imported) != unit(module) and floor_of[unit(imported)] >= floor_of[unit(module)]
    )
    assert wrong == [], "imports that do not go down the figure"
