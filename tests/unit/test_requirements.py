"""The release venvs (Makefile: .venv-<release>) install requirements/kvobs-test.txt instead of kvobs
itself: it must name every dependency pyproject.toml gives kvobs, or a release venv would lack one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _names(lines: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in lines if line.strip() and not line.lstrip().startswith("#")}


def test_release_venvs_get_every_dependency_of_kvobs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"] + project["optional-dependencies"]["otlp"])
    wanted |= {"pytest", "hypothesis", "pyyaml", "opentelemetry-proto", "libfaketime"}  # what the release tests import
    have = _names((ROOT / "requirements" / "kvobs-test.txt").read_text().splitlines())
    assert wanted <= have, wanted - have


def test_every_supported_release_has_its_requirements() -> None:
    makefile = (ROOT / "Makefile").read_text()
    default = re.search(r"^VLLM_VERSION \?= (\S+)", makefile, re.M)
    older = re.search(r"^OLD_RELEASES \?= (.+)$", makefile, re.M)
    assert default and older
    for release in [default[1], *older[1].split()]:
        assert (ROOT / "requirements" / f"vllm-{release}.txt").is_file(), release


def test_no_requirement_points_at_a_local_file() -> None:
    """A ``pip freeze`` of a package installed from a local wheel writes ``name @ file:///...``, a path
    only the machine that froze it has (it broke a clean-clone ``make test`` once)."""
    files = sorted((ROOT / "requirements").glob("*.txt"))
    assert files
    local = [f"{path.name}: {line}" for path in files for line in path.read_text().splitlines()
             if re.search(r"@\s*file:|^\s*(/|\./|file:)", line)]
    assert local == []
