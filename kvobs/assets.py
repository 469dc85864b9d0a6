"""``kvobs assets DIR``: the dashboards, rules and manifests, written out from an installed kvobs.

They live at the repository's top level (``dashboards/``, ``docker/``), outside the package; the wheel
carries a copy under ``kvobs/_assets/`` (setup.py's build step copies what :data:`ASSET_SOURCES`
selects), so nobody needs the repository to deploy. An editable install or a checkout has no copy
and reads the repository's own files. Written out, they keep the repository's layout, so the relative
paths between them (``docker/compose.yaml`` mounts ``../dashboards``, the kustomize overlays
``../../base``) hold in DIR as they do in the repository.

This module imports nothing of kvobs's: setup.py loads it by path before kvobs can be imported.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

ASSET_SOURCES: tuple[tuple[str, str], ...] = (
    ("dashboards", "the Grafana dashboard and its provisioning, the Prometheus alerting and recording "
                   "rules with their promtool tests"),
    ("docker/compose.yaml", "the whole stack for Docker Compose (its images are built from the source: "
                            "make image)"),
    ("docker/prometheus", "Prometheus scrape configurations (Docker Compose, Kubernetes without the Operator)"),
    ("docker/alertmanager", "Alertmanager routes for kvobs's alerts"),
    ("docker/otel-collector", "an OpenTelemetry Collector receiving the failure spans"),
    ("docker/k8s", "the kustomize base and overlays (kube-prometheus-stack, vLLM production-stack)"),
)
"""What ships, repository-relative (a folder or a file), and what it is: the one list of the assets."""
ASSET_SUFFIXES = frozenset({".json", ".yaml", ".yml", ".md", ".sh"})
"""Within those folders, the files an operator deploys; code (the generators) stays in the repository."""
NOT_ASSETS = frozenset({"dashboards/config.yaml"})
"""The generator's input (python -m dashboards.generate): of no use without the generator."""
PACKAGED = "_assets"
"""Where the wheel carries them, relative to the kvobs package."""


class AssetsError(Exception):
    """Why the assets cannot be written: one line, printed as is (exit status 2)."""


def select(root: Path) -> list[str]:
    """The asset files under ``root`` (a checkout or the packaged copy), as sorted '/'-separated paths."""
    found: list[str] = []
    for source, _ in ASSET_SOURCES:
        path = root / source
        if not path.exists():  # a tree without it (the images' build context): setup.py says so
            continue
        for candidate in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
            relative = candidate.relative_to(root).as_posix()
            if candidate.suffix in ASSET_SUFFIXES and relative not in NOT_ASSETS:
                found.append(relative)
    return sorted(found)


def asset_root() -> Path:
    """The packaged copy of an installed wheel, else the checkout this kvobs runs from (editable, source)."""
    package = Path(__file__).resolve().parent
    packaged = package / PACKAGED
    if packaged.is_dir():
        return packaged
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and all((checkout / source).exists() for source, _ in ASSET_SOURCES):
        return checkout
    raise AssetsError(f"this kvobs ({package}) was installed without its dashboards, rules and manifests "
                      "(built from a tree without dashboards/ and docker/); install kvobs's wheel from PyPI")


def write(directory: Path, *, force: bool = False) -> list[str]:
    """Copy every asset into ``directory`` (created if missing), keeping the layout and executable bits.

    Checks everything before writing anything: an existing file is left alone unless ``force``,
    so a second run never half-overwrites an operator's edited copies. Returns the paths written."""
    root = asset_root()
    files = select(root)
    if not files:
        raise AssetsError(f"no assets found under {root}")
    if directory.exists() and not directory.is_dir():
        raise AssetsError(f"{directory} exists and is not a directory")
    existing = [name for name in files if (directory / name).exists() or (directory / name).is_symlink()]
    blocked = [name for name in existing if (directory / name).is_dir()]
    if blocked:
        raise AssetsError(f"{directory / blocked[0]} is a directory where kvobs writes a file")
    if existing and not force:
        raise AssetsError(f"{directory} already holds {len(existing)} of the {len(files)} files (first: "
                          f"{existing[0]}); pass --force to overwrite them")
    try:
        for name in files:
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()  # write a file of our own, never through a link into somewhere else
            shutil.copyfile(root / name, target)
            if os.stat(root / name).st_mode & stat.S_IXUSR:
                target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError as exc:
        where = exc.filename if exc.filename else directory
        raise AssetsError(f"cannot write {where}: {exc.strerror or exc}") from None
    return files


def summary(directory: Path, files: list[str]) -> str:
    """What was written and where to start, for the terminal."""
    lines = [f"kvobs assets: wrote {len(files)} files to {directory}"]
    for source, what in ASSET_SOURCES:
        count = sum(1 for name in files if name == source or name.startswith(source + "/"))
        lines.append(f"  {source} ({count} {'file' if count == 1 else 'files'}): {what}")
    lines.append(f"Start with {directory / 'docker/k8s/README.md'} (Kubernetes) or the header of "
                 f"{directory / 'docker/compose.yaml'} (Docker Compose).")
    return "\n".join(lines)
