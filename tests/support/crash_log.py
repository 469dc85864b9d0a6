"""Write the log vLLM 0.33.0 itself prints when an EngineCore dies on a failed offload load.

Real parts: the manager (bare CPUOffloadingManager, or kvobs through the plugin), the
AssertionError it raises, vLLM's logging configuration and process-name decoration, and the
``logger.exception`` call EngineCore's busy loop makes (vllm/v1/engine/core.py). Output: stdout.

Usage: python -m tests.support.crash_log bare|kvobs missing|not_ready DP [KVOBS_DIR]
Environment: CRASH_LOG_FORMATTER=json for vLLM's JSON log formatter (``--logging-config.formatter
json``); CRASH_LOG_QUOTE_KEY=1 for a victim key whose repr uses double quotes (it holds a ``'``).
"""

from __future__ import annotations

import os
import sys

# Output is stdout whatever the environment says (a test process that ran `kvobs replay` in-process has
# VLLM_LOGGING_STREAM set to stderr, kvobs/cli.py's _replay): vLLM reads it at import.
os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stdout"

from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
from vllm.utils.system_utils import decorate_logs
from vllm.v1.kv_offload.base import ReqContext

from tests.support.vllm_env import cpu_extra, create_manager, key, observed_extra


def main() -> None:
    mode, state, dp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = cpu_extra(2)
    if mode == "kvobs":
        extra = observed_extra(extra, dir=sys.argv[4], engine=f"dp{dp}")
    manager = create_manager(extra)
    configure_logging(LoggingConfig(formatter=os.environ.get("CRASH_LOG_FORMATTER", "text")))  # as EngineCore does
    decorate_logs(f"EngineCore_DP{dp}")
    logger = init_logger("vllm.v1.engine.core")
    writer, victim = ReqContext("req-writer"), ReqContext("req-victim")
    first = key(int.from_bytes(b"'" * 32, "big")) if os.environ.get("CRASH_LOG_QUOTE_KEY") else key(1)
    for context in (writer, victim):
        manager.on_new_request(context)
    victim.set_offload_key_position(first, 48)
    manager.prepare_store([first, key(2)], writer)
    if state == "missing":
        manager.complete_store([first, key(2)], writer)
        assert manager.lookup(first, victim).name == "HIT"
        manager.prepare_store([key(3), key(4)], writer)  # evicts first after the victim's lookup
        manager.complete_store([key(3), key(4)], writer)
    try:
        manager.prepare_load([first], victim)
    except AssertionError:
        logger.exception("EngineCore encountered a fatal error.")
    manager.shutdown()


if __name__ == "__main__":
    main()
