"""Builds kvobs's optional C accelerator (kvobs/_speedups.c); without a compiler kvobs runs in pure Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvobs._speedups",
            ["kvobs/_speedups.c"],
            optional=True,  # a failed build is a warning: kvobs.recorder falls back to Python
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
        )
    ]
)
