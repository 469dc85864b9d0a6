"""The sidecar absent, killed (SIGKILL) and restarted mid-run; journals truncated and corrupted.

The engine is vLLM's real CPU manager wrapped by kvobs in this process; the sidecar
is ``kvobs serve`` in its own process, as in production. At the end the sidecar's
counters must equal the engine's true totals (the observer's own counters), and
the residency histogram count must equal the chunks removed: a batch record read
twice after a restart, or lost, would show there.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvobs.codes import REASONS
from kvobs.journal import FLUSH_EVERY_S
from kvobs.observer import Observer
from kvobs.sidecar.ingest import CHECKPOINT, CHECKPOINT_EVERY_S
from tests.support.faults import churn, observed_cpu, same_failure_as_bare
from tests.support.services import Sidecar, http_get, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    status, _, body = http_get(f"{url}/metrics")
    assert status == 200
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """A series's value; an engine's series also carries ``model_name`` (none served here)."""
    if "engine" in labels:
        labels = {"model_name": "", **labels}
    return samples.get((name, frozenset(labels.items())))


def expected(obs: Observer, engine: str) -> dict[str, float]:
    want: dict[str, float] = {}
    for reason in REASONS:
        want[f"evicted/{reason}"] = obs.evicted[reason]
        want[f"batches/{reason}"] = obs.batches[reason]
        want[f"residency/{reason}"] = obs.evicted[reason] if reason != "reset" else 0
    for cause, n in obs.failures.items():
        want[f"failures/{cause}"] = n
    return want


def seen(samples: Samples, engine: str) -> dict[str, float | None]:
    got: dict[str, float | None] = {}
    for reason in REASONS:
        got[f"evicted/{reason}"] = value(samples, "kvobs_evicted_chunks_total", engine=engine, reason=reason)
        got[f"batches/{reason}"] = value(samples, "kvobs_eviction_batches_total", engine=engine, reason=reason)
        got[f"residency/{reason}"] = value(
            samples, "kvobs_chunk_residency_seconds_count", engine=engine, reason=reason
        )
    for cause in ("evicted_after_lookup", "reset_after_lookup", "store_failed_after_lookup", "coverage_mismatch",
                  "store_in_flight", "unknown"):
        got[f"failures/{cause}"] = value(samples, "kvobs_load_failures_total", engine=engine, cause=cause)
    return got


@pytest.mark.slow
def test_sidecar_absent_killed_and_restarted_mid_run_ends_exact(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    manager = observed_cpu(dir=str(directory), engine="e0")
    sidecar: Sidecar | None = None
    stop = threading.Event()
    rounds = [0]

    def engine_loop() -> None:  # the engine keeps working whatever happens to the sidecar
        while not stop.is_set():
            churn(manager, 5, start=rounds[0], fail_every=3)
            rounds[0] += 5
            time.sleep(0.01)

    worker = threading.Thread(target=engine_loop, daemon=True)
    try:
        churn(manager, 30, fail_every=3)  # the sidecar is absent: the journal waits for it
        rounds[0] = 30
        worker.start()
        sidecar = Sidecar(directory).start()
        # Kill it only after it has checkpointed (every CHECKPOINT_EVERY_S) and read on past that
        # checkpoint: the restart then resumes from a saved state and saved offsets, and what was
        # read between the checkpoint and the kill must be read again exactly once.
        checkpoint = directory / CHECKPOINT
        wait_for(checkpoint.exists, timeout=CHECKPOINT_EVERY_S * 4, what="the sidecar's first checkpoint")
        time.sleep(0.5 + random.Random(7).random())
        assert sidecar.proc is not None
        sidecar.proc.kill()  # SIGKILL: no checkpoint on the way out
        sidecar.proc.wait(timeout=10)
        saved = json.loads(checkpoint.read_text())
        e0 = next(e for e in saved["engines"] if e["engine"] == "e0")
        saved_residency = sum(sum(h["counts"]) for h in e0["residency"].values())
        assert saved_residency > 0 and any(position[0] > 0 for position in saved["positions"].values())
        time.sleep(1.0)
        sidecar = Sidecar(directory).start()  # restarts from that checkpoint
        time.sleep(1.0)
        stop.set()
        worker.join(timeout=30)
        same_failure_as_bare(manager)
        time.sleep(FLUSH_EVERY_S * 3)
        want = expected(manager.observer, "e0")
        assert want["evicted/store_failed"] > 0 and want["evicted/capacity"] > 1000
        wait_for(lambda: seen(scrape(sidecar.url), "e0") == want, timeout=30, what="exact totals after restart")
        assert saved_residency < want["residency/capacity"]  # the restart had more to read than the checkpoint held
    finally:
        stop.set()
        manager.shutdown()
        if sidecar is not None:
            sidecar.stop()


def corrupt_journal(path: Path) -> int:
    """Insert bad lines between good ones and cut the last line in half; returns the bad lines added."""
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 6
    bad = [
        b"not json at all\n",
        b"\xff\xfe\x00garbage bytes \x80\x81\n",
        b"[1, 2, 3]\n",
        b'{"k": "totals"}\n',  # no engine
        b'{"k": "totals", "e": "e1", "pid": 1, "evicted": {"capacity": "lots"}}\n',  # ill-typed
        b'{"k": "batch", "e": "e1", "res": ["x"]}\n',
        b'{"k": "totals", "e": "e1", "pid": "one"}\n',
        b"\n",
        b'{"k": "batch", "e": "e1", "t": 1, "r": "capacity", "res": [0.1],\n',  # cut mid-record
    ]
    out = lines[:2] + bad + lines[2:-1]
    last = lines[-1]
    out.append(last[: len(last) // 2])  # truncated mid-line (the writer died mid-append)
    path.write_bytes(b"".join(out))
    return len(bad) - 1  # the empty line is skipped, not counted


def test_truncated_and_corrupted_journals_are_skipped_counted_and_totals_stay_exact(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    truths = {}
    for engine in ("e0", "e1"):
        manager = observed_cpu(dir=str(directory), engine=engine)
        churn(manager, 40, fail_every=4)
        same_failure_as_bare(manager)
        time.sleep(FLUSH_EVERY_S * 3)  # a totals record with the final values, before the last one
        truths[engine] = expected(manager.observer, engine)
        manager.shutdown()
    (journal,) = [p for p in (directory / "journal").glob("e1-*.jsonl")]
    bad_lines = corrupt_journal(journal)
    huge = directory / "journal" / "e9-1.000000.jsonl"  # one 9 MiB "line", then a good record
    good = json.dumps({"k": "hello", "e": "e9", "pid": 1, "run": "r", "t": 1.0, "version": "x"}).encode()
    huge.write_bytes(b"x" * (9 * 2**20) + b"\n" + good + b"\n")
    sidecar = Sidecar(directory).start()
    try:
        diff: dict[str, object] = {}

        def settled() -> bool:
            samples = scrape(sidecar.url)
            for e in truths:
                got = seen(samples, e)
                diff[e] = {k: (v, truths[e][k]) for k, v in got.items() if v != truths[e][k]}
            engines = {dict(labels).get("engine") for _, labels in samples}
            return not any(diff.values()) and "e9" in engines

        wait_for(settled, timeout=30, what=f"exact totals despite corrupt lines {diff}")
        samples = scrape(sidecar.url)
        corrupt = value(samples, "kvobs_sidecar_skipped_total", source="journal", reason="corrupt")
        assert corrupt is not None and corrupt >= bad_lines + 1, corrupt
        assert http_get(f"{sidecar.url}/healthz")[0] == 200
        assert http_get(f"{sidecar.url}/api/v1/failures")[0] == 200
    finally:
        sidecar.stop()
