"""The suite's leftover-process check (tests/conftest.py, tests/support/leaks.py) sees what the tests start.

Why: the check finds a process by a token in its environment; a test helper that drops the token
(clean_env() strips every ``KVOBS_*`` variable, as an operator's shell has none) would hide a leaked
``kvobs serve`` from it. Each helper that builds a child's environment is tried with a real process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.support.leaks import processes_of_this_session
from tests.support.services import clean_env

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


ENVIRONMENTS: dict[str, Callable[[], dict[str, str] | None]] = {
    "inherited": lambda: None,
    "clean_env": clean_env,
    "clean_env_with_settings": lambda: clean_env(KVOBS_DIR="/nonexistent", KVOBS_PORT="1"),
}


@pytest.mark.parametrize("helper", ENVIRONMENTS)
def test_the_leak_check_sees_a_process_started_with_each_helpers_environment(helper: str) -> None:
    proc = subprocess.Popen(SLEEPER, env=ENVIRONMENTS[helper]())  # built now: the test's id is in os.environ
    try:
        # A process just forked may not show its environment yet (/proc/<pid>/environ is read as it execs):
        # look again for a while, as the leak check itself only runs long after a test started its processes.
        deadline = time.monotonic() + 10
        seen = processes_of_this_session()
        while proc.pid not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = processes_of_this_session()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.pid in seen, f"the leak check cannot see a process started with {helper}'s environment"
    assert seen[proc.pid][0] == os.environ["PYTEST_CURRENT_TEST"].rpartition(" ")[0]
