"""The hot path as kvobs runs it: ``kvobs/hot_path.py``, compiled by mypyc when it was built.

One source, two forms. ``pip install`` compiles ``kvobs/hot_path.py`` with mypyc where a C
compiler is present (setup.py); the compiled module then shadows the source. Where it was
not built, or ``KVOBS_PURE_PYTHON=1`` asks for it, the same source runs as plain Python,
with the same behaviour at a higher cost on the scheduler thread (docs/performance.md has both
forms' measured overhead; a figure here would go stale). ``HOT_PATH`` says which form runs
(``kvobs_build_info`` exports it); the fallback says so once in the log.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

logger = logging.getLogger("kvobs")

_MODULE = "kvobs.hot_path"


def _forced_python() -> bool:
    return os.environ.get("KVOBS_PURE_PYTHON", "") not in ("", "0")


def _source_module() -> ModuleType:
    """``kvobs/hot_path.py`` executed as Python, even where a compiled form sits beside it."""
    spec = importlib.util.spec_from_file_location(_MODULE, Path(__file__).with_name("hot_path.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    spec.loader.exec_module(module)
    return module


def is_compiled(module: ModuleType) -> bool:
    return str(getattr(module, "__file__", "")).endswith(tuple(EXTENSION_SUFFIXES))


def _load() -> tuple[ModuleType, str]:
    if _forced_python():
        return _source_module(), "python"
    try:
        import kvobs.hot_path as module
    except ImportError as exc:  # a compiled form that does not load here (another Python, a broken build)
        logger.warning("kvobs: the compiled hot path does not load (%r); running it as Python", exc)
        return _source_module(), "python"
    if is_compiled(module):
        return module, "compiled"
    logger.warning(
        "kvobs: the compiled hot path is not built (no C compiler when kvobs was installed); running it as "
        "Python: same results, more scheduler CPU (README, 'The compiled hot path'; docs/performance.md)"
    )
    return module, "python"


_impl, HOT_PATH = _load()
"""``"compiled"`` (mypyc) or ``"python"``."""

_PUBLIC = (
    "CALL", "FINISH", "LOAD", "LOOKUP", "SNAPSHOT",
    "Breach", "ClearTap", "DeferredReleaseTap", "EvictTap", "FlightSegment", "InsertTap", "NearMiss", "PolicyTap",
    "Promises", "RecentRemovals", "Recorder", "RemovalRun", "RemoveTap", "Verdict", "WriteTap",
)

if TYPE_CHECKING:  # the same names, typed (re-exported)
    from kvobs.hot_path import (
        CALL as CALL,
        FINISH as FINISH,
        LOAD as LOAD,
        LOOKUP as LOOKUP,
        SNAPSHOT as SNAPSHOT,
        Breach as Breach,
        ClearTap as ClearTap,
        DeferredReleaseTap as DeferredReleaseTap,
        EvictTap as EvictTap,
        FlightSegment as FlightSegment,
        InsertTap as InsertTap,
        NearMiss as NearMiss,
        PolicyTap as PolicyTap,
        Promises as Promises,
        RecentRemovals as RecentRemovals,
        Recorder as Recorder,
        RemovalRun as RemovalRun,
        RemoveTap as RemoveTap,
        Verdict as Verdict,
        WriteTap as WriteTap,
    )
else:
    globals().update({name: getattr(_impl, name) for name in _PUBLIC})

__all__ = ["HOT_PATH", "is_compiled", *_PUBLIC]
