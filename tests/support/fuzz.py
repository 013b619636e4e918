"""Seeded differential fuzzing of JoinRequest handling (SPEC §7, §9, §1.10).

Two parts:

* a generator (:func:`generate`) of mutated JoinRequest bytes. It starts from a valid
  request of every kind (whole and lane-scoped reset and step, render, configure,
  close), built as a small tree of protobuf fields so that structural mutations are
  easy (duplicated fields and arms, other oneof arm numbers, wire types, groups, huge
  length prefixes, field numbers around 2^29, invalid UTF-8, ...), serialises it and
  may then damage the bytes (bit flips, inserted or deleted bytes, truncation). The
  same ``(seed, count, shape)`` always gives the same messages.
* a driver (:func:`differential`) that sends each message on an open Join of two
  servers at once and classifies what came back as a small comparable
  :class:`Outcome`.

Timing is kept out of the outcomes: every generated request has its deadline
(``timeout_ms``) absent, and :func:`zero_timeouts` rewrites any nonzero
``timeout_ms`` that a mutation produced (a bit flip, a renumbered arm: a reset's
``options`` reinterpreted as a step, ...) into an explicit 0, after the mutations, on
the final bytes. A nonzero deadline would make the reply depend on how fast the env
call happens to run (SPEC §7.11).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import betterproto2

from . import scripts, wire
from .protobuf import U64, tag, varint

# --------------------------------------------------------------------------- field trees


@dataclass
class Packed:
    """A packed repeated varint field's values (wire type 2)."""

    values: list[int]


class Text(bytes):
    """A string field's UTF-8 bytes (a target of the invalid-UTF-8 mutation)."""


@dataclass
class Raw:
    """Bytes emitted verbatim (a damaged field)."""

    data: bytes


@dataclass
class F:
    """One field: number, wire type and value.

    ``value`` is an int for wire type 0, bytes for 1 and 5 (8 and 4 bytes) and for a
    plain wire-type-2 payload, :class:`Packed` for packed varints, a list of fields for
    an embedded message (wire type 2) or a group (wire type 3, closed by a wire-type-4
    tag of the same number).
    """

    num: int
    wt: int
    value: Any


Node = F | Raw
Tree = list[Node]


def payload(node: F) -> bytes:
    """The bytes after the tag, as the field's wire type spells them."""
    value = node.value
    if node.wt == 0:
        return varint(value)
    if node.wt in (1, 5):
        return bytes(value)
    if node.wt == 3:
        return encode(value) + tag(node.num, 4)
    if isinstance(value, Packed):
        body = b"".join(varint(v) for v in value.values)
    elif isinstance(value, list):
        body = encode(value)
    else:
        body = bytes(value)
    return varint(len(body)) + body


def encode(tree: Sequence[Node]) -> bytes:
    return b"".join(
        node.data if isinstance(node, Raw) else tag(node.num, node.wt) + payload(node)
        for node in tree
    )


def msg(num: int, fields: Tree) -> F:
    return F(num, 2, fields)


def text(num: int, value: str) -> F:
    return F(num, 2, Text(value.encode()))


def blob(num: int, value: bytes) -> F:
    return F(num, 2, bytes(value))


def packed(num: int, values: Sequence[int]) -> list[F]:
    """A packed repeated varint field, omitted when empty (as proto3 encoders do)."""
    return [F(num, 2, Packed(list(values)))] if values else []


def walk(tree: Tree, depth: int = 0) -> list[tuple[Tree, int, F, int]]:
    """Every field of ``tree`` at any depth: (its list, index, field, depth)."""
    out: list[tuple[Tree, int, F, int]] = []
    for i, node in enumerate(tree):
        if isinstance(node, F):
            out.append((tree, i, node, depth))
            if isinstance(node.value, list):
                out.extend(walk(node.value, depth + 1))
    return out


# --------------------------------------------------------------------------- env shapes


@dataclass(frozen=True)
class Shape:
    """What the served env looks like to the generator: lane count and action leaves."""

    env: str
    num_envs: int

    def action(self, rng: random.Random, lanes: int) -> list[bytes]:
        """Valid action leaves for ``lanes`` rows."""
        if self.env == "cartpole":
            return [wire.i64(rng.randrange(2) for _ in range(lanes))]
        rows = [
            {
                "move": [rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0]) for _ in range(2)],
                "fire": rng.randrange(2),
                "buttons": [rng.randrange(2) for _ in range(3)],
                "say": "".join(rng.choice("xyz") for _ in range(rng.randint(1, 6))),
            }
            for _ in range(lanes)
        ]
        return wire.nested_action(rows)

    def ritual_seeds(self) -> list[int]:
        """The seeds of the whole reset that starts every fresh Join."""
        return [11 + lane for lane in range(self.num_envs)]


SHAPES = {
    "cartpole": Shape("cartpole", 4),
    "nested": Shape("nested", 2),
}

