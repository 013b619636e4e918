"""A lane's fields are written by the lane alone: by :class:`~rlmesh_trio._lanes._lane.Lane`'s
own methods, never by the thread, the supervisor, the watchdog or the engine that hold one.

The modules of ``_lanes/`` are read with ``ast``: every attribute stored to or deleted
(``=``, ``+=``, an annotated assignment, a tuple target, a ``for`` or ``with`` target,
``del``) and every ``setattr`` whose object is a lane, or an object a lane holds (its
cancel scope's deadline: ``lane.scope.deadline``), is an offence unless it sits inside
the ``Lane`` class. What is a lane is read from the code's own conventions: a name
``lane``, a name annotated ``Lane``, ``self`` inside ``Lane``, an element of a sequence of
lanes (``self._lanes[i]``, ``for x in lanes``), ``Lane(...)``, ``self._lane(i)``, and any
name bound to one of these.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import rlmesh_trio
from rlmesh_trio._lanes._lane import Lane

LANES = Path(rlmesh_trio.__file__).parent / "_lanes"
OWNER = "Lane"
"""The class whose methods may write a lane's fields."""

_LANE_TYPE = re.compile(r"(Lane|Optional\[Lane\]|Lane \| None|None \| Lane)")
_LANES_TYPE = re.compile(r"(Sequence|list|tuple|Iterable)\[Lane(, \.\.\.)?\]")


@dataclass(frozen=True)
class Write:
    path: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.target}"


def _annotation(node: ast.expr | None) -> str:
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


class _Reader:
    """Which expressions of one module are lanes, and where their attributes are written."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.lane_names: set[str] = {"lane"}
        self.collection_names: set[str] = {"lanes"}
        self._learn()

    def is_collection(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.collection_names
        if isinstance(node, ast.Attribute):
            return node.attr in ("lanes", "_lanes")
        return False

    def is_lane(self, node: ast.expr, *, in_owner: bool = False) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.lane_names or (in_owner and node.id == "self")
        if isinstance(node, ast.Subscript):
            return self.is_collection(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            return (isinstance(func, ast.Name) and func.id == OWNER) or (
                isinstance(func, ast.Attribute) and func.attr == "_lane"
            )
        return False

    def _learn(self) -> None:
        """Bind names to lanes (and sequences of lanes) until nothing new is learned."""
        while True:
            before = (len(self.lane_names), len(self.collection_names))
            for node in ast.walk(self.tree):
                if isinstance(node, ast.arg | ast.AnnAssign):
                    name = node.arg if isinstance(node, ast.arg) else _name(node.target)
                    kind = _annotation(node.annotation)
                    if name is not None and _LANE_TYPE.fullmatch(kind):
                        self.lane_names.add(name)
                    elif name is not None and _LANES_TYPE.fullmatch(kind):
                        self.collection_names.add(name)
                elif isinstance(node, ast.Assign) and self.is_lane(node.value):
                    self.lane_names.update(n for t in node.targets if (n := _name(t)))
                elif isinstance(node, ast.For | ast.comprehension):
                    name = _name(node.target)
                    if name is not None and self.is_collection(node.iter):
                        self.lane_names.add(name)
            if (len(self.lane_names), len(self.collection_names)) == before:
                return

    def writes(self, path: str, *, exempt_owner: bool) -> list[Write]:
        found: list[Write] = []

        def visit(node: ast.AST, in_owner: bool) -> None:
            if isinstance(node, ast.ClassDef) and node.name == OWNER:
                in_owner = True
            lane: ast.expr | None = None  # the object whose attribute ``node`` writes
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                lane = node.value
                while isinstance(lane, ast.Attribute):  # ``lane.scope.deadline``: the lane's
                    lane = lane.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and node.args
            ):
                lane = node.args[0]
            allowed = in_owner and exempt_owner
            if lane is not None and not allowed and self.is_lane(lane, in_owner=in_owner):
                found.append(Write(path, getattr(node, "lineno", 0), ast.unparse(node)))
            for child in ast.iter_child_nodes(node):
                visit(child, in_owner)

        visit(self.tree, False)
        return found


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def lane_writes(source: str, path: str = "<source>", *, exempt_owner: bool = True) -> list[Write]:
    """Every write to a lane's attribute in ``source`` (outside ``Lane``, if exempt)."""
    return _Reader(ast.parse(source)).writes(path, exempt_owner=exempt_owner)


def test_the_reader_finds_the_writes_it_must_and_no_others() -> None:
    source = textwrap.dedent(
        """
        def thread(lane, record: Lane, maybe: "Lane | None", inc: Incarnation) -> None:
            lane.state = 1                      # 3
            pending, lane.retry = lane.retry, None   # 4
            record.faults += 1                  # 5
            maybe.current: Item = None          # 6
            del lane.scope                      # 7
            setattr(lane, "since", 0)           # 8
            inc.abandoned = True                # an incarnation's field: not a lane's
            lane.scope.deadline = 1.0           # 10: the lane's scope's field
            other = lane.state                  # a read

        class Engine:
            def go(self, lanes: Sequence[Lane]) -> None:
                self._lanes[0].running = False  # 15
                for each in lanes:
                    each.given_up = True        # 17
                picked = self._lane(3)
                picked.wedges += 1              # 19
                alias = picked
                alias.proven = False            # 21
                self.state = 0                  # the engine's own field

        class Lane:
            def serve(self) -> None:
                self.state = 2                  # the lane's own method: allowed
        """
    )
    found = lane_writes(source)
    assert [(w.line, w.target) for w in found] == [
        (3, "lane.state"),
        (4, "lane.retry"),
        (5, "record.faults"),
        (6, "maybe.current"),
        (7, "lane.scope"),
        (8, "setattr(lane, 'since', 0)"),
        (10, "lane.scope.deadline"),
        (15, "self._lanes[0].running"),
        (17, "each.given_up"),
        (19, "picked.wedges"),
        (21, "alias.proven"),
    ]
    # ... and the lane's own writes, when the owner is not exempt
    assert [w.line for w in lane_writes(source, exempt_owner=False)][-1] == 26


def test_the_reader_sees_every_field_the_lane_writes_itself() -> None:
    """Run on ``_lane.py`` with the owner not exempt, the reader finds every slot of
    ``Lane`` written: it recognizes the lane where the code writes one."""
    path = LANES / "_lane.py"
    written = {
        w.target.split(".")[1]
        for w in lane_writes(path.read_text(encoding="utf-8"), path.name, exempt_owner=False)
        if w.target.startswith("self.")
    }
    assert written == set(Lane.__slots__)


def test_only_the_lane_writes_its_fields() -> None:
    offenders = [
        str(write)
        for path in sorted(LANES.glob("*.py"))
        for write in lane_writes(path.read_text(encoding="utf-8"), f"_lanes/{path.name}")
    ]
    assert offenders == [], (
        "a lane's fields are written only by Lane's own methods (_lanes/_lane.py); "
        "make these a Lane method named for the event:\n" + "\n".join(offenders)
    )
