"""Compiles kvobs's hot path (kvobs/hot_path.py) with mypyc; without a C compiler kvobs runs it as Python.

One source, two forms: the same module is the compiled extension and its pure-Python fallback
(kvobs/hot_path_loader.py picks one at import). A failed compile only warns.
"""

import os
import sys

from setuptools import setup


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


setup(ext_modules=hot_path_extensions())
