"""``kvobs demo``: kvobs explaining failed loads on the installed vLLM's real offloading stack, on CPU.

Starts the sidecar, serves traffic through the real ``OffloadingConnectorScheduler`` and the
``ObservedOffloadingSpec`` plugin on three engines (a CPU spec; tiering with vLLM's file tier, twice; see
``demo.workload`` for what happens there and what is injected), prints each
explanatory message as it happens, and ends with a summary and where to look.

The ``demo`` package is the source repository's, not the wheel's: it holds the demo, its injected defects
(``demo.defects``) and the stand-in CPU transfer worker (``demo.cpu_worker``). ``kvobs demo`` (kvobs/cli.py)
finds it beside the kvobs it runs; from the wheel it says to run ``make demo`` in a clone.
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
from typing import TYPE_CHECKING, TextIO

from prometheus_client.parser import text_string_to_metric_families

from kvobs.children import Stopped, ends_with_signals, start_child, stop_child, stops_deferred
from kvobs.versions import SUPPORTED_VLLM, minor
from kvobs.wire.decode import report_files
from kvobs.wire.format import FAILURES_DIR, report_time_ms

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from demo.workload import EngineRun, EngineSetup, Workload

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
    from demo.workload import CPU_ENGINE, INCIDENT_ENGINE, PRODUCTION_ENGINE

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


class BadDir(Exception):
    """``--dir`` cannot be used; the message names the path and the problem (the demo exits 2 with it)."""


def prepare_dir(path: Path) -> Path:
    """``path``, made (0700, parents too) if need be and checked writable: :class:`BadDir` if not, so a
    mistyped or unwritable ``--dir`` (``/proc/nope``) ends in one line, not a traceback mid-run."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise BadDir(f"--dir {path}: exists and is not a directory") from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise BadDir(f"--dir {path}: cannot create it: {exc.strerror or exc}{where}") from None
    try:  # a probe, not os.access: root passes os.access on a read-only mount
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise BadDir(f"--dir {path}: cannot write there: {exc.strerror or exc}") from None
    return path


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
    # Directory and port first, vLLM after: importing vLLM (and torch) takes 10-20 s, and a bad --dir or a
    # taken port must not wait for that. Else our sidecar dies on the bound port while the other one answers /healthz,
    # and the summary is checked against a sidecar that never reads this demo's directory.
    try:
        directory = prepare_dir(Path(args.dir)) if args.dir else Path(tempfile.mkdtemp(prefix="kvobs-demo-"))
    except BadDir as exc:
        print(f"kvobs demo: {exc}", file=sys.stderr)
        return 2
    if _port_in_use(args.port):
        print(f"kvobs demo: port {args.port} is in use (another kvobs sidecar, e.g. the compose stack?); "
              "pass --port", file=sys.stderr)
        return 2
    url = f"http://127.0.0.1:{args.port}"
    console = Console()
    console.line(f"kvobs demo: starting the sidecar on 127.0.0.1:{args.port} and loading vLLM "
                 "(importing vLLM and torch takes 10-20 s) ...")
    sidecar = _start_sidecar(directory, args.port)  # it starts while vLLM loads
    try:
        started = time.monotonic()
        with stops_deferred():  # a stop signal during these imports ends the demo after them
            from vllm import __version__ as vllm_version

            from demo.workload import Workload

        # The demo prints each message itself; vLLM's own warnings (e.g. a prompt too long to
        # store in the small CPU tier) would bury them. After the import: vLLM sets its level then.
        logging.getLogger("kvobs").setLevel(logging.CRITICAL)
        logging.getLogger("vllm").setLevel(logging.ERROR)
        console.line(f"kvobs demo: vLLM {vllm_version} loaded in {time.monotonic() - started:.1f} s")
        _wait_until_up(sidecar, url, directory)
        # A reused directory: the sidecar counts its earlier runs too. Its counts before this run are
        # subtracted, so the summary checks and prints this run's figures (it says so).
        before = _settled_totals(url)
        run_started = time.time()
        console.line(f"kvobs demo on vLLM {vllm_version}: the real OffloadingConnectorScheduler and offload managers, "
                     "on CPU")
        console.line(f"  sidecar:  {url}/metrics   kvobs directory: {directory}")
        otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        console.line(f"  traces:   {'OTLP to ' + otlp if otlp else 'not exported (set OTEL_EXPORTER_OTLP_ENDPOINT)'}")
        workload = Workload(requests=args.requests, seed=args.seed, duration_s=args.duration)
        with open(directory / DEMO_LOG, "w", encoding="utf-8") as log:
            demo_log = DemoLog(log)
            runs = [_run_one(setup, workload, directory, console, demo_log) for setup in _engine_setups(args)]
        _summary(console, runs, url, directory, before)
        for line in where_to_look(url, directory, run_started):
            console.line(line)
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


def _run_one(setup: EngineSetup, workload: Workload, directory: Path, console: Console,
             demo_log: DemoLog) -> EngineRun:
    from demo.workload import run_engine
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
        demo_log.write(text)
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


