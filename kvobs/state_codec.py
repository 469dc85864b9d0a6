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
import ctypes
import enum
import itertools
import operator
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


class Frozen:
    """An object of a table class as :func:`freeze` found it: its class and its attributes then (their values
    frozen in turn). Stands in for the live object until :func:`encode_frozen` writes it."""

    __slots__ = ("attrs", "cls")

    def __init__(self, cls: type, attrs: dict[str, Any]) -> None:
        self.cls = cls
        self.attrs = attrs


class _Copy:
    """A container as :func:`freeze` found it: its node kind, its items (a mapping's keys, its values apart in
    ``values``) and a deque's ``maxlen``. Never mutated: the live container can change meanwhile."""

    __slots__ = ("items", "kind", "maxlen", "values")

    def __init__(self, kind: str, items: list[Any], values: list[Any] | None = None, maxlen: int | None = None):
        self.kind = kind
        self.items = items
        self.values = values
        self.maxlen = maxlen


_PLAIN_SET = frozenset(_PLAIN)
_STRUCTS: dict[type, bool] = {}


def _plain_struct(cls: type) -> bool:
    """Whether ``cls`` is a ctypes structure of scalar fields only (no pointer): its bytes are all its state,
    so ``from_buffer_copy`` is a faithful copy, made in C (vLLM's ``ChunkStatus``, one per resident chunk)."""
    found = _STRUCTS.get(cls)
    if found is None:
        fields: Any = getattr(cls, "_fields_", None) if issubclass(cls, ctypes.Structure) else None
        found = _STRUCTS[cls] = bool(fields) and all(
            isinstance(f, tuple) and len(f) >= 2 and isinstance(f[1], type) and issubclass(f[1], ctypes._SimpleCData)
            and getattr(f[1], "_type_", "z") not in "zZPO" for f in fields)
    return found


def _settled(values: list[Any], depth: int, types: set[type] | None = None) -> bool:
    """Whether every value is plain, or a plain tuple of settled values: nothing in them can change, so a
    container of them is frozen by copying it (in C, however many; ``types``: theirs, when known)."""
    if types is None:
        types = set(map(type, values))
    if types <= _PLAIN_SET:
        return True
    if types - _PLAIN_SET != {tuple} or depth > MAX_DEPTH:
        return False
    tuples = values if len(types) == 1 else itertools.compress(values, map(operator.is_, map(type, values),
                                                                           itertools.repeat(tuple)))
    return _settled(list(itertools.chain.from_iterable(tuples)), depth + 1)


