"""`make test` runs kvobs with its C hot path (kvobs/_speedups.c), and KVOBS_PURE_PYTHON=1 runs it
without: a build that silently fell back to Python must fail here, not pass slower."""

from __future__ import annotations

import os

from kvobs.observer import Observer
from kvobs.recorder import PyRecorder, speedups_available


def test_the_hot_path_in_use_is_the_one_asked_for() -> None:
    recorder = Observer().recorder
    if os.environ.get("KVOBS_PURE_PYTHON", "") not in ("", "0"):
        assert isinstance(recorder, PyRecorder) and not speedups_available()
    else:
        assert speedups_available(), (
            "kvobs._speedups is not built: `pip install -e .` needs a C compiler and Python's headers "
            "(Debian: gcc python3-dev); kvobs then runs in pure Python, correct but slower"
        )
        assert type(recorder).__module__ == "kvobs._speedups"
