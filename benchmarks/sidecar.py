"""Sidecar: journal ingest rate and ``/metrics`` latency with 8 engines' worth of series.

Journals are written by kvobs's own ``JournalSink`` (the engine-side writer and
format), one per engine, from removal batches queued on the observer's recorder as the
policy taps queue them (36-byte keys over 4 KV groups, residency ages, request ids) plus a few
failure reports each.

* ingest: a fresh ``Ingest`` reads everything (``poll()`` until nothing is
  new); evicted keys per CPU second of the one ingest thread. Reference in the
  same run: reading the same files and ``json.loads`` of every line, nothing
  folded (the floor any JSON-lines reader pays).
* ``/metrics``: a real ``kvobs serve`` process on 127.0.0.1 over those 8
  engines; many sequential GETs on one keep-alive connection, median and p95,
  idle and while the 8 engines keep appending.

Run: ``.venv/bin/python -m benchmarks.sidecar [--runs N] [--requests N]``.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import arg_parser, median, paired_ratios, percentile, print_table, spread, write_json
from kvobs.codes import PATH_CODE, REASON_CODE
from kvobs.diagnosis import MISSING
from kvobs.journal import JournalSink
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from kvobs.sidecar.ingest import CHECKPOINT, Ingest
from kvobs.versions import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[1]
TARGET_KEYS_PER_S = 200_000
TARGET_METRICS_S = 0.050
ENGINES = 8
GROUPS = 4
REASONS = (0, 0, 0, 0, 1)  # capacity 4x as often as store_failed (kvobs.codes.REASONS)
PATHS = (0, 0, 1, 2)  # store, store, lookup, schedule_end (kvobs.codes.PATHS)


class Engine:
    """One engine's observer and its real journal writer."""

    def __init__(self, directory: Path, index: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.observer = Observer(Options(history_size=65_536, engine=f"dp{index}"))
        # A synthetic engine: the newest release.
        self.sink = JournalSink(directory, self.observer.options, SUPPORTED_VLLM[-1])
        self.observer.add_sink(self.sink)
        self.keys_written = 0

    def key(self) -> bytes:
        return self.rng.randbytes(32) + self.rng.randrange(GROUPS).to_bytes(4, "big")

    def evict(self, batches: int, batch_keys: tuple[int, int]) -> None:
        rng = self.rng
        for i in range(batches):
            keys = [self.key() for _ in range(rng.randint(*batch_keys))]
            residency = [rng.lognormvariate(1.0, 2.0) for _ in keys]
            self.observer.recorder.removal(  # queued and drained in runs, as the policy hook does
                keys, rng.choice(REASONS), residency, time.monotonic(), path=rng.choice(PATHS),
                req_id=f"req-{i // 4}",
            )
            self.keys_written += len(keys)
            if i % 8192 == 8191:
                self.sink.flush()  # keep under the queue bound, as the writer thread would

    def fail(self, count: int) -> None:
        """Failure reports: missing keys over every group, some never recorded."""
        for n in range(count):
            keys = [self.key() for _ in range(16)]
            self.observer.recorder.removal(keys[:12], REASON_CODE["capacity"], None, time.monotonic(),
                                           path=PATH_CODE["lookup"], req_id=f"req-x{n}")
            self.observer.drain()  # the removals are in the history before the diagnosis asks it
            unloadable = [Unloadable(k, i % GROUPS, 16 * (i + 1), MISSING) for i, k in enumerate(keys)]
            diagnosis = self.observer.load_failed("Chunk b'..' not found in cache", f"req-f{n}", 16,
                                                  (16, 256), unloadable, 0)
            self.observer.publish_failure(diagnosis, AssertionError(diagnosis.message))

    def close(self) -> None:
        self.sink.close()


def write_journals(directory: Path, keys_per_engine: int, batch_keys: tuple[int, int]) -> int:
    """Journals and reports for ENGINES engines; returns the evicted keys written."""
    import logging

    logger = logging.getLogger("kvobs")
    saved, logger.disabled = logger.disabled, True  # load_failed logs each message once
    try:
        mean = (batch_keys[0] + batch_keys[1]) / 2
        total = 0
        for e in range(ENGINES):
            engine = Engine(directory, e, seed=100 + e)
            engine.evict(int(keys_per_engine / mean), batch_keys)
            engine.fail(3)
            engine.close()
            total += engine.keys_written + 3 * 12
        return total
    finally:
        logger.disabled = saved  # the smoke tests import this module into the test session


# -- ingest --------------------------------------------------------------------------------


def ingest_once(directory: Path) -> tuple[float, int, int]:
    """(CPU s, records, evicted keys seen) for a fresh Ingest reading everything."""
    (directory / CHECKPOINT).unlink(missing_ok=True)
    t0 = time.thread_time()
    ingest = Ingest(directory)
    while True:
        before = dict(ingest.state.positions)
        ingest.poll()
        if ingest.state.positions == before:
            break
    cpu = time.thread_time() - t0
    keys = sum(int(t.get("evicted", {}).get(r, 0)) for e in ingest.state.engines.values()
               for t in [e.totals()] for r in ("capacity", "store_failed", "reset"))
    (directory / CHECKPOINT).unlink(missing_ok=True)
    return cpu, ingest.state.records, keys


def parse_only(directory: Path) -> float:
    """CPU s to read every journal line and json.loads it (no folding)."""
    t0 = time.thread_time()
    for path in sorted((directory / "journal").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            if line:
                json.loads(line)
    return time.thread_time() - t0


# -- /metrics ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()


def start_sidecar(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            status, body = get(conn, "/healthz")
            conn.close()
            if status == 200 and json.loads(body)["engines"] >= ENGINES:
                return proc, port
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kvobs serve did not come up with every engine")


def scrape_latencies(port: int, requests: int, accept: str | None = None) -> tuple[list[float], int, int]:
    """Seconds per GET /metrics on one keep-alive connection; (latencies, bytes, series)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Accept": accept} if accept else {}
    samples: list[float] = []
    body = b""
    try:
        for _ in range(requests):
            t0 = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers)
            response = conn.getresponse()
            body = response.read()
            samples.append(time.perf_counter() - t0)
            assert response.status == 200
    finally:
        conn.close()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return samples, len(body), series


class LiveEngines:
    """The 8 engines keep appending (~rate keys/s in all) while /metrics is scraped."""

    def __init__(self, directory: Path, keys_per_s: int) -> None:
        self.engines = [Engine(directory, e, seed=900 + e) for e in range(ENGINES)]
        self.keys_per_s = keys_per_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        batch = (1, 16)
        per_tick = max(1, int(self.keys_per_s / 8.5 / ENGINES / 20))  # 20 ticks a second
        while not self._stop.wait(0.05):
            for engine in self.engines:
                engine.evict(per_tick, batch)

    def __enter__(self) -> LiveEngines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for engine in self.engines:
            engine.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--keys-per-engine", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 5)
    keys_per_engine = args.keys_per_engine or (2_000 if args.quick else 50_000)
    requests = args.requests or (10 if args.quick else 300)
    results: dict[str, Any] = {"runs": runs, "engines": ENGINES, "groups": GROUPS}
    ingest_rows = []
    tmp = Path(tempfile.mkdtemp(prefix="kvobs-bench-sidecar-"))
    try:
        for label, batch_keys in (("1..16", (1, 16)), ("1..64", (1, 64))):
            directory = tmp / f"b{batch_keys[1]}"
            written = write_journals(directory, keys_per_engine, batch_keys)
            journal_bytes = sum(p.stat().st_size for p in (directory / "journal").glob("*.jsonl"))
            cpu: list[float] = []
            floor: list[float] = []
            records = keys = 0
            for run in range(runs):
                if run % 2:
                    floor.append(parse_only(directory))
                c, records, keys = ingest_once(directory)
                cpu.append(c)
                if not run % 2:
                    floor.append(parse_only(directory))
            assert keys == written, (keys, written)
            rate = keys / median(cpu)
            res = {
                "keys": keys, "records": records, "journal_bytes": journal_bytes, "cpu_s": cpu,
                "parse_only_s": floor, "keys_per_s": rate, "parse_only_keys_per_s": keys / median(floor),
                "ingest_over_parse": median(paired_ratios(cpu, floor)),
            }
            results[f"ingest_batches_{label}"] = res
            ingest_rows.append((label, keys, records, journal_bytes / 2**20, 1e3 * median(cpu), spread(cpu),
                                rate, keys / median(floor), res["ingest_over_parse"]))
        print_table(f"Sidecar ingest ({ENGINES} engines, {runs} runs; "
                    "keys/s = evicted keys per CPU second, one thread)",
                    ("batch keys", "keys", "records", "MiB", "cpu ms", "spread", "keys/s", "parse-only keys/s",
                     "ingest/parse"), ingest_rows)

        metric_rows = []
        directory = tmp / "b16"
        proc, port = start_sidecar(directory)
        try:
            scrape_latencies(port, 5)  # warm
            for label, accept in (("text", None), ("openmetrics", "application/openmetrics-text; version=1.0.0")):
                lat, size, series = scrape_latencies(port, requests, accept)
                results[f"metrics_idle_{label}"] = {"latencies_s": lat, "bytes": size, "series": series}
                metric_rows.append((f"idle, {label}", requests, series, size / 1024, 1e3 * median(lat),
                                    1e3 * percentile(lat, 95), 1e3 * max(lat)))
            live_rate = 2_000 if args.quick else 100_000
            with LiveEngines(directory, live_rate):
                time.sleep(0.5)
                lat, size, series = scrape_latencies(port, requests)
            results["metrics_live_text"] = {"latencies_s": lat, "bytes": size, "series": series,
                                            "keys_per_s_appended": live_rate}
            metric_rows.append((f"8 engines appending ~{live_rate:,} keys/s, text", requests, series, size / 1024,
                                1e3 * median(lat), 1e3 * percentile(lat, 95), 1e3 * max(lat)))
        finally:
            proc.terminate()
            proc.wait(timeout=15)
        print_table(f"GET /metrics on a real `kvobs serve` ({ENGINES} engines x {GROUPS} KV groups; "
                    "sequential keep-alive requests)",
                    ("case", "requests", "series", "KiB", "median ms", "p95 ms", "max ms"), metric_rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    worst_ingest = min(results[k]["keys_per_s"] for k in results if k.startswith("ingest_"))
    worst_p95 = max(percentile(results[k]["latencies_s"], 95) for k in results if k.startswith("metrics_"))
    print("\n  targets:")
    print(f"    ingest >= {TARGET_KEYS_PER_S:,} keys/s: worst {worst_ingest:,.0f} -> "
          f"{'MET' if worst_ingest >= TARGET_KEYS_PER_S else 'MISSED'}")
    print(f"    /metrics <= {1e3 * TARGET_METRICS_S:.0f} ms: worst p95 {1e3 * worst_p95:.1f} ms -> "
          f"{'MET' if worst_p95 <= TARGET_METRICS_S else 'MISSED'}")
    write_json(args.json, "sidecar", results)
    return results


if __name__ == "__main__":
    main()
