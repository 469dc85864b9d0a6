"""``kvobs demo``: kvobs explaining failed loads on the installed vLLM's real offloading stack, on CPU.

Starts the sidecar, serves traffic through the real ``OffloadingConnectorScheduler`` and the
``ObservedOffloadingSpec`` plugin on three engines (a CPU spec; tiering with vLLM's file tier, twice; see
``kvobs.demo.workload`` for what happens there and what is injected), prints each
explanatory message as it happens, and ends with a summary and where to look.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from kvobs.children import Stopped, ends_with_signals, start_child, stop_child, stops_deferred
from kvobs.versions import SUPPORTED_VLLM, minor
from kvobs.wire.decode import report_files

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvobs.demo.workload import EngineRun, EngineSetup, Workload

WIDTH = 100


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def _sidecar_totals(url: str) -> dict[str, float]:
    """Sums of the sidecar's counters the summary checks against the engines' own."""
    totals = {"kvobs_evicted_chunks": 0.0, "kvobs_load_failures": 0.0, "kvobs_hits_evicted_before_load": 0.0}
    for family in text_string_to_metric_families(_get(f"{url}/metrics").decode()):
        if family.name in totals:
            totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def _nonzero(counts: Mapping[str, int]) -> str:
    shown = {k: v for k, v in counts.items() if v}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) or "none"


class Console:
    """Progress on one line when stdout is a terminal; whole lines otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._last_line = 0.0
        self._partial = False

    def line(self, text: str = "") -> None:
        if self._partial:
            print()
            self._partial = False
        print(text, flush=True)

    def progress(self, run: EngineRun, total: int) -> None:
        text = (f"  {run.setup.engine}: {run.requests}/{total} requests, {run.steps} steps, "
                f"{sum(run.evicted.values())} chunks evicted, {sum(run.failures.values())} failed loads")
        if self.tty:
            print(f"\r{text}", end="", flush=True)
            self._partial = True
        elif time.monotonic() - self._last_line > 2.0:
            self._last_line = time.monotonic()
            self.line(text)


def _engine_setups(args: argparse.Namespace) -> list[EngineSetup]:
    from kvobs.demo.workload import CPU_ENGINE, INCIDENT_ENGINE, PRODUCTION_ENGINE

    return [CPU_ENGINE] if args.no_tiering else [CPU_ENGINE, PRODUCTION_ENGINE, INCIDENT_ENGINE]


INCIDENTS = {
    "promotion_after_deferral": "a hit counted in one lookup pass, evicted by a promotion in the next",
    "promotion_evicts_hit": "the request pattern of vLLM #50014",
}