def freeze(value: Any, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> Any:
    """``value`` as it is now, cheaply, for :func:`encode_frozen` to write later: containers copied (in C where
    their items are plain), table objects' attributes read (``attributes``), ctypes chunk statuses copied. What
    the live objects do afterwards changes nothing in it. The flight recorder freezes the manager on vLLM's
    thread and encodes on kvobs's (kvobs.vllm.compat ``freeze_state``): 4 ms instead of 31 at 4,096 chunks
    (docs/performance.md). Classes outside ``table`` are kept as they are, for :func:`encode_frozen` to refuse."""
    return _Freezer(table, attributes).one(value, 0)


def encode(value: Any, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> bytes:
    """``value`` as bytes; ``attributes(obj)`` gives an ``object`` entry's attributes (vLLM's live objects
    are read without their ``__dict__``: kvobs.vllm.compat). TypeError for a value outside the table."""
    return encode_frozen(freeze(value, table, attributes), table, attributes)


def encode_frozen(value: Any, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> bytes:
    """What :func:`freeze` made of a value, as bytes (the same bytes :func:`encode` of the value then gives).
    TypeError for a value outside the table."""
    writer = _Writer(table, attributes)
    root = writer.tree(value, 0)
    return msgspec.msgpack.encode([FORMAT, list(writer.blobs), list(writer.names), root])


_TAGS: list[Any] = [None, {}]
"""The last table :func:`_tags` was asked for and its classes' tags (one table a process: kvobs.vllm.compat's)."""


def _tags(table: Table) -> dict[type, str]:
    """Each table class's tag, made once per table (a snapshot's argument is written every scheduler step)."""
    last, tags = _TAGS
    if last is not table:
        tags = {entry.cls: tag for tag, entry in table.items()}
        _TAGS[:] = [table, tags]
    return tags


class _Freezer:
    """One :func:`freeze`. A class, not nested functions: a recursive closure is a reference cycle, garbage
    only the collector frees, made on every call (the recorder writes one argument a scheduler step)."""

    def __init__(self, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> None:
        self.table = table
        self.attributes = attributes
        self.tags = _tags(table)
        self.memo: dict[int, Any] = {}  # id of a live object -> its stand-in (one object referenced twice stays one)
        self.keep: list[Any] = []  # what memo's ids stand for, alive until the end

    def items(self, values: list[Any], depth: int) -> list[Any]:
        types = set(map(type, values))
        if _settled(values, depth, types):
            return values
        if len(types) == 1:
            cls: Any = next(iter(types))
            tag = self.tags.get(cls)
            entry = None if tag is None else self.table[tag]
            if entry is not None and entry.kind == "object" and not entry.singletons and _plain_struct(cls):
                ids = list(map(id, values))
                if len(set(ids)) == len(ids) and self.memo.keys().isdisjoint(ids):
                    copies = list(map(cls.from_buffer_copy, values))
                    self.memo.update(zip(ids, copies, strict=True))
                    self.keep.append(values)
                    return copies
        return [self.one(v, depth) for v in values]

    def one(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH}")
        cls = type(obj)
        if cls in _PLAIN:
            return obj
        if cls is tuple:
            return obj if _settled([obj], depth) else _Copy("t", self.items(list(obj), depth + 1))
        if cls is list:
            return _Copy("l", self.items(list(obj), depth + 1))
        if cls is set or cls is frozenset:
            return _Copy("s" if cls is set else "f", self.items(list(obj), depth + 1))
        if cls is dict or cls is collections.OrderedDict:
            return _Copy("d" if cls is dict else "D", self.items(list(obj), depth + 1),
                         self.items(list(obj.values()), depth + 1))
        if cls is collections.deque:
            return _Copy("q", self.items(list(obj), depth + 1), maxlen=obj.maxlen)
        tag = self.tags.get(cls)
        if tag is None or isinstance(obj, type):
            return obj  # a class, or one encode_frozen refuses
        entry = self.table[tag]
        if entry.kind == "tuple":
            return obj if _settled(list(obj), depth + 1) else tuple.__new__(cls, self.items(list(obj), depth + 1))
        if entry.kind != "object" or any(getattr(cls, s) is obj for s in entry.singletons):
            return obj  # an enum member, a class's own instance: constants
        found = self.memo.get(id(obj))
        if found is not None:
            return found
        self.keep.append(obj)
        if _plain_struct(cls):
            found = self.memo[id(obj)] = cls.from_buffer_copy(obj)
            return found
        frozen = self.memo[id(obj)] = Frozen(cls, {})  # before its attributes: they may refer back to it
        attrs = self.attributes(obj)
        frozen.attrs = dict(zip(attrs, self.items(list(attrs.values()), depth + 1), strict=True))
        return frozen


class _Writer:
    """One :func:`encode_frozen` (a class for the reason :class:`_Freezer` is)."""

    def __init__(self, table: Table, attributes: Callable[[Any], Mapping[str, Any]]) -> None:
        self.table = table
        self.attributes = attributes
        self.tags = _tags(table)
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # what memo's ids stand for, alive until the end
        self.blobs: dict[bytes, int] = {}
        self.names: dict[str, int] = {}

    def name(self, text: str) -> int:
        names = self.names
        found = names.get(text)
        if found is None:
            found = names[text] = len(names)
        return found

    def each(self, values: Iterable[Any], depth: int) -> list[Any]:
        """Nodes of ``values``; plain values and bytes written here, not by a call each (a snapshot holds
        a few hundred thousand of them)."""
        out: list[Any] = []
        blobs = self.blobs
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
                out.append(self.tree(v, depth))
        return out

    def tree(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH}")
        cls = type(obj)
        if cls in _PLAIN:
            return self.each((obj,), depth)[0]
        if cls is _Copy:
            kind = obj.kind
            if kind == "d" or kind == "D":
                pairs = itertools.chain.from_iterable(zip(obj.items, obj.values, strict=True))
                return [kind, self.each(pairs, depth + 1)]
            if kind == "q":
                return ["q", self.each(obj.items, depth + 1), obj.maxlen]
            return [kind, self.each(obj.items, depth + 1)]
        if cls is tuple:
            return ["t", self.each(obj, depth + 1)]
        if isinstance(obj, type):
            tag = self.tags.get(obj)
            if tag is None:
                raise TypeError(f"class {obj.__module__}.{obj.__qualname__} is not in the snapshot table")
            return ["c", self.name(tag)]
        if cls is Frozen:
            cls = obj.cls
        elif cls in (list, set, frozenset, dict, collections.OrderedDict, collections.deque):
            raise TypeError(f"a {cls.__name__} that freeze() did not copy")
        tag = self.tags.get(cls)
        if tag is None:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not in the snapshot table")
        entry = self.table[tag]
        if entry.kind == "enum":
            return ["e", self.name(tag), obj.name]
        for singleton in entry.singletons:
            if getattr(cls, singleton) is obj:
                return ["a", self.name(tag), singleton]
        if entry.kind == "tuple":
            return ["n", self.name(tag), self.each(obj, depth + 1)]
        if entry.kind != "object":
            raise TypeError(f"{tag} is not written as an object")
        seen = self.memo.get(id(obj))
        if seen is not None:
            return ["r", seen]
        self.memo[id(obj)] = ident = len(self.memo)
        self.keep.append(obj)
        attrs = obj.attrs if type(obj) is Frozen else self.attributes(obj)
        values = self.each(attrs.values(), depth + 1)
        flat: list[Any] = []
        for attribute, v in zip(attrs, values, strict=True):
            flat.append(self.name(attribute))
            flat.append(v)
        return ["o", ident, self.name(tag), flat]


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
