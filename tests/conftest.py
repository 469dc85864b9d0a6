"""Suite-wide check: the tests leave no process of their own behind (issue 21).

Why: a ``kvobs serve`` started by a demo test was still running an hour after ``make test`` ended,
holding its port. An orphan is re-parented away from pytest, so looking at pytest's children
does not find it; its environment still does. Every process started during the session inherits
``KVOBS_TEST_SESSION`` (a token of this run) and ``KVOBS_TEST_NODEID`` (the test that was
running when it started); at the end of the session any live process carrying the token, other
than pytest itself, is a leak: named with the test that started it, ended, and the session fails.
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

SESSION_VAR = "KVOBS_TEST_SESSION"
TEST_VAR = "KVOBS_TEST_NODEID"
GRACE_S = 5.0
"""Processes still ending when the session ends (a terminated child mid-exit) get this long."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VAR] = uuid.uuid4().hex


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    os.environ[TEST_VAR] = item.nodeid


def processes_of_this_session() -> dict[int, tuple[str, str]]:
    """pid -> (the test that started it, its command line) of live processes carrying this session's token."""
    token = f"{SESSION_VAR}={os.environ.get(SESSION_VAR, '')}".encode()
    found: dict[int, tuple[str, str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if token not in environ:
                continue
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        if state in ("Z", "X"):  # ended, waiting to be reaped: not running
            continue
        test = next((v.decode(errors="replace").partition("=")[2] for v in environ
                     if v.startswith(f"{TEST_VAR}=".encode())), "before the first test")
        found[int(proc.name)] = (test, cmdline[:300])
    return found


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