ENTRYPOINTS = {name: scripts.ENTRYPOINTS[name] for name in SHAPES}


# --------------------------------------------------------------------------- valid requests

ARMS = {"reset": 1, "step": 2, "render": 3, "close": 4, "configure": 6}
REQUEST_ID = 5
TIMEOUT_FIELD = {1: 3, 2: 2, 3: 2}
"""JoinRequest arm number -> the field number of its ``timeout_ms``."""

OPTION_KEYS = ["level", "mode", "k", "weights", "deep", "", "é"]
WORDS = ["", "a", "ep-1", "grpc-req-7", "ünï", "x" * 20]


def meta_value(rng: random.Random, depth: int = 0) -> Tree:
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return []  # None
    if kind == 1:
        return [F(1, 0, rng.choice([0, 1, -3, 42, 2**40, -(2**63)]))]
    if kind == 2:
        return [F(2, 1, struct.pack("<d", rng.choice([0.0, 1.5, -2.25, 1e300])))]
    if kind == 3:
        return [text(3, rng.choice(WORDS))]
    if kind == 4:
        return [F(4, 0, rng.randrange(2))]
    if kind == 5:
        return [blob(5, bytes(rng.randrange(256) for _ in range(rng.randrange(4))))]
    if kind == 6:
        return [msg(6, [msg(1, meta_value(rng, depth + 1)) for _ in range(rng.randrange(3))])]
    return [msg(7, meta_map(rng, depth + 1))]


def meta_map(rng: random.Random, depth: int = 0) -> Tree:
    keys = rng.sample(OPTION_KEYS, rng.randrange(1, 4))
    return [msg(1, [text(1, key), msg(2, meta_value(rng, depth))]) for key in keys]


def seeds_for(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([0, 1, 7, 42, 1000, 2**31, 2**40]) + rng.randrange(5) for _ in range(n)]


def lanes(rng: random.Random, shape: Shape) -> list[int]:
    """A random, duplicate-free, in-range ``env_indices`` list in random order."""
    return rng.sample(range(shape.num_envs), rng.randint(1, shape.num_envs))


def maybe_explicit_zero_timeout(rng: random.Random, arm: int) -> list[F]:
    """``timeout_ms`` is left absent, or sent as an explicit 0 (no deadline)."""
    return [F(TIMEOUT_FIELD[arm], 0, 0)] if rng.random() < 0.15 else []


def reset_arm(rng: random.Random, shape: Shape, *, lane_scoped: bool) -> F:
    indices = lanes(rng, shape) if lane_scoped else []
    count = len(indices) if lane_scoped else rng.randint(0, shape.num_envs + 1)
    fields: Tree = [*packed(1, seeds_for(rng, count if rng.random() < 0.7 else 0))]
    if rng.random() < 0.3:
        fields.append(msg(2, meta_map(rng)))
    fields += maybe_explicit_zero_timeout(rng, 1)
    fields += packed(4, indices)
    if rng.random() < 0.4:
        fields += [text(5, f"ep-{i}") for i in range(count)]
    return msg(1, fields)


def step_arm(rng: random.Random, shape: Shape, *, lane_scoped: bool) -> F:
    indices = lanes(rng, shape) if lane_scoped else []
    rows = len(indices) if lane_scoped else shape.num_envs
    fields: Tree = [msg(1, [blob(1, leaf) for leaf in shape.action(rng, rows)])]
    fields += maybe_explicit_zero_timeout(rng, 2)
    fields += packed(3, indices)
    if rng.random() < 0.3:
        fields += [text(4, f"ep-{i}") for i in range(rows)]
    return msg(2, fields)


def render_arm(rng: random.Random, shape: Shape) -> F:
    fields: Tree = packed(1, [0]) if rng.random() < 0.5 else []
    return msg(3, fields + maybe_explicit_zero_timeout(rng, 3))


def close_arm(rng: random.Random, shape: Shape) -> F:
    return msg(4, [text(1, rng.choice(["client close", "bye"]))] if rng.random() < 0.6 else [])


def configure_arm(rng: random.Random, shape: Shape) -> F:
    edition = rng.choices(["2026.06", "", "2026.06-dev.abc", "1999.01"], [6, 2, 2, 1])[0]
    return msg(6, [text(1, edition)] if edition else [])


BASES: dict[str, tuple[float, Callable[[random.Random, Shape], F]]] = {
    "reset": (2, lambda rng, s: reset_arm(rng, s, lane_scoped=False)),
    "lane-reset": (3, lambda rng, s: reset_arm(rng, s, lane_scoped=True)),
    "step": (3, lambda rng, s: step_arm(rng, s, lane_scoped=False)),
    "lane-step": (3, lambda rng, s: step_arm(rng, s, lane_scoped=True)),
    "render": (2, render_arm),
    "configure": (1, configure_arm),
    "close": (0.5, close_arm),
}


def arm_of(rng: random.Random, shape: Shape, base: str) -> F:
    return BASES[base][1](rng, shape)


