"""kvobs's locks, events and threads renewed in a forked child (issue 43, item 4).

A fork copies only the thread that forks. A lock another thread held at that moment stays held in the
child, by a thread that is not there, and the child's first ``acquire`` waits forever; CPython's own
``logging`` and ``concurrent.futures`` renew theirs with ``os.register_at_fork`` for that reason. So
does kvobs: every object or module of kvobs's that owns a lock, condition or event :func:`track`\\ s
itself here (weakly: the registry keeps nothing alive), and in the child every such attribute of it,
and of the parts it names in ``_fork_parts``, is replaced by a fresh, unheld one (an event stays set
if it was); then its ``_forked()`` hook decides about its threads and pending work (docs/design.md,
"Fork"). Nothing here runs on vLLM's thread: the cost is one registration per object built.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("kvobs")

LOCK = type(threading.Lock())
RLOCK = type(threading.RLock())
OWNED_TYPES: tuple[type, ...] = (LOCK, RLOCK, threading.Condition, threading.Event)
"""What a fork leaves held (an event and a condition hold a lock of their own)."""

_tracked: weakref.WeakSet[Any] = weakref.WeakSet()


def track(owner: Any) -> None:
    """Renew ``owner``'s locks, conditions and events in a forked child, then call its ``_forked()``
    (if it has one); ``owner`` may be a module (its globals are scanned). Held weakly."""
    _tracked.add(owner)


def _attribute_names(holder: Any) -> list[str]:
    """The instance attributes of ``holder``: its ``__dict__``, or a mypyc class's ``__mypyc_attrs__``
    (the hot path's classes, compiled, have no ``__dict__``; reading attributes, never properties)."""
    if hasattr(holder, "__dict__"):
        return list(vars(holder))
    names: list[str] = []
    for cls in type(holder).__mro__:
        names.extend(getattr(cls, "__mypyc_attrs__", ()))
    return names


def _holders(owner: Any) -> Iterator[tuple[str, Any]]:
    label = getattr(owner, "__name__", None) if isinstance(owner, type(os)) else type(owner).__qualname__
    yield str(label), owner
    for part in getattr(owner, "_fork_parts", ()):
        value = getattr(owner, part, None)
        if value is not None:
            yield f"{label}.{part}", value


def owned() -> list[tuple[str, Any, str, Any]]:
    """Every lock, condition and event of every live tracked owner now: (label, holder, attribute, value).
    The fork tests enumerate these, so a lock added to a tracked class is covered without naming it."""
    return [item for owner in list(_tracked) for item in _owned_by(owner)]


def _owned_by(owner: Any) -> list[tuple[str, Any, str, Any]]:
    out = []
    for label, holder in _holders(owner):
        for name in _attribute_names(holder):
            value = getattr(holder, name, None)
            if isinstance(value, OWNED_TYPES):
                out.append((label, holder, name, value))
    return out


def renewed(value: Any) -> Any:
    """A fresh, unheld copy of a lock, condition or event (an event set stays set)."""
    if isinstance(value, threading.Event):
        fresh = threading.Event()
        if value.is_set():  # reads the flag without its lock
            fresh.set()
        return fresh
    if isinstance(value, threading.Condition):
        return threading.Condition(threading.RLock() if isinstance(value._lock, RLOCK) else threading.Lock())  # type: ignore[attr-defined]
    return threading.RLock() if isinstance(value, RLOCK) else threading.Lock()


def _in_child() -> None:
    """After a fork, in the child: every tracked owner's locks anew, then its ``_forked()``. One owner's
    fault is logged and the others go on (the child must not die of kvobs)."""
    for owner in list(_tracked):
        try:
            for _, holder, name, value in _owned_by(owner):
                setattr(holder, name, renewed(value))
            hook = getattr(owner, "_forked", None)
            if hook is not None:
                hook()
        except Exception as exc:  # noqa: BLE001 -- never raised into the child's fork()
            logger.error("kvobs: renewing %r after fork failed: %r", owner, exc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
