"""Run the fuzz targets with atheris (libFuzzer, coverage-guided over kvobs's own modules).

    python -m tests.fuzz.run --seconds N [target ...]     each target for N seconds (default: all targets)

Each target runs in a process of its own (``--worker``), kvobs's modules instrumented for coverage,
starting from its committed corpus (tests/fuzz/corpus/<target>/) and its regression inputs
(tests/fuzz/crashes/<target>/), each run first; new corpus entries go to a scratch folder (``--work``,
default build/fuzz/<target>/), never into the committed corpus. A crash (an exception outside the target's
contract, an input that takes more than ``--input-timeout`` seconds, more than ``--rss-mb`` of memory) stops
the target and its input is written to ``--crashes``/<target>/ (default tests/fuzz/crashes/): a regression
input once fixed. Exit status: 0 when every target ran its time without a crash, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TARGETS = ("wire", "report", "bundle", "explain", "sidecar")
MAX_LEN = 16_384
"""The largest input libFuzzer makes (bytes): the seeds are a few KiB; a bound keeps each run fast."""


def _worker(target: str, libfuzzer_args: list[str]) -> None:
    import atheris  # only here: the targets and their corpus replay (test_fuzz.py) do without it

    from tests.fuzz._scratch import quiet

    quiet()  # in the fuzzing process only: imported by pytest, a target must leave logging as it is
    with atheris.instrument_imports(include=["kvobs", "tests.fuzz"]):
        module = importlib.import_module(f"tests.fuzz.fuzz_{target}")
    atheris.Setup([sys.argv[0], *libfuzzer_args], module.TestOneInput)
    atheris.Fuzz()


def run_target(target: str, seconds: int, work: Path, crashes: Path, input_timeout: int, rss_mb: int) -> int:
    """Fuzz one target for ``seconds`` in a subprocess; its exit status (0: no crash)."""
    scratch = work / target
    scratch.mkdir(parents=True, exist_ok=True)
    found = crashes / target
    found.mkdir(parents=True, exist_ok=True)
    seeds = [str(d) for d in dict.fromkeys((HERE / "corpus" / target, HERE / "crashes" / target, found)) if d.is_dir()]
    args = [f"-max_total_time={seconds}", f"-timeout={input_timeout}", f"-rss_limit_mb={rss_mb}",
            f"-malloc_limit_mb={rss_mb}", f"-max_len={MAX_LEN}", f"-artifact_prefix={found}/",
            "-print_final_stats=1", str(scratch), *seeds]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.run", "--worker", target, "--", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=False)
    print(f"fuzz {target}: exit {proc.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1], [a for a in argv[2:] if a != "--"])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", choices=[*TARGETS, []], metavar="TARGET",
                        help=f"targets to run (default: all of {', '.join(TARGETS)})")
    parser.add_argument("--seconds", type=int, default=60, help="how long each target runs (default 60)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "fuzz", help="scratch corpus folder")
    parser.add_argument("--crashes", type=Path, default=HERE / "crashes", help="where crashing inputs go")
    parser.add_argument("--input-timeout", type=int, default=10, help="seconds one input may take (default 10)")
    parser.add_argument("--rss-mb", type=int, default=2048, help="memory a target may use (default 2048 MiB)")
    args = parser.parse_args(argv)
    failed = [t for t in (args.targets or TARGETS)
              if run_target(t, args.seconds, args.work, args.crashes, args.input_timeout, args.rss_mb) != 0]
    if failed:
        print(f"fuzz: crashes in {', '.join(failed)} (inputs under {args.crashes}/<target>/)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