def _summary(console: Console, runs: list[EngineRun], url: str, directory: Path, before: dict[str, float]) -> None:
    from demo.workload import READ_BACK_LABEL

    console.line("\nsummary")
    for run in runs:
        console.line(f"  {run.setup.engine} ({run.setup.spec}): {run.requests} requests in {run.seconds:.1f}s")
        console.line(f"    evicted chunks: {_nonzero(run.evicted)}")
        # every figure that is not 0, and the read-back share always: 0 there is the finding (pure write waste)
        shown = ", ".join(f"{k} {v}" for k, v in run.tier.items() if v or k == READ_BACK_LABEL)
        console.line(f"    the CPU tier, in chunks: {shown}")
        console.line(f"    near misses (hits evicted before their load): {_nonzero(run.near_misses)}")
        console.line(f"    failed loads by cause: {_nonzero(run.failures)}")
        if run.setup.incident:
            console.line(f"    removal batches by call: {_nonzero(run.removals_by_path)}")
    expected = {
        "kvobs_evicted_chunks": sum(sum(r.evicted.values()) for r in runs),
        "kvobs_load_failures": sum(sum(r.failures.values()) for r in runs),
        "kvobs_hits_evicted_before_load": sum(sum(r.near_misses.values()) for r in runs),
    }
    earlier_runs = any(before.values())

    def this_run(seen: dict[str, float]) -> dict[str, float]:
        return {name: seen[name] - before[name] for name in seen}

    deadline = time.monotonic() + 10
    seen = _sidecar_totals(url)
    while this_run(seen) != expected and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = _sidecar_totals(url)
    counted = this_run(seen)
    figures = (f"{int(counted['kvobs_evicted_chunks'])} evicted, {int(counted['kvobs_load_failures'])} failed loads, "
               f"{int(counted['kvobs_hits_evicted_before_load'])} near misses")
    if counted != expected:
        console.line(f"  the sidecar DISAGREES on this run (sidecar {counted}, engines {expected})")
    elif earlier_runs:
        console.line(f"  the sidecar agrees on this run: {figures} (its counts before this run, from earlier runs "
                     "in this directory, subtracted)")
    else:
        console.line(f"  the sidecar agrees: {figures}")
    if earlier_runs:
        console.line(f"  the sidecar in all, with the earlier runs: {int(seen['kvobs_evicted_chunks'])} evicted, "
                     f"{int(seen['kvobs_load_failures'])} failed loads, "
                     f"{int(seen['kvobs_hits_evicted_before_load'])} near misses")


def _settled_totals(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The sidecar's totals once two reads a poll apart agree: a reused directory's journals can take more than
    the first ingest round (/healthz answers after it), and a count read too early would be counted as this run's."""
    from kvobs.sidecar.ingest import POLL_S

    deadline = time.monotonic() + timeout
    seen = _sidecar_totals(url)
    while time.monotonic() < deadline:
        time.sleep(2 * POLL_S)
        again = _sidecar_totals(url)
        if again == seen:
            break
        seen = again
    return seen


DEMO_LOG = "demo.log"
"""This run's failed loads, one line each as vLLM's log carries them (``AssertionError: <message>``), for
``kvobs explain``; rewritten by each run."""
DEMO_LOG_LINES = 1_000
"""Lines the demo log holds at most."""


class DemoLog:
    """The demo's stand-in for vLLM's log: what ``kvobs explain`` reads, bounded by ``DEMO_LOG_LINES``."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.lines = 0

    def write(self, message: str) -> None:
        if self.lines < DEMO_LOG_LINES:
            self.lines += 1
            self.file.write("AssertionError: " + " ".join(message.splitlines()) + "\n")
            self.file.flush()


DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
"""The Grafana dashboards of a source checkout (the wheel ships none: kvobs/assets.py may)."""


def where_to_look(url: str, directory: Path, run_started: float) -> list[str]:
    """The summary's pointers; each path printed exists when this is called (tests/integration/test_demo.py
    checks): a hint at a file the demo never wrote sends a new operator nowhere."""
    lines = ["", "where to look", f"  metrics:          {url}/metrics"]
    failures = directory / FAILURES_DIR
    reports = report_files(failures) if failures.is_dir() else []
    if reports:
        this_run = sum(1 for path in reports if (report_time_ms(path.stem) or 0) >= run_started * 1000)
        mine = f", {this_run} from this run" if this_run != len(reports) else ""
        lines.append(f"  failure reports:  {failures} ({len(reports)} files{mine}), {url}/api/v1/failures")
    else:
        lines.append(f"  failure reports:  none written (no load failed), {url}/api/v1/failures")
    log = directory / DEMO_LOG
    if log.is_file() and log.stat().st_size:
        lines.append(f"  explain a log:    kvobs explain {log} --dir {directory}   (the demo's log: this run's failed "
                     "loads, as vLLM's log has them)")
    else:
        lines.append("  explain a log:    kvobs explain VLLM_LOG --dir " f"{directory}   (this run had no failed load)")
    if DASHBOARDS.is_dir():
        lines.append(f"  dashboards:       {DASHBOARDS} (Grafana; see README, 'Dashboards, alerts, deployment')")
    else:
        lines.append("  dashboards:       the kvobs repository's dashboards/ (Grafana; README, 'Dashboards, alerts, "
                     "deployment')")
    return lines