def _port_in_use(port: int) -> bool:
    """True if something listens on 127.0.0.1:port (binding as the sidecar does: TIME_WAIT is no obstacle)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


SIDECAR_LOG = "sidecar.log"
"""The demo's sidecar logs into its directory: a pipe nobody reads stops a sidecar once full (it logs a
line per failure report)."""


def _start_sidecar(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """``kvobs serve`` as a child that ends with the demo, whatever ends the demo (``kvobs.children``);
    its log appended to ``directory / SIDECAR_LOG``."""
    with open(directory / SIDECAR_LOG, "ab") as log:
        return start_child(
            [sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=log,
        )


def _wait_until_up(sidecar: subprocess.Popen[bytes], url: str, directory: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sidecar.poll() is not None:
            err = (directory / SIDECAR_LOG).read_bytes()[-4000:].decode(errors="replace")
            raise RuntimeError(f"the sidecar exited ({sidecar.returncode}): {err.strip()[-500:]}")
        try:
            _get(f"{url}/healthz")
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the sidecar did not answer at {url}/healthz within {timeout:.0f}s")


def run_demo(args: argparse.Namespace) -> int:
    """The demo; SIGTERM and SIGHUP end it as Ctrl-C does, its sidecar with it."""
    with ends_with_signals():
        return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    # Port first, vLLM after: importing vLLM (and torch) takes 10-20 s, and a taken port must not
    # wait for that. Else our sidecar dies on the bound port while the other one answers /healthz,
    # and the summary is checked against a sidecar that never reads this demo's directory.
    if _port_in_use(args.port):
        print(f"kvobs demo: port {args.port} is in use (another kvobs sidecar, e.g. the compose stack?); "
              "pass --port", file=sys.stderr)
        return 2
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvobs-demo-"))
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # the sidecar refuses a directory that does not exist
    earlier_runs = any((directory / "journal").glob("*.jsonl"))  # the sidecar will count those too
    url = f"http://127.0.0.1:{args.port}"
    console = Console()
    console.line(f"kvobs demo: starting the sidecar on 127.0.0.1:{args.port} and loading vLLM "
                 "(importing vLLM and torch takes 10-20 s) ...")
    sidecar = _start_sidecar(directory, args.port)  # it starts while vLLM loads
    try:
        started = time.monotonic()
        with stops_deferred():  # a stop signal during these imports ends the demo after them
            from vllm import __version__ as vllm_version

            from kvobs.demo.workload import Workload

        # The demo prints each message itself; vLLM's own warnings (e.g. a prompt too long to
        # store in the small CPU tier) would bury them. After the import: vLLM sets its level then.
        logging.getLogger("kvobs").setLevel(logging.CRITICAL)
        logging.getLogger("vllm").setLevel(logging.ERROR)
        console.line(f"kvobs demo: vLLM {vllm_version} loaded in {time.monotonic() - started:.1f} s")
        _wait_until_up(sidecar, url, directory)
        console.line(f"kvobs demo on vLLM {vllm_version}: the real OffloadingConnectorScheduler and offload managers, "
                     "on CPU")
        console.line(f"  sidecar:  {url}/metrics   kvobs directory: {directory}")
        otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        console.line(f"  traces:   {'OTLP to ' + otlp if otlp else 'not exported (set OTEL_EXPORTER_OTLP_ENDPOINT)'}")
        workload = Workload(requests=args.requests, seed=args.seed, duration_s=args.duration)
        runs = [_run_one(setup, workload, directory, console) for setup in _engine_setups(args)]
        _summary(console, runs, url, directory, earlier_runs)
        if args.keep_serving:
            console.line(f"\nThe sidecar keeps serving {url}/metrics; point Prometheus at it. Ctrl-C to stop.")
            sidecar.wait()
        return 0
    except Stopped as stopped:
        return stopped.exit_status
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        console.line()
        print(f"kvobs demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_child(sidecar)


def _run_one(setup: EngineSetup, workload: Workload, directory: Path, console: Console) -> EngineRun:
    from kvobs.demo.workload import run_engine
    console.line(f"\n[{setup.engine}] {setup.describe()}")
    if setup.allocator_retained_tokens:
        console.line(textwrap.fill(
            f"injected: the allocator keeps {setup.allocator_retained_tokens} tokens of sliding-window history that "
            "the connector's lookup does not check (the range disagreement of vLLM #56701)",
            WIDTH, initial_indent="  ", subsequent_indent="  "))
    if setup.incident:
        console.line(f"  first requests: {INCIDENTS[setup.incident]} (nothing injected)")
    shown: set[str] = set()

    def on_failure(exc: AssertionError, request: Request) -> None:
        text = str(exc)
        cause = text.rsplit("cause: ", 1)[-1].split(" ", 1)[0]
        if cause in shown:
            return
        shown.add(cause)
        console.line(f"\n  {request.request_id}: prepare_load() failed. vLLM's engine would die here; kvobs says:")
        console.line(textwrap.fill(f"AssertionError: {text}", WIDTH, initial_indent="    ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False))
        console.line("  (further failures with this cause are counted, not printed)\n")

    run = run_engine(setup, workload, str(directory), lambda r: console.progress(r, workload.requests), on_failure)
    if setup.incident and not run.incident_failed:
        paths = ", ".join(f"{path} {n}" for path, n in sorted(run.removals_by_path.items(), key=lambda p: -p[1]))
        console.line(textwrap.fill(
            f"  the first requests' pattern does not fail on vLLM {_release_text()} (it does on "
            f"{_releases_text(setup)}); kvobs counted instead: near misses "
            f"{_nonzero(run.near_misses)}; removal batches by the call they happened in: {paths}",
            WIDTH, subsequent_indent="    "))
    return run


def _release_text() -> str:
    from kvobs.vllm import compat

    return compat.VLLM_VERSION


def _releases_text(setup: EngineSetup) -> str:
    failing = [f"{major}.{part}" for major, part in map(minor, SUPPORTED_VLLM)
               if setup.fails_from <= (major, part) <= setup.fails_until]
    return ", ".join(failing) or "none of the supported releases"


def _summary(console: Console, runs: list[EngineRun], url: str, directory: Path, earlier_runs: bool) -> None:
    console.line("\nsummary")
    for run in runs:
        console.line(f"  {run.setup.engine} ({run.setup.spec}): {run.requests} requests in {run.seconds:.1f}s")
        console.line(f"    evicted chunks: {_nonzero(run.evicted)}")
        console.line(f"    the CPU tier, in chunks: {_nonzero(run.tier)}")
        console.line(f"    near misses (hits evicted before their load): {_nonzero(run.near_misses)}")
        console.line(f"    failed loads by cause: {_nonzero(run.failures)}")
        if run.setup.incident:
            console.line(f"    removal batches by call: {_nonzero(run.removals_by_path)}")
    expected = {
        "kvobs_evicted_chunks": sum(sum(r.evicted.values()) for r in runs),
        "kvobs_load_failures": sum(sum(r.failures.values()) for r in runs),
        "kvobs_hits_evicted_before_load": sum(sum(r.near_misses.values()) for r in runs),
    }
    def consistent(seen: dict[str, float]) -> bool:
        if earlier_runs:  # the directory held earlier runs: the sidecar counts them as well
            return all(seen[name] >= value for name, value in expected.items())
        return seen == expected

    deadline = time.monotonic() + 10
    seen = _sidecar_totals(url)
    while not consistent(seen) and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = _sidecar_totals(url)
    if not consistent(seen):
        agree = f"DISAGREES (sidecar {seen}, engines {expected})"
    else:
        agree = "counts this run and the earlier ones in this directory" if earlier_runs else "agrees"
    console.line(f"  the sidecar {agree}: {int(seen['kvobs_evicted_chunks'])} evicted, "
                 f"{int(seen['kvobs_load_failures'])} failed loads, "
                 f"{int(seen['kvobs_hits_evicted_before_load'])} near misses")
    reports = len(report_files(directory / "failures"))
    console.line("\nwhere to look")
    console.line(f"  metrics:          {url}/metrics")
    console.line(f"  failure reports:  {directory / 'failures'} ({reports} files), {url}/api/v1/failures")
    console.line(f"  explain a log:    kvobs explain --dir {directory} vllm.log")
    console.line("  dashboards:       dashboards/ (Grafana; see README, 'Dashboards, alerts, deployment')")
