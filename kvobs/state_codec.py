"""vLLM's offload objects written as plain values and rebuilt from a closed table of classes: no pickle.

A replay bundle carries the manager's state and some call arguments (kvobs/bundles.py, kvobs/flight.py).
They travel from a production pod to a laptop, so reading one must never run code (SECURITY.md). A blob is
MessagePack (msgspec) of ``[FORMAT, bytes_table, names, tree]``: every bytes value once in ``bytes_table``
(a key sits in five of vLLM's structures), every class tag and attribute name once in ``names``, and a
tree of plain data: ``None``, bools, ints, floats and strings as themselves; everything else a list whose
first item says what it is:

``["b", i]`` bytes_table[i], ``["l", items]`` list, ``["t", items]`` tuple, ``["s", items]`` set,
``["f", items]`` frozenset, ``["d", [k, v, ...]]`` dict, ``["D", [k, v, ...]]`` OrderedDict,
``["q", items, maxlen]`` deque, ``["o", id, tag, [name, value, ...]]`` an object of table class
``names[tag]`` (attribute ``names[name]`` by attribute), ``["n", tag, items]`` a named tuple,
``["e", tag, member]`` an enum member, ``["a", tag, name]`` one of a class's own instances
(``TierFilter.ALL``), ``["c", tag]`` a class of the table, ``["r", id]`` object ``id`` again (one object
referenced twice stays one; cycles close).

The reader resolves nothing by name: a tag selects an entry of the :class:`Entry` table its caller
built from the classes it imported itself (kvobs.vllm.compat.snapshot_table), an attribute is set only
where the entry lists it, and whatever else a blob holds is refused with :class:`StateError`. This module
imports neither kvobs nor vLLM: ``kvobs replay --emit-test`` copies it into the tests it writes
(kvobs/vllm/emit.py), so a test needs vLLM alone.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

MAX_DEPTH = 64
"""Nesting a blob may hold (the CPU manager's state is under 10 deep): deeper is refused, not recursed."""


class StateError(ValueError):
    """A blob this module cannot rebuild (the message names what and where)."""


@dataclass(frozen=True)
class Entry:
    """One class a blob may hold: ``kind`` says how it is written (``object``: attribute by attribute,
    only ``names``; ``tuple``: a named tuple; ``enum``: a member by name; ``class``: the class itself only)
    and ``singletons`` the class attributes that are instances of it, written by name."""

    cls: type
    kind: str
    names: frozenset[str] = frozenset()
    singletons: frozenset[str] = frozenset()


Table = Mapping[str, Entry]
_LEAVES = (type(None), bool, int, float, str)
_PLAIN = (*_LEAVES, bytes)


FORMAT = 1


def encode(value: Any, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> bytes:
    """``value`` as bytes; ``attributes(obj)`` gives an ``object`` entry's attributes (vLLM's live objects
    are read without their ``__dict__``: kvobs.vllm.compat). TypeError for a value outside the table."""
    tags = {entry.cls: tag for tag, entry in table.items()}
    memo: dict[int, int] = {}
    keep: list[Any] = []  # what memo's ids stand for, alive until the end
    blobs: dict[bytes, int] = {}
    names: dict[str, int] = {}

    def name(text: str) -> int:
        found = names.get(text)
        if found is None:
            found = names[text] = len(names)
        return found

    def each(values: Iterable[Any], depth: int) -> list[Any]:
        """Nodes of ``values``; plain values and bytes written here, not by a call each (a snapshot holds
        a few hundred thousand of them)."""
        out: list[Any] = []
        for v in values:
            cls = type(v)
            if cls in _LEAVES:
                out.append(v)
            elif cls is bytes:
                found = blobs.get(v)
                if found is None:
                    found = blobs[v] = len(blobs)
                out.append(["b", found])
            else:
                out.append(tree(v, depth))
        return out

    def tree(obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH}")
        cls = type(obj)
        if cls in _PLAIN:
            return each((obj,), depth)[0]
        if cls is list:
            return ["l", each(obj, depth + 1)]
        if cls is tuple:
            return ["t", each(obj, depth + 1)]
        if cls is set or cls is frozenset:
            return ["s" if cls is set else "f", each(obj, depth + 1)]
        if cls is dict or cls is collections.OrderedDict:
            return ["d" if cls is dict else "D", each(itertools.chain.from_iterable(obj.items()), depth + 1)]
        if cls is collections.deque:
            return ["q", each(obj, depth + 1), obj.maxlen]
        if isinstance(obj, type):
            tag = tags.get(obj)
            if tag is None:
                raise TypeError(f"class {obj.__module__}.{obj.__qualname__} is not in the snapshot table")
            return ["c", name(tag)]
        tag = tags.get(cls)
        if tag is None:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not in the snapshot table")
        entry = table[tag]
        if entry.kind == "enum":
            return ["e", name(tag), obj.name]
        for singleton in entry.singletons:
            if getattr(cls, singleton) is obj:
                return ["a", name(tag), singleton]
        if entry.kind == "tuple":
            return ["n", name(tag), each(obj, depth + 1)]
        if entry.kind != "object":
            raise TypeError(f"{tag} is not written as an object")
        seen = memo.get(id(obj))
        if seen is not None:
            return ["r", seen]
        memo[id(obj)] = ident = len(memo)
        keep.append(obj)
        attrs = attributes(obj)
        values = each(attrs.values(), depth + 1)
        flat: list[Any] = []
        for attribute, v in zip(attrs, values, strict=True):
            flat.append(name(attribute))
            flat.append(v)
        return ["o", ident, name(tag), flat]

    root = tree(value, 0)
    return msgspec.msgpack.encode([FORMAT, list(blobs), list(names), root])


def decode(blob: bytes, table: Table) -> Any:
    """The value ``blob`` holds, rebuilt; StateError naming what is wrong with it, whatever its bytes."""
    try:
        raw = msgspec.msgpack.decode(blob)
    except (msgspec.DecodeError, RecursionError) as exc:  # msgspec bounds nesting with RecursionError
        raise StateError(f"not a state blob: {exc}") from None
    if not (type(raw) is list and len(raw) == 4 and raw[0] == FORMAT and type(raw[1]) is list
            and type(raw[2]) is list and all(type(b) is bytes for b in raw[1])
            and all(type(n) is str for n in raw[2])):
        raise StateError(f"not a state blob of format {FORMAT}")
    context = _Context(table, raw[1], raw[2])
    try:
        return _build(raw[3], context, 0)
    except StateError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as exc:
        raise StateError(f"the state does not rebuild: {type(exc).__name__}: {exc}") from None


@dataclass
class _Context:
    table: Table
    blobs: list[bytes]
    names: list[str]
    objects: dict[int, Any] = field(default_factory=dict)

    def name(self, index: Any) -> str:
        if type(index) is not int or not 0 <= index < len(self.names):
            raise StateError(f"name {index!r} is not in the blob's names")
        return self.names[index]

    def entry(self, index: Any, kind: str | None = None) -> Entry:
        tag = self.name(index)
        entry = self.table.get(tag)
        if entry is None:
            raise StateError(f"class tag {tag!r} is not in the snapshot table")
        if kind is not None and entry.kind != kind:
            raise StateError(f"{tag} is a {entry.kind}, not a {kind}")
        return entry


def _items(node: list[Any], size: int) -> list[Any]:
    if len(node) != size:
        raise StateError(f"a {node[0]!r} node has {len(node)} items, not {size}")
    return node


def _list(value: Any, what: str) -> list[Any]:
    if type(value) is not list:
        raise StateError(f"{what} is not a list")
    return value


def _build(node: Any, context: _Context, depth: int) -> Any:
    if type(node) in _PLAIN and type(node) is not bytes:
        return node
    if depth > MAX_DEPTH:
        raise StateError(f"state nested deeper than {MAX_DEPTH}")
    if type(node) is not list or not node or not isinstance(node[0], str):
        raise StateError(f"a node of type {type(node).__name__} is not a value")
    kind, depth = node[0], depth + 1

    def each(values: Any) -> list[Any]:
        return [_build(v, context, depth) for v in _list(values, f"a {kind!r} node's items")]

    if kind == "b":
        index = _items(node, 2)[1]
        if type(index) is not int or not 0 <= index < len(context.blobs):
            raise StateError(f"bytes {index!r} are not in the blob's table")
        return context.blobs[index]
    if kind in ("l", "t", "s", "f"):
        items = each(_items(node, 2)[1])
        return items if kind == "l" else tuple(items) if kind == "t" else set(items) if kind == "s" \
            else frozenset(items)
    if kind in ("d", "D"):
        flat = each(_items(node, 2)[1])
        if len(flat) % 2:
            raise StateError("a mapping holds an odd number of items")
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return dict(pairs) if kind == "d" else collections.OrderedDict(pairs)
    if kind == "q":
        _, values, maxlen = _items(node, 3)
        if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
            raise StateError(f"a deque's maxlen {maxlen!r} is not a count")
        return collections.deque(each(values), maxlen)
    if kind == "r":
        ident = _items(node, 2)[1]
        if type(ident) is not int or ident not in context.objects:
            raise StateError(f"a reference to object {ident!r}, not written before it")
        return context.objects[ident]
    if kind == "c":
        return context.entry(_items(node, 2)[1]).cls
    if kind == "e":
        _, tag, member = _items(node, 3)
        cls = context.entry(tag, "enum").cls
        if not isinstance(member, str) or not issubclass(cls, enum.Enum) or member not in cls.__members__:
            raise StateError(f"{cls.__qualname__} has no member {member!r}")
        return cls.__members__[member]
    if kind == "a":
        _, tag, singleton = _items(node, 3)
        entry = context.entry(tag)
        if singleton not in entry.singletons:
            raise StateError(f"{entry.cls.__qualname__} has no instance named {singleton!r}")
        return getattr(entry.cls, singleton)
    if kind == "n":
        _, tag, values = _items(node, 3)
        return context.entry(tag, "tuple").cls(*each(values))
    if kind == "o":
        _, ident, tag, flat = _items(node, 4)
        entry = context.entry(tag, "object")
        if type(ident) is not int or ident in context.objects:
            raise StateError(f"object id {ident!r} is not new")
        flat = _list(flat, f"{entry.cls.__qualname__}'s attributes")
        names = [context.name(i) for i in flat[::2]]
        if len(flat) % 2 or set(names) != entry.names or len(names) != len(entry.names):
            raise StateError(f"{entry.cls.__qualname__}'s attributes {sorted(names)} are not the ones its class "
                             f"sets ({sorted(entry.names)})")
        obj: Any = entry.cls.__new__(entry.cls)  # type: ignore[call-overload]  # every table class makes one so
        context.objects[ident] = obj  # before its attributes: they may refer back to it
        for attribute, value in zip(names, flat[1::2], strict=True):
            object.__setattr__(obj, attribute, _build(value, context, depth))
        return obj
    raise StateError(f"unknown node kind {kind!r}")
