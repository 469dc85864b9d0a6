"""The supported vLLM releases are one fact (kvobs/versions.py); the places that restate it must agree.

A new release is one edit of ``SUPPORTED_VLLM`` plus whatever these tests then name.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvobs.versions import SUPPORTED_VLLM, minor

ROOT = Path(__file__).resolve().parents[2]
FIRST, LAST = SUPPORTED_VLLM[0], SUPPORTED_VLLM[-1]


def test_the_releases_are_distinct_and_oldest_first() -> None:
    assert list(map(minor, SUPPORTED_VLLM)) == sorted(set(map(minor, SUPPORTED_VLLM)))


def test_pyprojects_vllm_extra_has_the_oldest_release_as_its_floor_and_no_upper_bound() -> None:
    """A newer vLLM installs; kvobs observes it when its protocol check passes (kvobs.vllm.compat) and
    steps aside saying why when it does not: no hand-kept bound makes pip downgrade or refuse vLLM."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    first_major, first_minor = minor(FIRST)
    assert extra == [f"vllm>={first_major}.{first_minor}"]


def test_the_readme_states_the_supported_releases() -> None:
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"^Supported: \*\*vLLM ([^*]+)\*\*", readme, re.M)
    assert stated, "README lost its 'Supported: **vLLM ...**' line"
    assert re.split(r", | and ", stated[1]) == list(SUPPORTED_VLLM)
    table = re.findall(r"^\| (\d+\.\d+\.\d+) \| ", readme, re.M)  # the 'tested by make test' table
    assert sorted(table, key=minor) == list(SUPPORTED_VLLM)


def test_make_test_runs_every_supported_release() -> None:
    makefile = (ROOT / "Makefile").read_text()
    default = re.search(r"^VLLM_VERSION \?= (\S+)", makefile, re.M)
    older = re.search(r"^OLD_RELEASES \?= (.+)$", makefile, re.M)
    assert default and older
    assert default[1] == LAST  # the reference release, the whole suite runs on it
    assert sorted([default[1], *older[1].split()], key=minor) == list(SUPPORTED_VLLM)


def test_the_vllm_image_builds_on_the_release_make_test_runs() -> None:
    """docker/vllm.Dockerfile's default base (what compose builds) is the Makefile's VLLM_VERSION (what
    `make image` passes): the image carries the release the whole suite ran on."""
    makefile = (ROOT / "Makefile").read_text()
    default = re.search(r"^VLLM_VERSION \?= (\S+)", makefile, re.M)
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    base = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", dockerfile, re.M)
    assert default and base and base[1] == default[1] == LAST


def test_every_stated_range_of_releases_is_the_supported_one() -> None:
    """Prose that gives the range ("<first> to <last>", full release numbers) in the docs, pyproject, the code."""
    paths = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    for tree in ("kvobs", "tests", "benchmarks"):
        paths += sorted((ROOT / tree).rglob("*.py"))
    wrong = []
    for path in paths:
        for found in re.finditer(r"\b(\d+\.\d+\.\d+) to (\d+\.\d+\.\d+)\b", path.read_text()):
            if (found[1], found[2]) != (FIRST, LAST):
                wrong.append(f"{path.relative_to(ROOT)}: {found[0]}")
    assert wrong == [], f"the supported releases are {FIRST} to {LAST}"
