"""Write the log an engine in survive mode prints for two survived loads on one key, different causes.

Real parts, as tests/support/crash_log.py: the manager through the plugin (``survive`` on, armed as
kvobs's connector arms it), vLLM's logging configuration and process-name decoration, kvobs's lines
through vLLM's logging. The key is the same in every engine: ``key(1)``. First ``req-a-dpN``'s lookup
reports it and a store evicts it before the load (``evicted_after_lookup``); then ``req-b-dpN`` loads it
without a lookup that reported it (``coverage_mismatch``). Each load is recomputed, the engine runs on.

Usage: python -m tests.support.survive_log DP KVOBS_DIR   (output: stdout)
"""

from __future__ import annotations

import sys

from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
from vllm.utils.system_utils import decorate_logs
from vllm.v1.kv_offload.base import ReqContext

from kvobs.vllm.vllm_logging import join_vllm_logging
from tests.support.vllm_env import cpu_extra, create_manager, key, observed_extra


def main() -> None:
    dp, directory = int(sys.argv[1]), sys.argv[2]
    manager = create_manager(observed_extra(cpu_extra(2), dir=directory, engine=str(dp), survive=True))
    manager.survival.armed = True  # type: ignore[attr-defined]  # what kvobs's connector does
    configure_logging(LoggingConfig(formatter="text"))  # as EngineCore does
    join_vllm_logging()
    decorate_logs(f"EngineCore_DP{dp}")
    writer, first, second = ReqContext("req-writer"), ReqContext(f"req-a-dp{dp}"), ReqContext(f"req-b-dp{dp}")
    for context in (writer, first, second):
        manager.on_new_request(context)
    chunk = key(1)
    manager.prepare_store([chunk, key(2)], writer)
    manager.complete_store([chunk, key(2)], writer)
    assert manager.lookup(chunk, first).name == "HIT"
    manager.prepare_store([key(3), key(4)], writer)  # evicts the chunk after first's lookup
    manager.complete_store([key(3), key(4)], writer)
    manager.prepare_load([chunk], first)  # survived: evicted_after_lookup
    manager.complete_load([chunk], first)
    manager.prepare_load([chunk], second)  # survived: coverage_mismatch (no lookup reported it)
    manager.complete_load([chunk], second)
    manager.shutdown()


if __name__ == "__main__":
    main()
