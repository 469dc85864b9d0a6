"""The hot path as kvobs runs it: the modules kvobs/hot_path_modules.py lists, compiled by mypyc when built.

One source, two forms. ``pip install`` compiles those modules together with mypyc where a C
compiler is present (setup.py); the compiled modules then shadow the sources. Where they were
not built, or ``KVOBS_PURE_PYTHON=1`` asks for it, the same sources run as plain Python, all of
them (never a mix of compiled and source), with the same behaviour at a higher cost on the
scheduler thread (docs/performance.md has both forms' measured overhead; a figure here would go
stale). ``HOT_PATH`` says which form runs (``kvobs_build_info`` exports it); the fallback says so
once in the log. The rest of kvobs takes the hot path's names from here.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from kvobs.capture_ring import python_asked
from kvobs.hot_path_modules import HOT_PATH_MODULES

logger = logging.getLogger("kvobs")

_MODULE = "kvobs.hot_path"


def _source_module() -> ModuleType:
    """Every hot-path module executed as Python, those it imports first, even where compiled forms sit
    beside them (each imports the others from ``sys.modules``, so the sources only); ``kvobs.hot_path``."""
    module = None
    for name in HOT_PATH_MODULES:
        spec = importlib.util.spec_from_file_location(f"kvobs.{name}", Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"kvobs.{name}"] = module
        spec.loader.exec_module(module)
    assert module is not None and module.__name__ == _MODULE
    return module


def is_compiled(module: ModuleType) -> bool:
    return str(getattr(module, "__file__", "")).endswith(tuple(EXTENSION_SUFFIXES))


def _load() -> tuple[ModuleType, str]:
    if python_asked():
        return _source_module(), "python"
    try:
        # One by one, those imported first: each compiled module then loads through its own file, whose path
        # is its ``__file__`` (imported first by another compiled one, mypyc 2.4 derives a path that is not).
        modules = [importlib.import_module(f"kvobs.{name}") for name in HOT_PATH_MODULES]
    except ImportError as exc:  # a compiled form that does not load here (another Python, a broken build)
        logger.warning("kvobs: the compiled hot path does not load (%r); running it as Python", exc)
        return _source_module(), "python"
    module = modules[-1]
    compiled = [is_compiled(each) for each in modules]
    if all(compiled):
        return module, "compiled"
    logger.warning(
        "kvobs: the compiled hot path is not built (no C compiler when kvobs was installed); running it as "
        "Python: same results, more scheduler CPU (README, 'The compiled hot path'; docs/performance.md)"
    )
    return (_source_module() if any(compiled) else module), "python"  # part of it compiled: all as source


_impl, HOT_PATH = _load()
"""``"compiled"`` (mypyc) or ``"python"``."""

_PUBLIC = {
    "hot_captures": ("CALL", "FINISH", "LOAD", "LOOKUP", "SNAPSHOT", "FlightSegment"),
    "hot_promises": ("Breach", "NearMiss", "Promises", "RecentRemovals", "RemovalRun", "Verdict"),
    "hot_taps": ("ClearTap", "DeferredReleaseTap", "EvictTap", "InsertTap", "PolicyTap", "RemoveTap", "WriteTap"),
    "hot_path": ("Recorder",),
}

if TYPE_CHECKING:  # the same names, typed (re-exported)
    from kvobs.hot_captures import (
        CALL as CALL,
        FINISH as FINISH,
        LOAD as LOAD,
        LOOKUP as LOOKUP,
        SNAPSHOT as SNAPSHOT,
        FlightSegment as FlightSegment,
    )
    from kvobs.hot_path import Recorder as Recorder
    from kvobs.hot_promises import (
        Breach as Breach,
        NearMiss as NearMiss,
        Promises as Promises,
        RecentRemovals as RecentRemovals,
        RemovalRun as RemovalRun,
        Verdict as Verdict,
    )
    from kvobs.hot_taps import (
        ClearTap as ClearTap,
        DeferredReleaseTap as DeferredReleaseTap,
        EvictTap as EvictTap,
        InsertTap as InsertTap,
        PolicyTap as PolicyTap,
        RemoveTap as RemoveTap,
        WriteTap as WriteTap,
    )
else:
    globals().update({name: getattr(sys.modules[f"kvobs.{module}"], name)
                      for module, names in _PUBLIC.items() for name in names})

__all__ = ["HOT_PATH", "is_compiled", *(name for names in _PUBLIC.values() for name in names)]
