"""vLLM glue: the only kvobs package that imports vLLM (the releases: ``kvobs.versions.SUPPORTED_VLLM``).

Every vLLM process that loads the plugin (``spec_module_path: "kvobs.vllm"``) imports this
package, the API server included, which only asks the spec for its metric definitions and config
keys. So importing it loads the spec and nothing of the recording side: ``ObservedOffloadingManager``
and ``observe`` (and with them the observer, the history, numpy, the hot path) are imported when
first asked for (PEP 562).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvobs.vllm.spec import ObservedOffloadingSpec
from kvobs.vllm.vllm_logging import join_vllm_logging

if TYPE_CHECKING:
    from kvobs.vllm.manager import ObservedOffloadingManager
    from kvobs.vllm.observe import observe

join_vllm_logging()  # every vLLM process that loads the plugin imports this package first

_LAZY = {"ObservedOffloadingManager": "kvobs.vllm.manager", "observe": "kvobs.vllm.observe"}


def __getattr__(name: str) -> Any:
    """``ObservedOffloadingManager`` and ``observe``, imported at first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(ModuleType):
    """Keeps ``kvobs.vllm.observe`` the function: importing the submodule of that name (as
    ``kvobs.observe()`` and the spec do) sets the package's attribute to the submodule."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "observe" and isinstance(value, ModuleType):
            value = value.observe  # the submodule has run by the time the import system sets it
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["ObservedOffloadingManager", "ObservedOffloadingSpec", "observe"]
