"""Suite-wide: the kinds of tests marked by folder, and no process of their own left behind (issue 21).

Marks by folder (pytest_collection_modifyitems below): every test in tests/unit is ``unit``, every
test in tests/engine is ``engine``; tests/integration, tests/reliability and tests/engine mark theirs
``vllm`` in their own conftest.py; ``slow`` and ``tools`` are marked test by test (pyproject.toml
says what each means). ``make check`` runs ``-m "not slow and not engine and not tools"``.

Leftover processes: a ``kvobs serve`` started by a demo test was still running an hour after
``make test`` ended, holding its port. Every process started during the session carries the session's
token in its environment (tests/support/leaks.py says how they are found); at the end of the session any live one other
than pytest itself is a leak: named with the test that started it, ended, and the session fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.leaks import SESSION_VAR, TEST_VAR, processes_of_this_session

TESTS = Path(__file__).resolve().parent
FOLDER_MARKS = {"unit": pytest.mark.unit, "engine": pytest.mark.engine}
"""tests/<folder> -> the mark every test collected there gets."""

GRACE_S = 5.0
"""Processes still ending when the session ends (a terminated child mid-exit) get this long."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VAR] = uuid.uuid4().hex


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (none today)
            continue
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    os.environ[TEST_VAR] = item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    if not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + GRACE_S
    leaked = processes_of_this_session()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = processes_of_this_session()
    if not leaked:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for pid, (test, cmdline) in sorted(leaked.items()):
        if reporter is not None:
            reporter.write_line(f"LEAKED PROCESS {pid} started by {test}: {cmdline}", red=True)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
