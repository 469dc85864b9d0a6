"""Issue 40: journals rotated by the real ``logrotate`` (Debian's), under a running engine and sidecar.

Operators run logrotate over every ``*.jsonl`` they find. With ``create`` the journal is renamed
(``<journal>.1``) and a new empty file made at its name: the engine writes on into the renamed file
through its open descriptor. Before the fix the sidecar never read the renamed file and froze at the
rotation (36 evictions served while the engine had made 116). With ``copytruncate`` the journal is copied
and cut to 0: the copy must not be read again. A journal cut to a size other than 0 (a copytruncate
race, an operator's ``truncate``) was read again from its start, and the residency samples of the part
kept counted twice. Each test drives a real observed vLLM CPU manager in its own process (a 64-chunk
tier: every store past 64 evicts one chunk) and a real ``kvobs serve``, and checks the sidecar's counts
against the evictions the engine made: nothing lost, nothing doubled, across a sidecar restart too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvobs.sidecar.ingest import CHECKPOINT, Ingest, file_key
from kvobs.wire.format import stem_of
from tests.reliability.test_reliability_issue31 import LiveEngine
from tests.support.services import Sidecar, wait_for
from tests.support.sidecar_input import scrape, write_engine

pytestmark = pytest.mark.slow

TIER_CHUNKS = 64
"""The live engine's CPU tier (tests/support/live_engine.py): the store of chunk 65 on evicts one each."""
LOGROTATE = shutil.which("logrotate") or next(
    (p for p in ("/usr/sbin/logrotate", "/sbin/logrotate") if os.access(p, os.X_OK)), None)


def evictions(url: str) -> tuple[float, float]:
    """(``kvobs_evicted_chunks_total``, ``kvobs_chunk_residency_seconds_count``) of capacity evictions, all
    engines: each evicted chunk has one residency sample, so a line read twice shows in the second."""
    values = scrape(url)
    counted = sum(v for (name, labels), v in values.items()
                  if name == "kvobs_evicted_chunks_total" and ("reason", "capacity") in labels)
    sampled = sum(v for (name, labels), v in values.items()
                  if name == "kvobs_chunk_residency_seconds_count" and ("reason", "capacity") in labels)
    return counted, sampled


def settled(url: str, expected: int) -> None:
    """The sidecar serves ``expected`` evictions and samples, and still does after more ingest rounds."""
    wait_for(lambda: evictions(url) == (expected, expected), timeout=15,
             what=f"{expected} evictions and residency samples on /metrics (served: {evictions(url)})")
    time.sleep(1.2)  # two more rounds: a file read again would count again
    assert evictions(url) == (expected, expected)


def rotate(directory: Path, mode: str) -> list[str]:
    """One forced rotation of every journal in the kvobs ``directory`` by logrotate, in ``mode`` (its config
    and state file beside the directory); the journal directory's names after."""
    assert LOGROTATE is not None
    conf = directory.parent / f"logrotate-{mode}.conf"
    conf.write_text(f"{directory / 'journal'}/*.jsonl {{\n  {mode}\n  rotate 5\n  missingok\n  nocompress\n}}\n")
    subprocess.run([LOGROTATE, "-f", "-s", str(directory.parent / "logrotate.state"), str(conf)],
                   check=True, capture_output=True, timeout=30)
    return sorted(p.name for p in (directory / "journal").iterdir())


@pytest.mark.tools
@pytest.mark.skipif(LOGROTATE is None, reason="needs Debian's logrotate (`make tools`: apt-get install logrotate)")
@pytest.mark.parametrize("mode", ["create", "copytruncate"])
def test_journals_rotated_by_logrotate_are_followed_with_nothing_lost_or_doubled(tmp_path: Path, mode: str) -> None:
    """Three rotations under a running engine and sidecar, one while the sidecar is down; the engine
    stores after each. ``create``: the renamed file is followed (the engine writes there), the new one
    at the old name read from its start. ``copytruncate``: the copy (a file never followed) is not read,
    the cut-back original is read again from 0. Each rotation comes once the sidecar has read the
    engine's evictions: the lines logrotate's own copytruncate race may lose are then totals lines only,
    which the next cumulative totals replace (docs/reliability.md, "Rotated journals")."""
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory).start()
    engine = LiveEngine(directory, engine="0", model_name="model-a")
    try:
        engine.say("store 100", "stored")
        settled(sidecar.url, 100 - TIER_CHUNKS)
        names = rotate(directory, mode)
        assert any(n.endswith(".jsonl.1") for n in names), names
        engine.say("store 80", "stored")
        settled(sidecar.url, 180 - TIER_CHUNKS)  # 36 before the fix in create mode
        rotate(directory, mode)
        engine.say("store 50", "stored")
        settled(sidecar.url, 230 - TIER_CHUNKS)
        sidecar.stop()  # its exit checkpoint holds each file's position by identity
        engine.say("store 20", "stored")
        time.sleep(0.6)  # the engine's writer flushes every 0.25 s: the evictions are in the file...
        names = rotate(directory, mode)  # ...and rotated before the sidecar is back
        assert any(n.endswith(".jsonl.3") for n in names), names
        sidecar = Sidecar(directory).start()
        settled(sidecar.url, 250 - TIER_CHUNKS)
        engine.say("store 10", "stored")
        engine.exit()
        settled(sidecar.url, 260 - TIER_CHUNKS)
    finally:
        engine.kill()
        sidecar.stop()


