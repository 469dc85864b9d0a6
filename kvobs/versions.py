"""The vLLM releases kvobs supports, defined once and importable without vLLM (the demo, the docs check).

A new release: add it here, teach ``kvobs/vllm/compat.py`` what differs, and follow what
tests/unit/test_supported_releases.py flags (pyproject's ``vllm`` extra, the README, the Makefile's
release venvs).
"""

from __future__ import annotations

SUPPORTED_VLLM: tuple[str, ...] = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""Oldest first. Differences between them are detected by feature, never by this list (compat.py)."""


def minor(release: str) -> tuple[int, int]:
    """(major, minor) of a release such as ``"0.33.0"``."""
    major, minor_part = release.split(".")[:2]
    return int(major), int(minor_part)
