"""kvobs's options: one typed record, validated once, with errors that name the option."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvobs.wire.format import ENGINE_LABEL_RULE, MAX_MODEL_NAME, is_engine_label, is_model_name

MIN_HISTORY_SIZE = 1_024
DEFAULT_FLIGHT_CALLS = 50_000
"""The flight recorder's window when ``flight_calls`` is unset (docs/performance.md: what it costs)."""
MAX_HISTORY_SIZE = 100_000_000


class OptionError(ValueError):
    """A kvobs option is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class Options:
    """What ``kvobs.observe()`` and the plugin accept (see README, "Options")."""

    history_size: int = 1_000_000
    """Keys the eviction history holds (8 bytes each, plus batch records)."""
    max_verdicts: int = 262_144
    """Lookup verdicts kept across all live requests; more are dropped and counted."""
    dir: str | None = None
    """Directory for the engine -> sidecar journal and failure reports (env KVOBS_DIR)."""
    engine: str | None = None
    """The ``engine`` label; default: the engine index as vLLM numbers it (``"0"``, ``"1"``, ...: its
    data-parallel rank) under vLLM, else ``"0"``. Stable across restarts, as vLLM's own."""
    model_name: str | None = None
    """The ``model_name`` label; default: vLLM's served model name under vLLM, else none."""
    journal_bytes: int = 64 * 2**20
    """Journal bytes kept per engine process (four segments of a quarter each)."""
    journal_processes: int = 8
    """Earlier processes of an engine (restarts) whose journal is kept besides the running one."""
    max_reports: int = 1_000
    """Failure reports kept in ``dir`` (the oldest are deleted)."""
    tracer_provider: Any = None
    """OpenTelemetry TracerProvider for the failure span; default: the global one."""
    vllm_metrics: bool = False
    """Also publish kvobs's live counters on vLLM's own ``/metrics`` (``vllm:kv_offload_kvobs_*``,
    kvobs/vllm/vllm_metrics.py). Off: the spec declares, and the manager reports, exactly what the
    inner spec's do. With ``kvobs.observe()`` under a spec of your own, that spec must declare
    ``kvobs.vllm.vllm_metrics.metric_definitions(options)`` (vLLM's stat logger refuses undeclared names)."""
    survive: bool = False
    """Opt-in: a load that would assert for missing chunks asks vLLM to recompute them instead, and the
    engine goes on (README, "Survive instead of crash"). Needs kvobs's connector and vLLM's
    ``kv_load_failure_policy: "recompute"``; off, vLLM's assertion stops the engine as without kvobs."""
    flight_calls: int | None = None
    """The flight recorder (README, "Replay a failure"): the manager calls it keeps, from a snapshot of the
    manager's state, for ``kvobs replay`` (between this many and twice as many). Unset, the default:
    :data:`DEFAULT_FLIGHT_CALLS` where the manager's state can be snapshotted (vLLM's CPU manager), and none,
    said at INFO, where it cannot (a tiering manager). A number asks for it: where it cannot run, a WARNING
    and ``kvobs_unavailable{part="flight_recorder"}``. 0 keeps none."""
    flight_bytes: int = 32 * 2**20
    """Memory the flight recorder may take (its calls' keys and two state snapshots, estimated): a window
    that outgrows it starts afresh sooner; a manager whose state alone outgrows half of it is not recorded."""
    survive_alarm_per_hour: int = 10
    """With ``survive``: more recomputed loads than this in an hour log an ERROR and count an alarm
    (``kvobs_recompute_alarms_total``, alert ``KvobsRecomputesKeepHappening``)."""

    @property
    def flight_window(self) -> int:
        """The calls the flight recorder keeps (``flight_calls``, or its default); 0: no recorder."""
        return DEFAULT_FLIGHT_CALLS if self.flight_calls is None else self.flight_calls

    @property
    def flight_asked(self) -> bool:
        """Whether ``flight_calls`` asks for the recorder by number (not by default): where it cannot run,
        that is a configuration error to warn of."""
        return self.flight_calls is not None and self.flight_calls > 0


_INT_RANGES = {
    "history_size": (MIN_HISTORY_SIZE, MAX_HISTORY_SIZE),
    "max_verdicts": (1, 100_000_000),
    "journal_bytes": (2**20, 2**40),
    "journal_processes": (0, 1_000),
    "max_reports": (1, 1_000_000),
    "survive_alarm_per_hour": (1, 1_000_000),
    "flight_calls": (0, 10_000_000),
    "flight_bytes": (2**20, 2**40),
}
_STRINGS = ("dir", "engine", "model_name")


def flight_bytes_range() -> tuple[int, int]:
    """What ``flight_bytes`` may be: a bundle's reader bounds the window it unpacks by the writer's
    (kvobs.vllm.bundle_replay)."""
    return _INT_RANGES["flight_bytes"]


def smallest(name: str) -> int:
    """The smallest value the integer option ``name`` may take (benchmarks/soak.py's ``--smallest-bounds``)."""
    return _INT_RANGES[name][0]
_BOOLS = ("vllm_metrics", "survive")
NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options))


def parse_options(raw: Mapping[str, Any], *, source: str = "kvobs option") -> Options:
    """Validate ``raw`` into Options; raise OptionError naming the first bad option."""
    if not isinstance(raw, Mapping):
        raise OptionError(f"{source}s must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(NAMES))
    if unknown:
        raise OptionError(
            f"unknown {source} {unknown[0]!r}; known options: {', '.join(NAMES)}"
        )
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name in _INT_RANGES:
            low, high = _INT_RANGES[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(f"{source} {name!r} must be an integer, got {value!r}")
            if not low <= value <= high:
                raise OptionError(f"{source} {name!r} must be in [{low}, {high}], got {value}")
        elif name in _BOOLS:
            if not isinstance(value, bool):
                raise OptionError(f"{source} {name!r} must be true or false, got {value!r:.80}")
        elif name in _STRINGS and value is not None and (not isinstance(value, str) or not value):
            raise OptionError(f"{source} {name!r} must be a non-empty string, got {value!r}")
        elif name == "engine" and value is not None and not is_engine_label(value):
            raise OptionError(
                f"{source} 'engine' must be {ENGINE_LABEL_RULE} (it names the journal files), got {value!r:.300}"
            )
        elif name == "model_name" and value is not None and not is_model_name(value):
            raise OptionError(f"{source} 'model_name' must be at most {MAX_MODEL_NAME} printable characters, "
                              f"got {value!r:.300}")
        elif name == "tracer_provider" and value is not None and not callable(getattr(value, "get_tracer", None)):
            # Else a JSON string here would only surface at the first failed load, as a kvobs fault.
            raise OptionError(
                f"{source} {name!r} must be an OpenTelemetry TracerProvider (has get_tracer()), got {value!r:.80}"
            )
        values[name] = value
    if values.get("dir") is None:
        values["dir"] = os.environ.get("KVOBS_DIR") or None
    return Options(**values)