def test_a_journal_cut_to_a_size_other_than_0_counts_no_sample_twice(tmp_path: Path) -> None:
    """An operator's ``truncate`` (or a copytruncate race) keeps the start of the journal: the sidecar reads
    it again from its start, and the removal batches it had read are known by their serials. Before the
    fix their residency samples counted twice (counters were right: totals are cumulative)."""
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory).start()
    engine = LiveEngine(directory, engine="0", model_name="model-a")
    try:
        for command in ("store 70", "store 10", "store 10"):  # a flush each: several removals lines
            engine.say(command, "stored")
            time.sleep(0.6)
        settled(sidecar.url, 90 - TIER_CHUNKS)
        # The engine's totals lines (about 1.5 KB/s) grow the file back past the sidecar's offset after the cut;
        # a sidecar that looks only then, at a line end, does not see the cut (docs/reliability.md, "Known
        # limits"): a longer journal first leaves it several seconds to see it.
        time.sleep(3)
        (segment,) = (directory / "journal").iterdir()
        data = segment.read_bytes()
        removals = data.index(b'"k":"removals"')
        kept = data.index(b"\n", removals) + 1  # the first removals line is kept: read, and read again
        assert 0 < kept < len(data)
        os.truncate(segment, kept)
        engine.say("store 20", "stored")
        settled(sidecar.url, 110 - TIER_CHUNKS)
        assert any("cut back under the reader" in line for line in sidecar.log_lines())
        sidecar.stop()
        sidecar = Sidecar(directory).start()  # the serials it had read are in its checkpoint
        settled(sidecar.url, 110 - TIER_CHUNKS)
    finally:
        engine.kill()
        sidecar.stop()


def residency_samples(ingest: Ingest) -> int:
    return sum(sum(h.counts) for e in ingest.state.engines.values() for h in e.residency.values())


def test_a_checkpoint_keyed_by_name_is_taken_over_without_reading_anything_twice(tmp_path: Path) -> None:
    """A sidecar upgraded across issue 40 finds positions keyed by file name (two fields): each moves to
    the file at that name, and a rotated copy already there is taken as read (its lines came through the
    original); what the engine writes afterwards is read once, a copy of it included."""
    write_engine(tmp_path, "0", removals=5)
    first = Ingest(tmp_path)
    first.poll()
    assert residency_samples(first) == 5
    (segment,) = (tmp_path / "journal").iterdir()
    old = first.state.to_json()
    old["positions"] = {segment.name: [segment.stat().st_size, False]}  # as kvobs 0.2 wrote it
    (tmp_path / CHECKPOINT).write_text(json.dumps(old))
    shutil.copy(segment, f"{segment}.1")  # a copytruncate copy the old sidecar never read
    upgraded = Ingest(tmp_path)
    upgraded.poll()
    upgraded.poll()
    assert residency_samples(upgraded) == 5
    assert set(upgraded.state.positions) == {file_key(stem_of(p.name.removesuffix(".1")), p.stat())
                                             for p in (tmp_path / "journal").iterdir()}
    with segment.open("rb+") as f:  # the copy's truncate; then the engine writes on
        f.truncate(0)
    write_engine(tmp_path / "more", "0", removals=3)  # another writer run (same stem: this process's pid)
    (extra,) = (tmp_path / "more" / "journal").iterdir()
    segment.write_bytes(extra.read_bytes())
    shutil.copy(segment, f"{segment}.2")
    upgraded.poll()
    upgraded.poll()
    upgraded.checkpoint()
    restarted = Ingest(tmp_path)
    restarted.poll()
    assert residency_samples(upgraded) == residency_samples(restarted) == 8
