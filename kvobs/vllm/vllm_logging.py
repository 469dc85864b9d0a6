"""kvobs's log records inside vLLM's processes go through vLLM's own logging.

vLLM configures the ``vllm`` logger (its handler, its format with the process name, pid, level,
time and file; JSON with ``--logging-config`` / ``VLLM_LOGGING_CONFIG_PATH``; its level) and nothing
else. Without this, kvobs's ``kvobs`` logger has no handler inside vLLM, and its lines reach stderr
through Python's last-resort handler, bare, unlike every line around them. :func:`join_vllm_logging`
gives the ``kvobs`` logger one handler that hands each record to the ``vllm`` logger's handlers as
they are at that moment (vLLM reconfigures logging when it spawns EngineCore), at vLLM's level
(the ``vllm`` logger's, not the root logger's).
``kvobs serve`` and ``kvobs explain`` never import this package and keep their own logging.
"""

from __future__ import annotations

import logging

KVOBS_LOGGER = "kvobs"
VLLM_LOGGER = "vllm"


def _propagated_handlers(logger: logging.Logger) -> set[logging.Handler]:
    """The handlers of ``logger``'s ancestors that its records propagate to."""
    reached: set[logging.Handler] = set()
    current = logger
    while current.propagate and current.parent is not None:
        current = current.parent
        reached.update(current.handlers)
    return reached


class ThroughVllmHandler(logging.Handler):
    """Emits a kvobs record with whatever handlers the ``vllm`` logger has, if it has any."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM_LOGGER)
        if target.handlers:
            if target.isEnabledFor(record.levelno) and not target.disabled:
                # vLLM's handlers, but none the record reaches anyway by the kvobs logger's own
                # propagation (the root's; a test harness's capture handlers on both): once each.
                reached = _propagated_handlers(logging.getLogger(KVOBS_LOGGER))
                for handler in target.handlers:
                    if handler not in reached and record.levelno >= handler.level:
                        handler.handle(record)
        elif (  # vLLM left logging alone: as if kvobs had set no handler
            not logging.getLogger().handlers
            and logging.lastResort is not None
            and record.levelno >= logging.lastResort.level
        ):
            logging.lastResort.handle(record)


def join_vllm_logging() -> None:
    """Routes the ``kvobs`` logger through vLLM's logging (once; not when someone gave it handlers).

    vLLM's level decides which records pass, as for vLLM's own: the handler asks the ``vllm``
    logger, and the ``kvobs`` logger itself lets every record through to it (unless someone set its
    level). Left at NOTSET, its level would be the root logger's, which is not vLLM's: vLLM 0.30's
    EngineCore runs with the root logger at ERROR, which silently dropped kvobs's warnings there.
    """
    kvobs_logger = logging.getLogger(KVOBS_LOGGER)
    if kvobs_logger.handlers:
        return
    kvobs_logger.addHandler(ThroughVllmHandler())
    if kvobs_logger.level == logging.NOTSET:
        kvobs_logger.setLevel(logging.DEBUG)