def join_request(rng: random.Random, shape: Shape, base: str) -> Tree:
    tree: Tree = [arm_of(rng, shape, base)]
    if rng.random() < 0.5:
        request_id = text(REQUEST_ID, rng.choice(WORDS[1:]))
        tree.insert(rng.randrange(2), request_id)
    return tree


# --------------------------------------------------------------------------- mutations

ARM_NUMBERS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16, 100, 2047, 2**29 - 1]
UNKNOWN_NUMBERS = [7, 8, 9, 12, 15, 16, 20, 99, 1000, 2**20, 2**29 - 1]
LARGE_NUMBERS = [2**29 - 2, 2**29 - 1, 2**29, 2**29 + 1, 2**30, 2**31 - 1, 2**32 - 1]
HUGE_LENGTHS = [1000, 2**28 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 3, 2**62, U64]
EDGE_INTS = [0, 1, 2, 3, 4, 5, 127, 128, 300, -1, -2, 2**31 - 1, 2**31, 2**32, 2**32 + 1,
             2**63 - 1, 2**63, U64]  # fmt: skip
BAD_UTF8 = [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\xfe", b"\xf4\x90\x80\x80"]


def random_field(rng: random.Random, num: int, depth: int = 0) -> F:
    wt = rng.choice([0, 1, 2, 5, 3] if depth < 2 else [0, 1, 2, 5])
    if wt == 0:
        return F(num, 0, rng.choice(EDGE_INTS))
    if wt == 1:
        return F(num, 1, bytes(rng.randrange(256) for _ in range(8)))
    if wt == 5:
        return F(num, 5, bytes(rng.randrange(256) for _ in range(4)))
    if wt == 3:
        return F(num, 3, random_fields(rng, depth + 1))
    return blob(num, bytes(rng.randrange(256) for _ in range(rng.randrange(6))))


def random_fields(rng: random.Random, depth: int) -> Tree:
    return [random_field(rng, rng.choice(UNKNOWN_NUMBERS), depth) for _ in range(rng.randrange(3))]


def a_message(rng: random.Random, tree: Tree) -> Tree:
    """The top level or the body of a random embedded message of ``tree``."""
    bodies = [tree] + [
        f.value for _, _, f, _ in walk(tree) if f.wt == 2 and isinstance(f.value, list)
    ]
    return rng.choice(bodies)


def insert(rng: random.Random, body: Tree, node: Node) -> None:
    body.insert(rng.randint(0, len(body)), node)


def first_arm(tree: Tree) -> F | None:
    for node in tree:
        if isinstance(node, F) and node.num in ARMS.values() and isinstance(node.value, list):
            return node
    return None


def m_dup_field(rng: random.Random, tree: Tree, shape: Shape) -> str:
    fields = walk(tree)
    if not fields:
        return "dup-field(none)"
    parent, i, node, depth = rng.choice(fields)
    parent.insert(rng.randint(i + 1, len(parent)), copy.deepcopy(node))
    return f"dup-field({node.num}@{depth})"


def m_nested_dup(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """Duplicate a field inside an arm: two actions, two env_indices, two options, ..."""
    inner = [entry for entry in walk(tree) if entry[3] >= 1]
    if not inner:
        return m_dup_field(rng, tree, shape)
    parent, i, node, depth = rng.choice(inner)
    twin = copy.deepcopy(node)
    if isinstance(twin.value, Packed) and rng.random() < 0.5:
        twin.value = Packed([rng.choice([0, 1, 2, 3, 9]) for _ in twin.value.values])
    parent.insert(rng.randint(i + 1, len(parent)), twin)
    return f"nested-dup({node.num}@{depth})"


def m_repeat_arm(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """The whole arm's bytes repeated, or a second arm of the same kind (they merge)."""
    arm = first_arm(tree)
    if arm is None:
        return "repeat-arm(none)"
    if rng.random() < 0.5:
        tree.append(copy.deepcopy(arm))
        return "repeat-arm(same)"
    kind = {1: ["reset", "lane-reset"], 2: ["step", "lane-step"], 3: ["render"], 4: ["close"],
            6: ["configure"]}[arm.num]  # fmt: skip
    insert(rng, tree, arm_of(rng, shape, rng.choice(kind)))
    return "repeat-arm(other)"


def m_second_arm(rng: random.Random, tree: Tree, shape: Shape) -> str:
    base = rng.choice([b for b in BASES if b != "close"] + ["close"])
    insert(rng, tree, arm_of(rng, shape, base))
    return f"second-arm({base})"


def m_arm_number(rng: random.Random, tree: Tree, shape: Shape) -> str:
    arm = first_arm(tree)
    if arm is None:
        return "arm-number(none)"
    arm.num = rng.choice(ARM_NUMBERS)
    return f"arm-number({arm.num})"


def m_wire_type(rng: random.Random, tree: Tree, shape: Shape) -> str:
    fields = walk(tree)
    if not fields:
        return "wire-type(none)"
    parent, i, node, depth = rng.choice(fields)
    new = rng.choice([wt for wt in range(8) if wt != node.wt])
    parent[i] = Raw(tag(node.num, new) + payload(node))
    return f"wire-type({node.num}@{depth}:{node.wt}->{new})"


def m_group(rng: random.Random, tree: Tree, shape: Shape) -> str:
    body = a_message(rng, tree)
    num = rng.choice([*UNKNOWN_NUMBERS, 1, 2, 3])
    style = rng.choices(["group", "nested", "open", "stray-end", "wrong-end"], [5, 2, 1, 1, 1])[0]
    if style == "group":
        insert(rng, body, F(num, 3, random_fields(rng, 1)))
    elif style == "nested":
        insert(rng, body, F(num, 3, [F(num + 1, 3, random_fields(rng, 2)), *random_fields(rng, 2)]))
    elif style == "open":
        insert(rng, body, Raw(tag(num, 3) + encode(random_fields(rng, 2))))
    elif style == "stray-end":
        insert(rng, body, Raw(tag(num, 4)))
    else:
        insert(rng, body, Raw(tag(num, 3) + encode(random_fields(rng, 2)) + tag(num + 1, 4)))
    return f"group({style},{num})"


def m_unknown_field(rng: random.Random, tree: Tree, shape: Shape) -> str:
    num = rng.choice(UNKNOWN_NUMBERS)
    insert(rng, a_message(rng, tree), random_field(rng, num, 2))
    return f"unknown-field({num})"


def m_large_number(rng: random.Random, tree: Tree, shape: Shape) -> str:
    num = rng.choice(LARGE_NUMBERS)
    insert(rng, a_message(rng, tree), random_field(rng, num, 2))
    return f"large-field-number({num})"


def m_huge_length(rng: random.Random, tree: Tree, shape: Shape) -> str:
    claimed = rng.choice(HUGE_LENGTHS)
    candidates = [e for e in walk(tree) if e[2].wt == 2]
    if candidates and rng.random() < 0.7:
        parent, i, node, depth = rng.choice(candidates)
        body = payload(node)
        body = body[len(varint(len(body))) :] if body else b""
        parent[i] = Raw(tag(node.num, 2) + varint(claimed) + body[: rng.randint(0, len(body))])
        return f"huge-length({node.num}@{depth},{claimed})"
    num = rng.choice(UNKNOWN_NUMBERS)
    insert(rng, a_message(rng, tree), Raw(tag(num, 2) + varint(claimed) + b"\x00\x01"))
    return f"huge-length(unknown {num},{claimed})"


def m_bad_utf8(rng: random.Random, tree: Tree, shape: Shape) -> str:
    strings = [e for e in walk(tree) if isinstance(e[2].value, Text)]
    bad = rng.choice(BAD_UTF8)
    if not strings:
        insert(rng, tree, F(REQUEST_ID, 2, Text(bad)))
        return "bad-utf8(request_id)"
    _, _, node, depth = rng.choice(strings)
    good = bytes(node.value)
    cut = rng.randint(0, len(good))
    node.value = Text(good[:cut] + bad + good[cut:])
    return f"bad-utf8({node.num}@{depth})"


def m_unpack(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """A packed repeated field sent unpacked (valid), or partly so."""
    found = [e for e in walk(tree) if isinstance(e[2].value, Packed)]
    if not found:
        return m_edge_int(rng, tree, shape)
    parent, i, node, depth = rng.choice(found)
    values = node.value.values
    split = rng.randint(0, len(values))
    parent[i : i + 1] = [
        *packed(node.num, values[:split]),
        *(F(node.num, 0, v) for v in values[split:]),
    ]
    return f"unpack({node.num}@{depth})"


def m_edge_int(rng: random.Random, tree: Tree, shape: Shape) -> str:
    ints = [e for e in walk(tree) if e[2].wt == 0 or isinstance(e[2].value, Packed)]
    if not ints:
        return m_indices(rng, tree, shape)
    _, _, node, depth = rng.choice(ints)
    value = rng.choice(EDGE_INTS)
    if isinstance(node.value, Packed):
        if node.value.values:
            node.value.values[rng.randrange(len(node.value.values))] = value
        else:
            node.value.values.append(value)
    else:
        node.value = value
    return f"edge-int({node.num}@{depth}={value})"


def m_varint_form(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """A varint spelled non-minimally (valid up to 10 bytes) or too long (11 bytes)."""
    ints = [e for e in walk(tree) if e[2].wt == 0]
    if not ints:
        return m_edge_int(rng, tree, shape)
    parent, i, node, depth = rng.choice(ints)
    body = bytearray(varint(node.value))
    length = rng.choice([len(body) + 1, 10, 11])
    while len(body) < length:
        body[-1] |= 0x80
        body.append(0)
    parent[i] = Raw(tag(node.num, 0) + bytes(body))
    return f"varint-form({node.num}@{depth},{length} bytes)"


def m_indices(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """Random env_indices on the arm (out of range, duplicates, huge)."""
    arm = first_arm(tree)
    if arm is None or arm.num not in (1, 2, 3):
        return "indices(none)"
    num = {1: 4, 2: 3, 3: 1}[arm.num]
    pool = [0, 1, 2, 3, shape.num_envs, shape.num_envs + 1, 9, 2**31, 2**32, 2**32 + 1, -1]
    values = [rng.choice(pool) for _ in range(rng.randrange(5))]
    arm.value = [f for f in arm.value if not (isinstance(f, F) and f.num == num)]
    arm.value += packed(num, values)
    if arm.num == 2 and rng.random() < 0.5:  # an action with one row per index
        action = [blob(1, leaf) for leaf in shape.action(rng, len(values))]
        arm.value = [f for f in arm.value if not (isinstance(f, F) and f.num == 1)]
        arm.value.insert(0, msg(1, action))
    return f"indices({values})"


def m_seeds(rng: random.Random, tree: Tree, shape: Shape) -> str:
    """Seed and episode-id lists of another length (the partial-reset checks)."""
    arm = first_arm(tree)
    if arm is None or arm.num != 1:
        return m_indices(rng, tree, shape)
    arm.value = [f for f in arm.value if not (isinstance(f, F) and f.num in (1, 5))]
    seeds = seeds_for(rng, rng.randrange(6))
    if seeds and rng.random() < 0.2:
        seeds[rng.randrange(len(seeds))] = rng.choice([-1, -5])
    arm.value += packed(1, seeds)
    arm.value += [text(5, f"e{i}") for i in range(rng.randrange(6))]
    return f"seeds({len(seeds)})"


def m_drop_field(rng: random.Random, tree: Tree, shape: Shape) -> str:
    fields = walk(tree)
    if not fields:
        return "drop-field(none)"
    parent, i, node, depth = rng.choice(fields)
    del parent[i]
    return f"drop-field({node.num}@{depth})"


def m_shuffle(rng: random.Random, tree: Tree, shape: Shape) -> str:
    body = a_message(rng, tree)
    rng.shuffle(body)
    return "shuffle"


def m_leaf_garbage(rng: random.Random, tree: Tree, shape: Shape) -> str:
    leaves = [e for e in walk(tree) if e[3] == 2 and e[2].num == 1 and e[2].wt == 2]
    if not leaves:
        return m_unknown_field(rng, tree, shape)
    node = rng.choice(leaves)[2]
    node.value = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    return f"leaf-garbage({len(node.value)})"


STRUCTURAL: dict[str, tuple[float, Callable[[random.Random, Tree, Shape], str]]] = {
    "dup-field": (2, m_dup_field),
    "nested-dup": (3, m_nested_dup),
    "repeat-arm": (3, m_repeat_arm),
    "second-arm": (2, m_second_arm),
    "arm-number": (3, m_arm_number),
    "wire-type": (2, m_wire_type),
    "group": (3, m_group),
    "unknown-field": (2, m_unknown_field),
    "large-field-number": (2, m_large_number),
    "huge-length": (2, m_huge_length),
    "bad-utf8": (2, m_bad_utf8),
    "unpack": (2, m_unpack),
    "edge-int": (2, m_edge_int),
    "varint-form": (1, m_varint_form),
    "indices": (3, m_indices),
    "seeds": (2, m_seeds),
    "drop-field": (1, m_drop_field),
    "shuffle": (1, m_shuffle),
    "leaf-garbage": (2, m_leaf_garbage),
}


def b_bit_flip(rng: random.Random, data: bytearray) -> str:
    flips = []
    for _ in range(rng.randint(1, 3)):
        if data:
            at = rng.randrange(len(data))
            bit = rng.randrange(8)
            data[at] ^= 1 << bit
            flips.append(f"{at}.{bit}")
    return f"bit-flip({','.join(flips)})"


def b_insert(rng: random.Random, data: bytearray) -> str:
    at = rng.randint(0, len(data))
    data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return f"insert-bytes({at})"


def b_delete(rng: random.Random, data: bytearray) -> str:
    if not data:
        return "delete-bytes(none)"
    at = rng.randrange(len(data))
    del data[at : at + rng.randint(1, 4)]
    return f"delete-bytes({at})"


def b_truncate(rng: random.Random, data: bytearray) -> str:
    at = rng.randint(0, max(0, len(data) - 1))
    del data[at:]
    return f"truncate({at})"


def b_dup_slice(rng: random.Random, data: bytearray) -> str:
    if not data:
        return "dup-slice(none)"
    start = rng.randrange(len(data))
    end = rng.randint(start + 1, len(data))
    data[end:end] = data[start:end]
    return f"dup-slice({start}:{end})"


BYTEWISE: dict[str, tuple[float, Callable[[random.Random, bytearray], str]]] = {
    "bit-flip": (4, b_bit_flip),
    "insert-bytes": (1, b_insert),
    "delete-bytes": (1, b_delete),
    "truncate": (2, b_truncate),
    "dup-slice": (1, b_dup_slice),
}


def pick(rng: random.Random, table: dict[str, tuple[float, Any]]) -> Any:
    names = list(table)
    return table[rng.choices(names, [table[n][0] for n in names])[0]][1]


# --------------------------------------------------------------------------- timeouts


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    for count in range(10):
        if pos >= end:
            return None
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value & U64, pos
        if count == 9:
            return None
    return None


@dataclass(frozen=True)
class Seg:
    """A parsed field: number, wire type, where its value is (``[start, end)``)."""

    num: int
    wt: int
    start: int
    end: int
    value: int = 0
    head: int = 0
    """For wire type 2: where the length prefix begins."""


def parse_fields(data: bytes, pos: int, end: int) -> list[Seg] | None:
    """The fields of ``data[pos:end]`` as a protobuf decoder (prost) reads them.

    None when the decoder would reject them: a bad varint, a key over 32 bits, field
    number 0, wire type 6 or 7, a length past the end, an unclosed or stray group
    end. It is at least as lenient as the decoder (groups are skipped, any field
    number that fits is accepted), so no field the decoder reads is missed.
    """
    segs: list[Seg] = []
    while pos < end:
        key = read_varint(data, pos, end)
        if key is None or key[0] > 0xFFFFFFFF:
            return None
        (key_value, pos) = key
        num, wt = key_value >> 3, key_value & 7
        if num == 0 or wt > 4:
            return None  # wire type 4 here is an end-group tag without its group
        if wt == 0:
            got = read_varint(data, pos, end)
            if got is None:
                return None
            segs.append(Seg(num, 0, pos, got[1], got[0]))
            pos = got[1]
        elif wt in (1, 5):
            size = 8 if wt == 1 else 4
            if pos + size > end:
                return None
            segs.append(Seg(num, wt, pos, pos + size))
            pos += size
        elif wt == 2:
            got = read_varint(data, pos, end)
            if got is None or got[1] + got[0] > end:
                return None
            segs.append(Seg(num, 2, got[1], got[1] + got[0], head=pos))
            pos = got[1] + got[0]
        else:  # a group: skip up to its end tag
            inner_end = _group_end(data, pos, end, num)
            if inner_end is None:
                return None
            pos = inner_end
    return segs


def _group_end(data: bytes, pos: int, end: int, num: int) -> int | None:
    """The position after the end-group tag that closes the group ``num`` at ``pos``."""
    while pos < end:
        key = read_varint(data, pos, end)
        if key is None or key[0] > 0xFFFFFFFF:
            return None
        key_value, pos = key
        inner, wt = key_value >> 3, key_value & 7
        if inner == 0 or wt > 5:
            return None
        if wt == 4:
            return pos if inner == num else None
        if wt == 0:
            got = read_varint(data, pos, end)
            if got is None:
                return None
            pos = got[1]
        elif wt in (1, 5):
            pos += 8 if wt == 1 else 4
            if pos > end:
                return None
        elif wt == 2:
            got = read_varint(data, pos, end)
            if got is None or got[1] + got[0] > end:
                return None
            pos = got[1] + got[0]
        else:
            nested = _group_end(data, pos, end, inner)
            if nested is None:
                return None
            pos = nested
    return None


def zero_timeouts(data: bytes) -> bytes:
    """``data`` with every nonzero ``timeout_ms`` of a reset/step/render arm set to 0.

    Only a message the decoder accepts can carry a deadline; one that does not parse
    (at the top level or inside an arm) is returned unchanged, because the server
    rejects it whole. The other bytes are kept as they are.
    """
    top = parse_fields(data, 0, len(data))
    if top is None:
        return data
    out = bytearray()
    cursor = 0
    for seg in top:
        timeout_num = TIMEOUT_FIELD.get(seg.num)
        if seg.wt != 2 or timeout_num is None:
            continue
        inner = parse_fields(data, seg.start, seg.end)
        if inner is None:
            return data
        hits = [s for s in inner if s.num == timeout_num and s.wt == 0 and s.value != 0]
        if not hits:
            continue
        body = bytearray()
        at = seg.start
        for hit in hits:
            body += data[at : hit.start] + b"\x00"
            at = hit.end
        body += data[at : seg.end]
        out += data[cursor : seg.head] + varint(len(body)) + body
        cursor = seg.end
    out += data[cursor:]
    return bytes(out)


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class FuzzMessage:
    seed: int
    index: int
    base: str
    mutations: tuple[str, ...]
    data: bytes
    timeout_zeroed: bool = False

    def describe(self) -> str:
        muts = ", ".join(self.mutations) or "none"
        zeroed = " (timeout_ms zeroed)" if self.timeout_zeroed else ""
        return f"from {self.base}; mutations: {muts}{zeroed}"


def one_message(rng: random.Random, shape: Shape, seed: int, index: int) -> FuzzMessage:
    roll = rng.random()
    if roll < 0.02:
        return FuzzMessage(seed, index, "empty", (), b"")
    if roll < 0.05:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 24)))
        return FuzzMessage(seed, index, "random-bytes", (), data)
    base = rng.choices(list(BASES), [w for w, _ in BASES.values()])[0]
    tree = join_request(rng, shape, base)
    mutations: list[str] = []
    count = rng.choices([0, 1, 2, 3], [2, 5, 3, 1])[0]
    for _ in range(count):
        mutations.append(pick(rng, STRUCTURAL)(rng, tree, shape))
    data = bytearray(encode(tree))
    if rng.random() < (0.5 if not mutations else 0.2):
        mutations.append(pick(rng, BYTEWISE)(rng, data))
    final = zero_timeouts(bytes(data))
    return FuzzMessage(seed, index, base, tuple(mutations), final, final != bytes(data))


def generate(seed: int, count: int, shape: Shape) -> list[FuzzMessage]:
    """``count`` messages, the same ones for the same arguments; a longer run starts
    with the messages of a shorter one (message #i does not depend on ``count``)."""
    rng = random.Random(f"rlmesh-fuzz:{shape.env}:{shape.num_envs}:{seed}")
    return [one_message(rng, shape, seed, i) for i in range(count)]


# --------------------------------------------------------------------------- outcomes

REPLY_BOUND = 5.0
"""Seconds a server may take to answer one fuzz message (and the probe after it)."""

JOIN_RETRY_SECONDS = 5.0
"""How long a new Join keeps being retried while the previous one still holds the slot."""

PROBE_ID = "rlmesh-fuzz-probe"
PROBE = bytes(wire.configure(request_id=PROBE_ID))
OPEN = ("open",)
BUSY_MESSAGE = "environment already has an active Join session"


@dataclass(frozen=True)
class Outcome:
    """What one message got: its replies (normally one), then the state of the stream.

    ``replies`` holds a tuple per reply: ``(arm,)``, ``("step", env_indices echo)`` or
    ``("error", code, is_recoverable, message)``. ``after`` is ``("open",)`` when the
    stream still answered the probe after the message, ``("ended", grpc-status,
    grpc-message[, how])`` when the server ended it, ``("no-reply-within", seconds)``.
    """

    replies: tuple[tuple[Any, ...], ...]
    after: tuple[Any, ...]

    @property
    def stream_open(self) -> bool:
        return self.after == OPEN

    def __str__(self) -> str:
        replies = ", ".join(map(repr, self.replies)) or "no reply"
        return f"{replies}; then {self.after!r}"


def classify(raw: bytes) -> tuple[Any, ...]:
    try:
        reply = wire.env_v1.JoinResponse.parse(raw)
    except Exception as exc:  # a reply a protobuf decoder cannot read is an outcome too
        return ("undecodable-reply", raw.hex(), type(exc).__name__)
    kind, value = betterproto2.which_one_of(reply, "kind")
    if kind == "error":
        return ("error", int(value.code), bool(value.is_recoverable), value.message)
    if kind == "step":
        return ("step", tuple(value.env_indices))
    return (kind or "<no arm>",)


def ended(end: wire.CallEnd | None) -> tuple[Any, ...]:
    if end is None:
        return ("ended", None, None, "unknown")
    if end.status is None:
        return ("ended", None, None, end.detail)
    return ("ended", end.status, end.message)


class HarnessError(RuntimeError):
    """The harness could not get a server into the state a message needs."""


@dataclass
class Side:
    """One server under test: a connection, and the Join currently open on it."""

    name: str
    address: str
    shape: Shape
    client: wire.WireClient | None = None
    join: wire.JoinStream | None = None
    reopened: int = 0
    busy_retries: int = 0

    async def _connect(self) -> wire.WireClient:
        """A new connection for every session.

        The reference answers a client that keeps sending DATA on streams it already
        ended (here: the probe after a message that ended the stream) with GOAWAY
        ENHANCE_YOUR_CALM after a few hundred such streams on one connection; with one
        session per connection that never builds up.
        """
        if self.client is not None:
            await self.client.aclose()
        self.client = wire.WireClient(self.address, timeout=REPLY_BOUND)
        await self.client.__aenter__()
        return self.client

    async def open_session(self) -> None:
        """A fresh Join started by a whole reset with fixed seeds (the same state on both)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOIN_RETRY_SECONDS
        delay = 0.005
        ritual = bytes(wire.reset(seeds=self.shape.ritual_seeds(), request_id="fuzz-ritual"))
        client = await self._connect()
        while True:
            if client.closed is not None:
                client = await self._connect()
            join = client.join()
            await join.__aenter__()
            await join.send(ritual)
            try:
                raw = await join.recv_raw(REPLY_BOUND)
            except TimeoutError as exc:
                await join.cancel()
                raise HarnessError(f"{self.name}: no reply to the session's first reset") from exc
            if raw is not None:
                got = classify(raw)
                if got != ("reset",):
                    raise HarnessError(f"{self.name}: the session's first reset got {got}")
                self.join = join
                self.reopened += 1
                return
            end = join.end
            busy = end is not None and end.status == 9 and BUSY_MESSAGE in (end.message or "")
            if not busy or loop.time() + delay > deadline:
                raise HarnessError(f"{self.name}: a new Join was refused: {end}")
            self.busy_retries += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def end_session(self) -> None:
        """End the open Join from the server's side (Close), so its slot is free at once."""
        join, self.join = self.join, None
        if join is None or join.end is not None:
            return
        try:
            if await join.send(wire.close(request_id="fuzz-close")):
                while await join.recv_raw(REPLY_BOUND) is not None:
                    pass
        except (TimeoutError, ConnectionError, OSError):
            await join.cancel()
        if join.end is None or join.end.status is None:
            await join.cancel()

    async def outcome(self, data: bytes) -> Outcome:
        """Send ``data`` then the probe on the open Join; classify what came back."""
        if self.join is None:
            await self.open_session()
        join = self.join
        assert join is not None
        replies: list[tuple[Any, ...]] = []
        try:
            if await join.send(data):
                await join.send(PROBE)
            while True:
                raw = await join.recv_raw(REPLY_BOUND)
                if raw is None:
                    after = ended(join.end)
                    break
                got = classify(raw)
                if got == ("configure",) and _request_id(raw) == PROBE_ID:
                    after = OPEN
                    break
                replies.append(got)
        except TimeoutError:
            after = ("no-reply-within", REPLY_BOUND)
            await join.cancel()
        except (ConnectionError, OSError) as exc:
            after = ("connection-lost", type(exc).__name__)
        if after != OPEN:
            self.join = None  # the next message opens a new session on a new connection
        return Outcome(tuple(replies), after)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.end_session()
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def _request_id(raw: bytes) -> str:
    return wire.env_v1.JoinResponse.parse(raw).request_id


@dataclass(frozen=True)
class Record:
    message: FuzzMessage
    reference: Outcome
    peer: Outcome


async def differential(
    messages: Sequence[FuzzMessage], reference: str, peer: str, shape: Shape
) -> tuple[list[Record], dict[str, Side], str | None]:
    """Each message on both servers at once; both sessions restart together whenever one
    of them ended, so the two always run the same sequence of requests on equal state.

    Returns the records, the two sides (for their counters) and, if the harness could
    not go on (a server refused new sessions), why: the records up to there are kept.
    """
    sides = {"reference": Side("reference", reference, shape), "peer": Side("peer", peer, shape)}
    ref_side, peer_side = sides["reference"], sides["peer"]
    records: list[Record] = []
    stopped: str | None = None
    try:
        for message in messages:
            try:
                on_ref, on_peer = await asyncio.gather(
                    ref_side.outcome(message.data), peer_side.outcome(message.data)
                )
            except HarnessError as exc:
                stopped = f"stopped before seed {message.seed} #{message.index}: {exc}"
                break
            records.append(Record(message, on_ref, on_peer))
            if not (on_ref.stream_open and on_peer.stream_open):
                await asyncio.gather(ref_side.end_session(), peer_side.end_session())
    finally:
        await asyncio.gather(ref_side.aclose(), peer_side.aclose())
    return records, sides, stopped


# --------------------------------------------------------------------------- deliberate differences


@dataclass(frozen=True)
class Deliberate:
    """A documented difference: outcomes that may differ when ``applies`` holds."""

    reason: str
    """Why, with the docs/decisions.md entry that records the decision."""
    applies: Callable[[FuzzMessage, Outcome, Outcome], bool]


DELIBERATE: tuple[Deliberate, ...] = ()
"""Empty: no difference found so far is nondeterministic on the reference itself."""


def deliberate(record: Record) -> Deliberate | None:
    for rule in DELIBERATE:
        if rule.applies(record.message, record.reference, record.peer):
            return rule
    return None


def report(records: Sequence[Record], peer_name: str) -> tuple[list[str], int]:
    """Every mismatch as text (seed, index, bytes, both outcomes), and the count excused."""
    lines: list[str] = []
    excused = 0
    for record in records:
        if record.reference == record.peer:
            continue
        if deliberate(record) is not None:
            excused += 1
            continue
        m = record.message
        lines.append(
            f"seed {m.seed} #{m.index} [{m.describe()}]\n"
            f"    bytes:     {m.data.hex() or '(empty)'}\n"
            f"    reference: {record.reference}\n"
            f"    {peer_name + ':':<10} {record.peer}"
        )
    return lines, excused
