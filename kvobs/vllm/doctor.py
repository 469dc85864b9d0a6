"""``kvobs doctor``: what an operator needs to know before rolling kvobs out, found out with vLLM's own Python.

It answers, in a few lines, the questions the plugin answers only once an engine runs:

* the running vLLM's version (:data:`kvobs.vllm.compat.VLLM_VERSION`) and whether kvobs is tested on it
  (:data:`kvobs.versions.SUPPORTED_VLLM`);
* whether kvobs will observe it: the manager the configured inner spec builds is built here, small (a CPU
  tier of a few chunks; a tiering spec's secondary tiers replaced by vLLM's in-memory example tier, so
  nothing is written or dialled), exactly as ``ObservedOffloadingSpec`` builds it
  (:func:`kvobs.vllm.spec.split_config`, then the inner spec's ``get_manager()``), then checked by
  :func:`kvobs.vllm.compat.check` and wrapped as the plugin wraps it (without a directory); what would
  make the plugin step aside is named (``compat.ProtocolMismatch``'s text); what vLLM's ``OffloadingManager``
  has that kvobs does not know (a method a newer release added) is listed: the wrapper forwards it to the
  inner manager unobserved (``compat.unknown_attributes``);
* the ``--kv-transfer-config`` JSON itself: vLLM's own ``KVTransferConfig`` validates it as ``vllm
  serve`` does, the connector and spec must be kvobs's (README, "Plug into vllm serve"), and the kvobs
  options are parsed by the plugin's own parser, so a bad one fails with the plugin's start-up error;
* the hot path's form (``kvobs_build_info{hot_path}``) and the journal directory (option ``dir``, else
  ``$KVOBS_DIR``): it exists or can be created, and a file can be written there (a probe file is created
  and removed, and so is every directory the probe created: nothing is left behind).

Exit status: 0 kvobs will observe; 1 it would step aside (a protocol mismatch, an error wrapping the
manager; the command line says so when vLLM does not even import); 2 a configuration error (bad JSON, a
connector or spec that is not kvobs's, an unknown option, an unusable directory, survive mode refused).
2 wins over 1. ``kvobs.cli`` imports this module only for ``kvobs doctor``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import mmap
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import OffloadingSpec

import kvobs
from kvobs.files import probe_directory
from kvobs.options import MIN_HISTORY_SIZE, OptionError, Options
from kvobs.versions import SUPPORTED_VLLM
from kvobs.vllm import compat
from kvobs.vllm.spec import KVOBS_KEY, ObservedOffloadingSpec, split_config

OBSERVES, STEPS_ASIDE, CONFIG_ERROR = 0, 1, 2
"""The exit statuses (the worst finding decides: 2 wins over 1)."""

KVOBS_CONNECTOR = "ObservedOffloadingConnector"
KVOBS_CONNECTOR_MODULE = "kvobs.vllm.connector"
VLLM_CONNECTOR = "OffloadingConnector"
SPEC_MODULE = "kvobs.vllm"
DOCTOR_CHUNKS = 4
"""CPU chunks of the manager built here: the protocol is the same at any size."""
CHUNK_SIZE_KEYS = ("block_size", "blocks_per_chunk")
"""Left out of the manager built here (a chunk is one GPU block of the doctor's own): they depend on the
engine's GPU block size (``--block-size``), which the doctor does not know, and not the protocol."""

DEFAULT_CONFIG: dict[str, Any] = {
    "kv_connector": KVOBS_CONNECTOR, "kv_connector_module_path": KVOBS_CONNECTOR_MODULE, "kv_role": "kv_both",
    "kv_connector_extra_config": {"spec_name": ObservedOffloadingSpec.__name__, "spec_module_path": SPEC_MODULE,
                                  "cpu_bytes_to_use": 2**30},
}
"""What is checked without ``--kv-transfer-config``: the README's form, every kvobs option its default."""


class ConfigError(Exception):
    """The configuration would not run as meant (exit status 2); the text says what and where."""


@dataclasses.dataclass
class Report:
    """The findings, one line each (``topic: statement``), and the same as data for ``--json``."""

    lines: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: int = OBSERVES
    unchecked: bool = False
    """The protocol could not be checked at all (exit 1 all the same)."""

    def say(self, topic: str, text: str, status: int = OBSERVES) -> None:
        self.lines.append((topic, text))
        self.status = max(self.status, status)
        if status != OBSERVES:
            self.data.setdefault("problems", []).append(f"{topic}: {text}")

    def render(self) -> str:
        return "".join(f"{topic}: {text}\n" for topic, text in self.lines)

    def as_json(self) -> str:
        return json.dumps({"exit": self.status, **self.data, "lines": [f"{t}: {s}" for t, s in self.lines]},
                          indent=2)


def run(kv_transfer_config: str | None, *, as_json: bool = False) -> int:
    """``kvobs doctor``: print the report (text or JSON) and return the exit status."""
    with _quiet_loggers(), contextlib.redirect_stdout(sys.stderr):  # what vLLM prints is not the report
        report = diagnose(kv_transfer_config)
    sys.stdout.write(report.as_json() + "\n" if as_json else report.render())
    return report.status


def diagnose(kv_transfer_config: str | None) -> Report:
    """Every finding for this Python, this vLLM and ``kv_transfer_config`` (the JSON of ``vllm serve
    --kv-transfer-config``; None: the README's configuration with every kvobs option its default)."""
    report = Report()
    report.data["kvobs"] = {"version": kvobs.__version__, "python": sys.executable}
    report.say("kvobs", f"{kvobs.__version__}, run by {sys.executable} (Python {sys.version.split()[0]})")
    version_line = len(report.lines)  # the vLLM line says whether the check passed: written after it
    try:
        config = _transfer_config(kv_transfer_config, report)
        inner_cls, inner_extra, options, raw = _plugin_config(config, report)
    except ConfigError as exc:
        report.say("config", str(exc), CONFIG_ERROR)
        _vllm_line(report, version_line, None)
        _hot_path(report)
        _result(report)
        return report
    _vllm_validates(config, inner_cls, inner_extra, report)
    observed = _observe(config, inner_cls, inner_extra, options, report)
    _vllm_line(report, version_line, observed)
    if options.survive:
        _survive(config, observed, report)
    _hot_path(report)
    _directory(options, raw, report)
    _result(report)
    return report


# -- the configuration --------------------------------------------------------------------------------


def _transfer_config(text: str | None, report: Report) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object, validated by vLLM's own ``KVTransferConfig`` as ``vllm serve`` does."""
    if text is None:
        report.data["config_given"] = False
        config = json.loads(json.dumps(DEFAULT_CONFIG))
    else:
        report.data["config_given"] = True
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"--kv-transfer-config must be a JSON object, got {type(config).__name__}")
    from vllm.config import KVTransferConfig

    try:
        KVTransferConfig(**config)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refuses this --kv-transfer-config: {_validation_text(exc)}") from None
    return config


