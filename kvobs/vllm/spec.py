"""ObservedOffloadingSpec: the out-of-tree offloading spec vLLM loads to plug kvobs in.

Configured through ``kv_connector_extra_config`` (README, "Plug into vllm serve")::

    {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
     "kvobs": {"inner_spec": "TieringOffloadingSpec", "history_size": 1000000},
     "cpu_bytes_to_use": ..., ...the inner spec's own keys...}

It composes the inner spec (``CPUOffloadingSpec`` by default) rather than
subclassing it, so one class serves every inner spec. Composition means it must
forward what vLLM asks of a spec (notes §4): ``get_worker``, both classmethods
(the API server calls them) and ``replicated_layout``. The module is imported by
every vLLM process, so import and ``__init__`` stay cheap; options are
validated in the classmethods too, so a bad option fails at start-up.

``build_metric_definitions`` is the inner spec's, plus kvobs's own counters when the
``vllm_metrics`` option is on (kvobs/vllm/vllm_metrics.py): the API server declares what the
manager's ``get_stats`` may report, and both read the same ``kv_connector_extra_config``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvobs.options import OptionError, Options, parse_options
from kvobs.vllm import compat

logger = logging.getLogger("kvobs")

KVOBS_KEY = "kvobs"
DEFAULT_INNER_SPEC = "CPUOffloadingSpec"
_SPEC_KEYS = ("inner_spec", "inner_spec_module_path")


def split_config(extra_config: Mapping[str, Any]) -> tuple[type[OffloadingSpec], dict[str, Any], Options]:
    """(inner spec class, the inner spec's extra_config, kvobs options) from extra_config."""
    raw = extra_config.get(KVOBS_KEY, {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise OptionError(
            f"kv_connector_extra_config[{KVOBS_KEY!r}] must be an object, got {type(raw).__name__}"
        )
    inner_name = raw.get("inner_spec", DEFAULT_INNER_SPEC)
    inner_module = raw.get("inner_spec_module_path")
    for name, value in (("inner_spec", inner_name), ("inner_spec_module_path", inner_module)):
        if value is not None and (not isinstance(value, str) or not value):
            raise OptionError(f"kvobs option {name!r} must be a non-empty string, got {value!r}")
    if inner_name == ObservedOffloadingSpec.__name__:
        raise OptionError("kvobs option 'inner_spec' cannot be ObservedOffloadingSpec itself")
    options = parse_options({k: v for k, v in raw.items() if k not in _SPEC_KEYS})
    inner_extra = {k: v for k, v in extra_config.items() if k != KVOBS_KEY}
    lookup = {"spec_name": inner_name}
    if inner_module is not None:
        lookup["spec_module_path"] = inner_module
    try:
        inner_cls = OffloadingSpecFactory.get_spec_cls(lookup)
    except (ValueError, ImportError, AttributeError, AssertionError) as exc:
        raise OptionError(
            f"kvobs option 'inner_spec': cannot load offloading spec {inner_name!r}"
            + (f" from {inner_module!r}" if inner_module else "")
            + f": {exc}"
        ) from exc
    return inner_cls, inner_extra, options


def observe_or_step_aside(inner: OffloadingManager, options: Options) -> OffloadingManager:
    """``observe_with_options``, or ``inner`` itself (logged once, journaled) when kvobs cannot."""
    from kvobs.vllm.observe import observe_with_options

    try:
        observed = observe_with_options(inner, options)
    except Exception as exc:
        reason = "unsupported_vllm" if isinstance(exc, compat.ProtocolMismatch) else "error"
        logger.warning(
            "kvobs steps aside: it cannot observe %s on vLLM %s (%s); the engine runs as if kvobs were absent",
            type(inner).__name__, compat.VLLM_VERSION, exc,
        )
        if options.dir is not None:
            try:
                from kvobs.journal import announce_unobserved

                announce_unobserved(options, compat.VLLM_VERSION, reason, str(exc))
            except Exception as fault:  # nothing kvobs does may stop the engine
                logger.warning("kvobs could not say so in %s either: %r", options.dir, fault)
        return inner
    unknown = compat.unknown_attributes()
    if unknown:  # a newer release's methods: vLLM's manager answers them, kvobs records nothing of them
        logger.warning("kvobs observes %s on vLLM %s, but not %s: vLLM's OffloadingManager has them and kvobs does "
                       "not know them; they reach the inner manager unobserved (kvobs doctor lists them)",
                       type(inner).__name__, compat.VLLM_VERSION, ", ".join(unknown))
    return observed


def observing_line(inner: OffloadingManager, observer: Any) -> str:
    """The one INFO line an engine logs when kvobs observes it: what is observed, where the evidence goes,
    and the options that change what kvobs does (a problem with any of them was a WARNING just before)."""
    from kvobs.hot_path_loader import HOT_PATH
    from kvobs.journal import dir_source

    options: Options = observer.options
    if options.dir is None:
        where = "no directory (in-process only: no 'dir' option, no KVOBS_DIR)"
    elif observer.dir_problem is not None:
        where = f"directory {options.dir!r} ({dir_source(options)}) UNUSABLE, no journal: {observer.dir_problem}"
    else:
        where = f"directory {options.dir!r} ({dir_source(options)})"
    if options.flight_window <= 0:
        flight = "off"
    elif observer.unavailable()["flight_recorder"]:
        flight = f"asked for (flight_calls={options.flight_calls}) but OFF: {observer.flight_why_not()}"
    elif not observer.recording():
        flight = f"off (by default where the state cannot be snapshotted: {observer.flight_why_not()})"
    else:
        flight = f"on (flight_calls={options.flight_window}, flight_bytes={options.flight_bytes})"
    onoff = {True: "on", False: "off"}
    return (f"kvobs observes {type(inner).__name__} on vLLM {compat.VLLM_VERSION} (engine {options.engine!r}, "
            f"model {options.model_name!r}): {where}; flight recorder {flight}; survive {onoff[options.survive]}; "
            f"vllm_metrics {onoff[options.vllm_metrics]}; history_size {options.history_size}; "
            f"hot path {HOT_PATH}")


class ObservedOffloadingSpec(OffloadingSpec):
    """Builds the inner spec's manager and returns it wrapped by kvobs."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The inner spec's metrics; with the ``vllm_metrics`` option, kvobs's counters too
        (kvobs/vllm/vllm_metrics.py), which the manager's ``get_stats`` then reports."""
        inner_cls, inner_extra, options = split_config(extra_config)
        definitions = inner_cls.build_metric_definitions(inner_extra)
        if options.vllm_metrics:
            from kvobs.vllm.vllm_metrics import metric_definitions

            definitions = {**definitions, **metric_definitions(options)}
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        inner_cls, inner_extra, _ = split_config(extra_config)
        return inner_cls.config_info_keys(inner_extra)

    def __init__(self, config: OffloadingConfig) -> None:
        inner_cls, inner_extra, options = split_config(config.extra_config)
        inner_config = dataclasses.replace(config, extra_config=inner_extra)
        super().__init__(inner_config)
        self.inner_spec: OffloadingSpec = inner_cls(inner_config)
        model_name, engine = compat.engine_labels(config)  # vLLM's own labels for this engine
        self.kvobs_options = dataclasses.replace(
            options, engine=options.engine or engine, model_name=options.model_name or model_name
        )
        # The base __init__ resets these; the connector reads the inner spec's values.
        self.replicated_layout = self.inner_spec.replicated_layout
        self.offload_prompt_only = self.inner_spec.offload_prompt_only
        self.kv_events_config = self.inner_spec.kv_events_config
        self._manager: OffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        """The inner spec's manager, observed; unobserved, with one warning, if kvobs cannot observe it.

        An observability plugin never stops an engine: on a vLLM release, manager or private
        attribute kvobs does not know (``compat.ProtocolMismatch``), or any fault of kvobs's own
        while wrapping, the engine gets the inner manager as vLLM built it, and the journal
        (when ``dir`` is set) says so: ``kvobs_observing{reason}`` is 0 at the sidecar.
        """
        if self._manager is None:
            inner = self.inner_spec.get_manager()
            self._manager = observe_or_step_aside(inner, self.kvobs_options)
            observer = getattr(self._manager, "observer", None) if self._manager is not inner else None
            if observer is not None:
                observer.chunk_bytes = compat.chunk_bytes(self.inner_spec)
                try:
                    logger.info("%s", observing_line(inner, observer))
                except Exception as exc:  # a log line is not worth a fault in vLLM
                    observer.internal_error("sink", exc)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return self.inner_spec.get_worker(kv_caches)

    def __getattr__(self, name: str) -> Any:
        """Spec attributes the connector reads (e.g. num_chunks) come from the inner spec."""
        if name == "inner_spec":
            raise AttributeError(name)
        return getattr(self.inner_spec, name)
