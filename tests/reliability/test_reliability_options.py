"""Bad kvobs configuration fails at start-up, through vLLM's real spec factory, naming the option.

Extends tests/integration/test_plugin.py and tests/unit/test_options.py with the
cases they leave out: every option's wrong types and ranges, booleans and floats
passed for integers, a bad inner spec module path, a class that is not an
offloading spec, and a tracer provider given as JSON (which would otherwise only
fail at the first failed load). Both vLLM paths are checked: EngineCore's
``OffloadingSpecFactory.create_spec`` and the API server's classmethod
``build_metric_definitions``.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvobs
from kvobs.options import OptionError
from tests.support.vllm_env import cpu_extra, create_spec, tiering_extra


def plugin_extra(kvobs_section: Any, inner: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**(inner or cpu_extra(2)), "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
            "kvobs": kvobs_section}


@pytest.mark.parametrize(
    ("section", "pattern"),
    [
        ({"history-size": 4096}, "unknown kvobs option 'history-size'; known options: history_size"),
        ({"history_size": 4096.0}, "'history_size' must be an integer, got 4096.0"),
        ({"history_size": True}, "'history_size' must be an integer, got True"),
        ({"history_size": None}, "'history_size' must be an integer, got None"),
        ({"history_size": -1}, r"'history_size' must be in \[1024, "),
        ({"max_verdicts": 0}, r"'max_verdicts' must be in \[1, "),
        ({"max_verdicts": 10**9}, r"'max_verdicts' must be in \[1, "),
        ({"max_verdicts": "many"}, "'max_verdicts' must be an integer"),
        ({"dir": 3}, "'dir' must be a non-empty string, got 3"),
        ({"dir": ""}, "'dir' must be a non-empty string"),
        ({"engine": ["dp0"]}, "'engine' must be a non-empty string"),
        ({"tracer_provider": "otlp"}, "'tracer_provider' must be an OpenTelemetry TracerProvider"),
        ({"inner_spec_module_path": 5}, "'inner_spec_module_path' must be a non-empty string"),
        ({"inner_spec": ""}, "'inner_spec' must be a non-empty string"),
        ({"inner_spec": "OffloadingManager", "inner_spec_module_path": "vllm.v1.kv_offload.base"},
         "'inner_spec': cannot load offloading spec 'OffloadingManager'"),
        ({"inner_spec": "NoSuchSpec", "inner_spec_module_path": "kvobs.vllm"},
         "'inner_spec': cannot load offloading spec 'NoSuchSpec' from 'kvobs.vllm'"),
        ("history_size=4096", r"kv_connector_extra_config\['kvobs'\] must be an object, got str"),
    ],
)
@pytest.mark.parametrize("inner", ["cpu", "tiering"])
def test_bad_option_fails_at_start_up_naming_it(section: Any, pattern: str, inner: str) -> None:
    extra = plugin_extra(section, cpu_extra(2) if inner == "cpu" else tiering_extra(2))
    with pytest.raises(OptionError, match=pattern):  # EngineCore: the spec is built at start-up
        create_spec(extra)
    with pytest.raises(OptionError, match=pattern):  # the API server's path
        OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
    with pytest.raises(OptionError, match=pattern):
        OffloadingSpecFactory.get_spec_cls(extra).config_info_keys(extra)


def test_observe_rejects_the_same_bad_options_by_name() -> None:
    from tests.support.vllm_env import create_manager

    manager = create_manager(cpu_extra(2))
    try:
        with pytest.raises(OptionError, match=r"unknown kvobs.observe\(\) option 'histroy'"):
            kvobs.observe(manager, histroy=5)
        with pytest.raises(OptionError, match="'tracer_provider' must be an OpenTelemetry TracerProvider"):
            kvobs.observe(manager, tracer_provider={"endpoint": "x"})
    finally:
        manager.shutdown()


def test_a_good_section_still_builds() -> None:
    """The checks above are not simply refusing everything."""
    from opentelemetry.sdk.trace import TracerProvider

    spec = create_spec(plugin_extra({"history_size": 4096, "max_verdicts": 10, "engine": "dp3"}))
    manager = spec.get_manager()
    try:
        assert manager.observer.options.history_size == 4096  # type: ignore[attr-defined]
    finally:
        manager.shutdown()
    from tests.support.vllm_env import create_manager

    observed = kvobs.observe(create_manager(cpu_extra(2)), tracer_provider=TracerProvider())
    observed.shutdown()
