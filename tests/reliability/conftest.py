"""Reliability tests drive the installed vLLM's real managers; they reuse the integration helpers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import figures


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "reliability" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the reliability tests tried and measured (the figures in docs/reliability.md)."""
    found = figures.lines()
    if found:
        terminalreporter.section("kvobs reliability figures")
        for line in found:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def kvobs_logger_enabled() -> Iterator[None]:
    """The fault tests assert "logged once"; other code in the session may have disabled the logger."""
    logger = logging.getLogger("kvobs")
    saved = logger.disabled, logger.level
    logger.disabled, logger.level = False, logging.NOTSET
    yield
    logger.disabled, logger.level = saved
