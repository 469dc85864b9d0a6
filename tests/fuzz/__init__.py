"""Coverage-guided fuzz targets (atheris): one module per reader of outside bytes, ``fuzz_<target>.py``, each
with a ``TestOneInput(data: bytes)``; ``python -m tests.fuzz.run`` runs them, tests/fuzz/test_fuzz.py replays
their corpus and regression inputs and runs each for a short while (docs/reliability.md, "Fuzzing")."""
