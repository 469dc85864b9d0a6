"""The hot path's modules, each ``kvobs/<name>.py``, those a module imports before it; and the C modules.

setup.py compiles them with mypyc in one group (one shared library: calls between them stay native);
kvobs/hot_path_loader.py runs them all as source when the Python form is asked for (never a mix); the
Makefile's install stamp depends on them. Imports nothing: setup.py and the Makefile read it by path.
"""

HOT_PATH_MODULES = ("hot_promises", "hot_captures", "hot_taps", "hot_path")

C_MODULES = ("_capture_ring",)
"""kvobs's modules written in C, each ``kvobs/<name>.c``, built by setup.py beside the hot path (each with a
Python form that runs where it is not built: kvobs/capture_ring.py)."""
