"""Compiles kvobs's hot path (kvobs/hot_path.py) with mypyc; puts the dashboards, rules and manifests in the wheel.

One source, two forms: the same module is the compiled extension and its pure-Python fallback
(kvobs/hot_path_loader.py picks one at import). A failed compile only warns.

The assets stay where the repository keeps them (dashboards/, docker/); the build copies the files that
kvobs/assets.py selects into the package (kvobs/_assets/), and lists them as sources so that the sdist
carries them too (a wheel built from it then has them). ``kvobs assets DIR`` writes them out.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py


def hot_path_extensions() -> list:
    if os.environ.get("KVOBS_NO_COMPILE", "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        print(f"kvobs: mypyc not available ({exc}); the hot path will run as Python", file=sys.stderr)
        return []
    try:
        extensions = mypycify(["--follow-imports=skip", "kvobs/hot_path.py"], opt_level="3")
    except Exception as exc:  # a mypyc failure must not stop the install: kvobs runs the Python form
        print(f"kvobs: compiling the hot path failed ({exc!r}); it will run as Python", file=sys.stderr)
        return []
    for extension in extensions:
        extension.optional = True  # no C compiler: a warning, not a failed install
    return extensions


def assets() -> ModuleType:
    """kvobs/assets.py, loaded by path: its list of assets is the one the build uses (kvobs is not importable yet)."""
    spec = importlib.util.spec_from_file_location("_kvobs_assets", os.path.join("kvobs", "assets.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithAssets(build_py):
    """build_py, plus a copy of the assets in the package: what a wheel installs carries them."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's own files (kvobs/assets.py)
            return
        module = assets()
        missing = [source for source, _ in module.ASSET_SOURCES if not Path(source).exists()]
        if missing:  # e.g. the Docker images' build context: the engine and the sidecar need no assets
            print(f"kvobs: {', '.join(missing)} not in the source tree; `kvobs assets` will not have them",
                  file=sys.stderr)
        for name in module.select(Path(".")):
            target = os.path.join(self.build_lib, "kvobs", module.PACKAGED, name)
            self.mkpath(os.path.dirname(target))
            self.copy_file(name, target)  # keeps the mode: helm-post-renderer/post-render.sh stays executable

    def get_source_files(self) -> list[str]:
        return [*super().get_source_files(), *assets().select(Path("."))]


setup(ext_modules=hot_path_extensions(), cmdclass={"build_py": BuildPyWithAssets})
