"""Integration tests drive the installed vLLM's real offloading managers on CPU (any supported release;
``make test`` runs them on each, kvobs.versions.SUPPORTED_VLLM)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture
def managers() -> Iterator[list]:
    """Collects managers built by a test and shuts them down (frees /dev/shm)."""
    made: list = []
    yield made
    for manager in made:
        manager.shutdown()
