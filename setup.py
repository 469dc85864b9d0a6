"""Compiles kvobs's hot path with mypyc and its capture ring from C; puts the dashboards, rules and manifests in the wheel.

The hot path is the modules kvobs/hot_path_modules.py lists, compiled together (one group, one shared
library: kvobs/hot_path__mypyc). One source, two forms: the same modules are the compiled extensions and
their pure-Python fallback (kvobs/hot_path_loader.py picks one at import). A failed compile only warns.

The assets stay where the repository keeps them (dashboards/, docker/); the build copies the files that
kvobs/assets.py selects into the package (kvobs/_assets/), and lists them as sources so that the sdist
carries them too (a wheel built from it then has them). ``kvobs assets DIR`` writes them out.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
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
        sources = [os.path.join("kvobs", f"{name}.py") for name in by_path("hot_path_modules.py").HOT_PATH_MODULES]
        extensions = mypycify(["--follow-imports=skip", *sources], opt_level="3", group_name="kvobs.hot_path")
    except Exception as exc:  # a mypyc failure must not stop the install: kvobs runs the Python form
        print(f"kvobs: compiling the hot path failed ({exc!r}); it will run as Python", file=sys.stderr)
        return []
    for extension in extensions:
        extension.optional = True  # no C compiler: a warning, not a failed install
    return extensions


def by_path(name: str) -> ModuleType:
    """kvobs/<name>, loaded by path: its lists are the ones the build uses (kvobs is not importable yet)."""
    spec = importlib.util.spec_from_file_location(f"_kvobs_{name.removesuffix('.py')}", os.path.join("kvobs", name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assets() -> ModuleType:
    """kvobs/assets.py: its list of assets is the one the build uses."""
    return by_path("assets.py")


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


def c_extensions() -> list:
    """kvobs/hot_path_modules.py's C_MODULES (the capture ring: kvobs/capture_ring.py has its Python form, which
    runs where it is not built)."""
    if os.environ.get("KVOBS_NO_COMPILE", "") not in ("", "0"):
        return []
    return [Extension(f"kvobs.{name}", [os.path.join("kvobs", f"{name}.c")], optional=True)
            for name in by_path("hot_path_modules.py").C_MODULES]


setup(ext_modules=[*hot_path_extensions(), *c_extensions()], cmdclass={"build_py": BuildPyWithAssets})