def _validation_text(exc: Exception) -> str:
    """pydantic's errors on one line (``field: message; ...``), else the exception's text."""
    errors = getattr(exc, "errors", None)
    try:
        items = errors() if callable(errors) else None
    except Exception:
        items = None
    if not items:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "; ".join(f"{'.'.join(str(p) for p in item.get('loc', ())) or 'config'}: {item.get('msg', '')}"
                     for item in items)


def _plugin_config(config: Mapping[str, Any], report: Report
                   ) -> tuple[type[OffloadingSpec], dict[str, Any], Options, Mapping[str, Any]]:
    """The connector and spec checked to be kvobs's, and the plugin's own reading of its options."""
    connector = config.get("kv_connector")
    module = config.get("kv_connector_module_path")
    extra = config.get("kv_connector_extra_config") or {}
    if connector == KVOBS_CONNECTOR:
        if module != KVOBS_CONNECTOR_MODULE:
            raise ConfigError(f"kv_connector {KVOBS_CONNECTOR!r} needs \"kv_connector_module_path\": "
                              f"{KVOBS_CONNECTOR_MODULE!r} (it is {module!r})")
        try:
            importlib.import_module(KVOBS_CONNECTOR_MODULE)
        except Exception as exc:
            raise ConfigError(f"kvobs's {KVOBS_CONNECTOR} does not import on vLLM {compat.VLLM_VERSION} "
                              f"({type(exc).__name__}: {exc}): vllm serve would not start; vLLM's "
                              f"{VLLM_CONNECTOR!r} would") from None
        connector_text = f"{KVOBS_CONNECTOR} (kvobs's: the served model name and the trace join)"
    elif connector == VLLM_CONNECTOR and module is None:
        connector_text = f"{VLLM_CONNECTOR} (vLLM's; {KVOBS_CONNECTOR} adds the served model name and the trace join)"
    else:
        raise ConfigError(
            f"kv_connector {connector!r}" + (f" from {module!r}" if module is not None else "")
            + f" is not one kvobs plugs into: use {KVOBS_CONNECTOR!r} with \"kv_connector_module_path\": "
            f"{KVOBS_CONNECTOR_MODULE!r}, or vLLM's {VLLM_CONNECTOR!r} (README, 'Plug into vllm serve')"
        )
    spec_name, spec_module = extra.get("spec_name"), extra.get("spec_module_path")
    if (spec_name, spec_module) != (ObservedOffloadingSpec.__name__, SPEC_MODULE):
        raise ConfigError(
            f"kv_connector_extra_config names spec_name {spec_name!r} from spec_module_path {spec_module!r}: kvobs "
            f"is not plugged in (it needs \"spec_name\": {ObservedOffloadingSpec.__name__!r}, "
            f"\"spec_module_path\": {SPEC_MODULE!r})"
        )
    raw = extra.get(KVOBS_KEY) or {}
    try:
        inner_cls, inner_extra, options = split_config(extra)  # the plugin's own parsing: its start-up errors
    except OptionError as exc:
        raise ConfigError(str(exc)) from None
    report.data["config"] = {"kv_connector": connector, "spec_name": spec_name, "inner_spec": inner_cls.__name__}
    report.data["options"] = _option_values(options)
    report.say("config", f"{connector_text}; {ObservedOffloadingSpec.__name__} around {inner_cls.__name__}")
    changed = [f"{name}={value!r}" for name, value in _changed_options(options, raw).items()]
    report.say("options", (", ".join(changed) + "; the others their defaults") if changed
               else "every kvobs option its default")
    return inner_cls, inner_extra, options, raw


