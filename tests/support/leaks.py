"""Find the live processes this test session started (issue 21), for the suite-wide check in tests/conftest.py.

Why here and not in conftest.py: a test of the check imports it (``tests.support.leaks``, as every
helper of the suite). An orphan is re-parented away from pytest, so looking at pytest's children does not
find it; its environment still does. Every process started during the session inherits
``SESSION_VAR`` (a token of this run) and ``TEST_VAR`` (the test that was running when it started).
"""

from __future__ import annotations

import os
from pathlib import Path

SESSION_VAR = "LEAKCHECK_SESSION"
TEST_VAR = "LEAKCHECK_NODEID"
"""Outside the ``KVOBS_`` and ``OTEL_`` prefixes on purpose: tests strip those to run a command as an operator
would (services.clean_env), and a stripped token hides the process from the check."""


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