def _option_values(options: Options) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "tracer_provider"}


def _changed_options(options: Options, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The options that are not their defaults (``dir`` only when the config sets it: else it is the directory
    line's), with ``inner_spec`` when given."""
    defaults = Options()
    changed = {name: raw[name] for name in ("inner_spec", "inner_spec_module_path") if name in raw}
    for name, value in _option_values(options).items():
        if value != getattr(defaults, name) and (name != "dir" or "dir" in raw):
            changed[name] = value
    return changed


# -- will kvobs observe? ------------------------------------------------------------------------------


@dataclasses.dataclass
class Observed:
    """What :func:`_observe` found."""

    observes: bool
    reason: str
    """``ok``, or why the plugin steps aside: ``unsupported_vllm`` (``compat.ProtocolMismatch``) or ``error``
    (anything else while wrapping), as ``kvobs_observing{reason}`` says."""
    detail: str
    manager: str
    knows_cpu_tier: bool
    flight_off: str | None = None
    """Why the flight recorder (on by default, or asked for by ``flight_calls``) stays off on this manager (None:
    it runs, or ``flight_calls`` is 0), found by starting it on the manager built here, as the plugin does."""


def _observe(config: Mapping[str, Any], inner_cls: type[OffloadingSpec], inner_extra: dict[str, Any],
             options: Options, report: Report) -> Observed:
    """Build the inner spec's manager as the plugin does (small), check it and wrap it; always shut down."""
    built = f"built here by {inner_cls.__name__}"
    try:  # the doctor's own part: what vLLM's connector hands a spec
        offloading_config = _offloading_config(config, inner_cls, inner_extra)
    except Exception as exc:
        return _not_checked(report, f"kvobs doctor cannot build vLLM {compat.VLLM_VERSION}'s offloading config "
                            f"({type(exc).__name__}: {exc}), so it cannot tell", STEPS_ASIDE)
    try:  # the inner spec's part, as in an engine
        manager = inner_cls(offloading_config).get_manager()
    except Exception as exc:
        return _not_checked(report, f"vLLM cannot build {inner_cls.__name__}'s manager from this config "
                            f"({type(exc).__name__}: {exc})", CONFIG_ERROR)
    name = type(manager).__name__
    try:
        compat.check(manager)
        from kvobs.vllm.observe import observe_with_options

        quiet = dataclasses.replace(options, dir=None, history_size=MIN_HISTORY_SIZE, max_verdicts=1024)
        manager = observe_with_options(manager, quiet)  # then the wrapper's shutdown shuts the inner one down
    except compat.ProtocolMismatch as exc:
        observed = Observed(False, "unsupported_vllm", str(exc), name, False)
    except Exception as exc:
        observed = Observed(False, "error", f"{type(exc).__name__}: {exc}", name, False)
    else:
        knows = compat.cpu_tier_of(getattr(manager, "inner", manager)) is not None
        observed = Observed(True, "ok", "", name, knows)
        observer = getattr(manager, "observer", None)
        if observer is not None and observer.options.flight_window > 0 and not observer.recording():
            observed.flight_off = observer.flight_why_not() or "it is off"
    finally:
        with contextlib.suppress(Exception):
            manager.shutdown()
    report.data["observe"] = {k: v for k, v in dataclasses.asdict(observed).items() if k != "flight_off"}
    if not observed.observes:
        report.say("observes", f"no: kvobs steps aside on vLLM {compat.VLLM_VERSION} ({observed.reason}): "
                   f"{observed.detail} ({name} {built}); the engine would run vLLM's manager unobserved", STEPS_ASIDE)
    elif knows:
        report.say("observes", f"yes: every method and attribute kvobs reads of {name} ({built}, small) matches")
    else:
        report.say("observes", f"yes, its calls only: kvobs does not know the CPU tier of {name} ({built}), so its "
                   "evictions are not recorded")
    if observed.observes:
        _forwarded(name, report)
        _recorder(options, observed, report)
    return observed


def _recorder(options: Options, observed: Observed, report: Report) -> None:
    """The flight recorder: on by default where the manager's state can be snapshotted; asked for by number
    (``flight_calls``) and unable to run (a tiering manager's state cannot be snapshotted) is a configuration
    error: the engine would log one WARNING and write no replay bundle."""
    calls = options.flight_window
    report.data["flight_recorder"] = {"asked": options.flight_asked, "default": options.flight_calls is None,
                                      "runs": calls > 0 and observed.flight_off is None,
                                      "why_not": observed.flight_off}
    if calls <= 0:
        report.say("flight recorder", "off (flight_calls is 0): no replay bundles")
    elif observed.flight_off is not None and options.flight_asked:
        report.say("flight recorder", f"asked for (flight_calls={options.flight_calls}) but it cannot run on "
                   f"{observed.manager}: {observed.flight_off}; the engine would log a WARNING and write no replay "
                   "bundle (set flight_calls to 0, or use CPUOffloadingSpec)", CONFIG_ERROR)
    elif observed.flight_off is not None:
        report.say("flight recorder", f"off: on by default, but it cannot run on {observed.manager}: "
                   f"{observed.flight_off}; no replay bundles (said at INFO, not an error)")
    else:
        report.say("flight recorder", f"on{' (the default)' if options.flight_calls is None else ''}: the last "
                   f"{calls} to {2 * calls} manager calls and snapshots, at most "
                   f"{options.flight_bytes / 2**20:.0f} MiB (started on {observed.manager} here)")


def _vllm_validates(config: Mapping[str, Any], inner_cls: type[OffloadingSpec], inner_extra: dict[str, Any],
                    report: Report) -> None:
    """vLLM's own checks of the inner spec's settings, on the values given (the manager :func:`_observe` builds is
    resized and its secondary tiers replaced, so it cannot find what vLLM would refuse): the API server's
    ``build_metric_definitions`` (a tiering spec resolves each tier's ``type`` there), the spec's ``__init__``
    (``cpu_bytes_to_use`` present, ``secondary_tiers`` a list, ``tier_poll_interval_s``, ``backpressure``), and
    each secondary tier through vLLM's ``SecondaryTierFactory.create_secondary_tier`` (its back-pressure
    detector built for real, with its range checks) with only the tier's constructor replaced by a check of its
    keyword arguments against the real class's signature: a real tier would open files or dial peers."""
    extra = json.loads(json.dumps(inner_extra))  # vLLM's code may change what it is given
    step = f"{inner_cls.__name__}.build_metric_definitions"
    try:
        inner_cls.build_metric_definitions(json.loads(json.dumps(extra)))
        step = f"{inner_cls.__name__}(...)"
        offloading = dataclasses.replace(_offloading_config(config, inner_cls, inner_extra),
                                         extra_config={k: v for k, v in extra.items() if k not in CHUNK_SIZE_KEYS})
        spec = inner_cls(offloading)
        tiers = getattr(spec, "secondary_tier_configs", None)
        if isinstance(tiers, list) and tiers:
            step = "secondary_tiers"
            _check_tiers(tiers, spec)
    except Exception as exc:
        report.data["vllm_validation"] = {"ok": False, "step": step, "error": f"{type(exc).__name__}: {exc}"}
        report.say("settings", f"vLLM {compat.VLLM_VERSION} refuses the offloading settings "
                   f"({step}): {type(exc).__name__}: {exc}", CONFIG_ERROR)
        return
    report.data["vllm_validation"] = {"ok": True}
    report.say("settings", f"vLLM {compat.VLLM_VERSION}'s own checks of {inner_cls.__name__}'s settings pass")


def _check_tiers(tiers: list[Any], spec: OffloadingSpec) -> None:
    """Each tier config through vLLM's own factory; raises what vLLM would raise at start-up (or a TypeError
    naming the tier's unknown or missing parameter)."""
    import inspect

    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:  # a release without tiering: its spec refused the tiers already
        return

    class _SignatureOnly(SecondaryTierFactory):
        @classmethod
        def get_tier_class(cls, tier_config: dict[str, Any]) -> Any:
            real = SecondaryTierFactory.get_tier_class(tier_config)

            def check(**kwargs: Any) -> None:
                try:
                    inspect.signature(real).bind(**kwargs)
                except TypeError as exc:
                    raise TypeError(f"tier {tier_config.get('type')!r} ({real.__name__}): {exc}") from None
            return check

    for tier in tiers:
        if not isinstance(tier, dict):
            raise ValueError(f"a secondary tier must be an object, got {tier!r:.80}")
        _SignatureOnly.create_secondary_tier(json.loads(json.dumps(tier)), memoryview(b""), spec)


def _forwarded(manager: str, report: Report) -> None:
    """What the wrapper hands the inner manager without observing it: every name of vLLM's ``OffloadingManager``
    kvobs has no ``compat.PROTOCOL`` row for (none on a tested release)."""
    names = compat.unknown_attributes()
    methods = set(compat.unknown_methods())
    abstract = set(compat.unknown_abstract_methods())
    report.data["forwarded_unobserved"] = {"methods": [n for n in names if n in methods], "abstract": sorted(abstract),
                                           "other": [n for n in names if n not in methods]}
    if names:
        shown = ", ".join(f"{n}()" + (" (abstract)" if n in abstract else "") if n in methods else n for n in names)
        report.say("forwarded", f"unobserved: {shown}: vLLM {compat.VLLM_VERSION}'s OffloadingManager has them and "
                   f"kvobs does not know them; the wrapper hands each to {manager}'s own, and kvobs records "
                   "nothing of those calls")


def _not_checked(report: Report, detail: str, status: int) -> Observed:
    observed = Observed(False, "error", detail, "", False)
    report.unchecked = True
    report.data["observe"] = dataclasses.asdict(observed)
    report.say("observes", f"not checked: {detail}", status)
    return observed


def _offloading_config(config: Mapping[str, Any], inner_cls: type[OffloadingSpec], inner_extra: dict[str, Any]
                       ) -> Any:
    """The ``OffloadingConfig`` the inner spec gets: vLLM's own ``build_offloading_config`` (as vLLM's
    ``OffloadingConnector`` calls it) over this ``--kv-transfer-config``, then the plugin's
    replacement of ``extra_config``; sized to :data:`DOCTOR_CHUNKS` CPU chunks, a tiering spec's
    secondary tiers replaced by vLLM's in-memory one (the CPU tier is what kvobs hooks)."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    from kvobs.vllm.modelless_config import BLOCK_SIZE, make_kv_cache_config, make_offloading_config

    transfer = {**config, "kv_connector_extra_config": {  # one GPU block a chunk: this engine's block size is unknown
        k: v for k, v in config.get("kv_connector_extra_config", {}).items() if k not in CHUNK_SIZE_KEYS}}
    vllm_config = VllmConfig(device_config=DeviceConfig("cpu"),
                             cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                             kv_transfer_config=KVTransferConfig(**transfer))
    offloading = make_offloading_config(vllm_config, make_kv_cache_config(hybrid=False))
    extra = {k: v for k, v in inner_extra.items() if k not in CHUNK_SIZE_KEYS}
    if "cpu_bytes_to_use" in extra:
        alignment = int(getattr(inner_cls, "BLOCK_SIZE_ALIGNMENT", mmap.PAGESIZE))
        chunk = (offloading.worker_kv_bytes_per_block * offloading.parallel.world_size
                 * offloading.cache.blocks_per_chunk)
        extra["cpu_bytes_to_use"] = -(-chunk // alignment) * alignment * DOCTOR_CHUNKS
    if "secondary_tiers" in extra:
        extra["secondary_tiers"] = [{"type": "example"}]
    return dataclasses.replace(offloading, extra_config=extra)


def _vllm_line(report: Report, at: int, observed: Observed | None) -> None:
    version = compat.VLLM_VERSION
    relation = version_relation(version)
    where = _vllm_location()
    report.data["vllm"] = {"version": version, "location": where, "relation": relation,
                           "tested": relation == "tested", "supported": list(SUPPORTED_VLLM)}
    tested = f"{SUPPORTED_VLLM[0]} to {SUPPORTED_VLLM[-1]}" if len(SUPPORTED_VLLM) > 1 else SUPPORTED_VLLM[0]
    text = {
        "tested": "tested",
        "newer": f"not tested (newer than {SUPPORTED_VLLM[-1]}, the newest kvobs is tested on)",
        "older": f"not tested (older than {SUPPORTED_VLLM[0]}, the oldest kvobs is tested on)",
        "untested": f"not tested (kvobs is tested on {', '.join(SUPPORTED_VLLM)})",
    }[relation]
    if relation != "tested" and observed is not None:
        text += ("; observed because its protocol matches" if observed.observes
                 else "; not observed: its protocol does not match (below)")
    elif relation == "tested":
        text += f" (kvobs is tested on {tested})"
    report.lines.insert(at, ("vLLM", f"{version} at {where}: {text}"))


def version_relation(version: str, supported: tuple[str, ...] = SUPPORTED_VLLM) -> str:
    """``tested`` (a release of ``supported``, a local build of one included: ``0.33.0+cpu``), ``newer``,
    ``older`` or ``untested`` (between them, or no version to compare)."""
    release = _release(version)
    if release is None:
        return "untested"
    if release in {_release(v) for v in supported}:
        return "tested"
    known = sorted(r for r in (_release(v) for v in supported) if r is not None)
    if known and release > known[-1]:
        return "newer"
    if known and release < known[0]:
        return "older"
    return "untested"


def _release(version: str) -> tuple[int, int, int] | None:
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def _vllm_location() -> str:
    try:
        import vllm

        return str(Path(str(vllm.__file__)).parent)
    except Exception:
        return "an unknown location"


def _survive(config: Mapping[str, Any], observed: Observed, report: Report) -> None:
    """Survive mode's start-up conditions (README, "What it needs") that the config alone decides."""
    problems = []
    if config.get("kv_connector") != KVOBS_CONNECTOR:
        problems.append(f"kvobs's connector ({KVOBS_CONNECTOR}): with vLLM's it stays unarmed")
    policy = config.get("kv_load_failure_policy", "fail")
    if policy != "recompute":
        problems.append(f"\"kv_load_failure_policy\": \"recompute\" (it is {policy!r}; start-up refuses it)")
    if observed.observes and not observed.knows_cpu_tier:
        problems.append("an inner spec whose CPU tier kvobs knows (CPUOffloadingSpec, TieringOffloadingSpec)")
    if problems:
        report.say("survive", "needs " + "; and ".join(problems), CONFIG_ERROR)
    elif compat.reports_failed_requests():  # a hybrid model recomputes whole requests
        report.say("survive", "armed at start-up; with several KV cache groups (a hybrid model) only with "
                   "asynchronous loads (the connector's sync_load_budget_bytes at 0), checked then")
    else:
        report.say("survive", f"armed at start-up if the model has one KV cache group (checked then: on vLLM "
                   f"{compat.VLLM_VERSION} kvobs refuses several)")


# -- this host ----------------------------------------------------------------------------------------


def _hot_path(report: Report) -> None:
    from kvobs.capture_ring import PURE_PYTHON_ENV, python_asked
    from kvobs.hot_path_loader import HOT_PATH

    report.data["hot_path"] = HOT_PATH
    if HOT_PATH == "compiled":
        report.say("hot path", "compiled (mypyc)")
    elif python_asked():
        report.say("hot path", f"pure Python, as {PURE_PYTHON_ENV} asks: same results, more scheduler CPU")
    else:
        report.say("hot path", "pure Python (not compiled when kvobs was installed, or the compiled form does not "
                   "load with this Python): same results, more scheduler CPU")


def _directory(options: Options, raw: Mapping[str, Any], report: Report) -> None:
    """The journal directory: the ``dir`` option, else ``$KVOBS_DIR`` (as the plugin reads them)."""
    if options.dir is None:
        report.data["dir"] = {"path": None, "source": None, "writable": None}
        report.say("dir", "none: in-process only (no 'dir' option, no $KVOBS_DIR): no journal, no failure reports, "
                   "nothing for kvobs serve")
        return
    from kvobs.journal import DIR_LOST, disk_bound

    source = "option dir" if raw.get("dir") is not None else "$KVOBS_DIR"
    error, note = probe_directory(Path(options.dir))
    report.data["dir"] = {"path": options.dir, "source": source, "writable": error is None,
                          "detail": error or note, "disk_bound_bytes": disk_bound(options)}
    if error is not None:
        report.say("dir", f"{options.dir} ({source}): {error}; the engine would log one WARNING: {DIR_LOST}",
                   CONFIG_ERROR)
    else:
        report.say("dir", f"{options.dir} ({source}): {note}; kvobs keeps at most "
                   f"{disk_bound(options) / 2**30:.2f} GiB there for one engine")


def _result(report: Report) -> None:
    text = {
        OBSERVES: "kvobs will observe this engine",
        STEPS_ASIDE: "kvobs would step aside: the engine would run as without kvobs (exit 1)",
        CONFIG_ERROR: "fix the configuration above first (exit 2)",
    }[report.status]
    if report.status == STEPS_ASIDE and report.unchecked:
        text = "kvobs doctor could not check this vLLM: count on kvobs stepping aside (exit 1)"
    report.data["result"] = text
    report.lines.append(("result", text))


@contextlib.contextmanager
def _quiet_loggers() -> Iterator[None]:
    """vLLM's and kvobs's own log lines (vLLM's start-up chatter, kvobs's hot-path notice) stay out of the
    report: everything they would say is in it."""
    loggers = [logging.getLogger(name) for name in ("vllm", "kvobs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
