"""The wire across versions (docs/design.md, "Wire compatibility"): today's sidecar reads what kvobs 0.1.0
wrote exactly as 0.1.0's sidecar did, 0.1.0's sidecar reads what today's engine writes, and an engine
newer than both (a cause and a stage neither sidecar knows) keeps every counter moving at each.

The old side is kvobs 0.1.0 itself (tag ``v0.1.0``), kept as ``tests/fixtures/wire/kvobs-v0.1.0.tar.gz``
(``git archive v0.1.0 kvobs``) and run in its own process; the goldens are what it wrote
(``tests/fixtures/wire/make_goldens.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvobs.codes import CAUSES, PATHS, REASON_BITS, REASONS, STAGES
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.wire import format as wire_format
from kvobs.wire.decode import decode_record
from kvobs.wire.format import FROZEN_READER_LABELS, RECORD_FIELDS, TOTAL_LABELS, Totals, Unknown, Writer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "wire"
GOLDENS = FIXTURES / "v0.1.0"
SAMPLES = FIXTURES / "samples.py"
SCHEMA = FIXTURES / "schema.json"


@pytest.fixture(scope="module")
def kvobs_0_1_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose ``kvobs`` package is kvobs 0.1.0 (put it first on PYTHONPATH)."""
    root = tmp_path_factory.mktemp("kvobs-0.1.0")
    with tarfile.open(FIXTURES / "kvobs-v0.1.0.tar.gz") as tar:
        tar.extractall(root, filter="data")
    assert (root / "kvobs" / "__init__.py").read_text().count('__version__ = "0.1.0"') == 1
    return root


def sidecar_samples(kvobs_root: Path, directory: Path) -> dict[str, float]:
    """Every engine series the sidecar of the kvobs at ``kvobs_root`` exports from ``directory`` (its own process)."""
    env = {**os.environ, "PYTHONPATH": str(kvobs_root)}
    out = subprocess.run([sys.executable, str(SAMPLES), str(directory)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def _release_file(path: str) -> str:
    with tarfile.open(FIXTURES / "kvobs-v0.1.0.tar.gz") as tar:
        member = tar.extractfile(path)
        assert member is not None
        return member.read().decode()


FAMILIES_0_1_0 = frozenset(re.findall(r'MetricDef\(\s*"(\w+)"', _release_file("kvobs/metric_catalogue.py")))
"""The metric families kvobs 0.1.0 exported (its catalogue, from the kept release)."""
_CODES_0_1_0: dict[str, Any] = {}
exec(_release_file("kvobs/codes.py"), _CODES_0_1_0)  # pure data, stdlib only
NEW_LABEL_VALUES = (set(STAGES) - set(_CODES_0_1_0["STAGES"])) | (set(CAUSES) - set(_CODES_0_1_0["CAUSES"]))
"""Label values added since 0.1.0, whose zero series today's sidecar exports from the start."""


def as_of_0_1_0(samples: dict[str, float]) -> dict[str, float]:
    """The samples 0.1.0's sidecar could export: its families, and no zero series of a label value added
    since (a metric or label value added since is checked by its own tests)."""
    def family(sample: str) -> str:
        return re.sub(r"_(total|bucket|count|sum|created)$", "", sample.split("{", 1)[0])

    def new_and_zero(sample: str, value: float) -> bool:
        return value == 0 and any(f"={v}," in sample or f"={v}}}" in sample for v in NEW_LABEL_VALUES)

    kept = {k: v for k, v in samples.items() if family(k) in FAMILIES_0_1_0 and not new_and_zero(k, v)}
    assert kept, "no sample of a 0.1.0 family"
    return kept


def _copy(case: str, tmp_path: Path, *, checkpoint: bool) -> Path:
    into = tmp_path / case
    ignore = None if checkpoint else shutil.ignore_patterns("sidecar-state.json")
    shutil.copytree(GOLDENS / case, into, ignore=ignore)
    (into / "metrics.json").unlink()
    return into


# -- today's sidecar, yesterday's engine ---------------------------------------------------------


@pytest.mark.parametrize("case", ["demo", "edge"])
def test_todays_sidecar_reads_the_v0_1_0_goldens_as_the_v0_1_0_sidecar_did(case: str, tmp_path: Path) -> None:
    golden = json.loads((GOLDENS / case / "metrics.json").read_text())
    assert as_of_0_1_0(sidecar_samples(ROOT, _copy(case, tmp_path, checkpoint=False))) == golden
    assert any(v > 0 for k, v in golden.items() if k.startswith("kvobs_load_failures_total")) or case == "edge"


def test_todays_sidecar_resumes_from_a_v0_1_0_checkpoint(tmp_path: Path) -> None:
    """An upgraded sidecar starts from the checkpoint 0.1.0 left (every file read to its end): same series."""
    directory = _copy("demo", tmp_path, checkpoint=True)
    assert as_of_0_1_0(sidecar_samples(ROOT, directory)) == json.loads((GOLDENS / "demo" / "metrics.json").read_text())
    assert json.loads((directory / "sidecar-state.json").read_text())["unknown"] == []


# -- yesterday's sidecar, today's engine ---------------------------------------------------------


@pytest.mark.vllm
def test_the_v0_1_0_sidecar_reads_todays_engine_as_todays_sidecar_does(kvobs_0_1_0: Path, tmp_path: Path) -> None:
    """Today's engine on vLLM's real scheduler, connector and managers (the demo's CPU engine: coverage
    mismatches, capacity evictions); both sidecars export the same series from its journal and reports."""
    from demo.workload import CPU_ENGINE, Workload, run_engine

    failed: list[str] = []
    run = run_engine(CPU_ENGINE, Workload(requests=80, seed=5), str(tmp_path / "kvobs"), lambda _: None,
                     lambda exc, request: failed.append(request.request_id))
    assert failed and sum(run.evicted.values()) > 0
    directory = tmp_path / "kvobs"
    shutil.copytree(directory, tmp_path / "for-old")
    today, old = sidecar_samples(ROOT, directory), sidecar_samples(kvobs_0_1_0, tmp_path / "for-old")
    assert as_of_0_1_0(today) == old
    assert today["kvobs_load_failures_total{cause=coverage_mismatch,engine=dp0,model_name=kvobs/cpu-harness}"] \
        == len(failed)


# -- tomorrow's engine, both sidecars ------------------------------------------------------------

TOMORROW = textwrap.dedent('''
    """An engine of a later kvobs: one more cause and one more stage, counted, with today's counters."""
    import sys
    from kvobs.journal import JournalSink
    from kvobs.observer import Observer
    from kvobs.options import Options

    observer = Observer(Options(engine="dp7", model_name="m"))
    sink = JournalSink(sys.argv[1], observer.options)
    observer.add_sink(sink)
    rounds = int(sys.argv[2])
    observer.counts["failures"]["cause_of_tomorrow"] += 2 * rounds
    observer.counts["failures"]["evicted_after_lookup"] += rounds
    observer.counts["errors"]["stage_of_tomorrow"] += rounds
    observer.counts["near"]["capacity"] += 3 * rounds
    observer.close()  # the final counters pushed to the journal, which closes
''')


def _tomorrows_kvobs(tmp_path: Path) -> Path:
    """A scratch copy of today's kvobs with a cause and a stage no sidecar knows yet."""
    root = tmp_path / "tomorrow"
    shutil.copytree(ROOT / "kvobs", root / "kvobs", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    codes = root / "kvobs" / "codes.py"
    text = codes.read_text()
    text = text.replace('    "unknown",\n)', '    "unknown",\n    "cause_of_tomorrow",\n)', 1)
    text = text.replace('    "survive",\n)', '    "survive",\n    "stage_of_tomorrow",\n)', 1)
    codes.write_text(text)
    return root


def test_an_engine_newer_than_both_sidecars_keeps_every_counter_moving_at_each(
    kvobs_0_1_0: Path, tmp_path: Path
) -> None:
    tomorrow = _tomorrows_kvobs(tmp_path)
    directory = tmp_path / "kvobs"
    script = tmp_path / "tomorrow_engine.py"
    script.write_text(TOMORROW)
    env = {**os.environ, "PYTHONPATH": str(tomorrow)}
    first: dict[str, dict[str, float]] = {}
    for rounds in (1, 2):  # a second engine process later: every counter must move again
        subprocess.run([sys.executable, str(script), str(directory), str(rounds)], env=env, check=True, timeout=120)
        copy = tmp_path / f"read-{rounds}"
        shutil.copytree(directory, copy / "today")
        shutil.copytree(directory, copy / "old")
        today, old = sidecar_samples(ROOT, copy / "today"), sidecar_samples(kvobs_0_1_0, copy / "old")
        series = "{cause=%s,engine=dp7,model_name=m}"
        assert today["kvobs_load_failures_total" + series % "cause_of_tomorrow"] == 2 * (rounds + rounds - 1)
        assert today["kvobs_internal_errors_total{engine=dp7,model_name=m,stage=stage_of_tomorrow}"] == 2 * rounds - 1
        for samples in (today, old):  # 0.1.0's reader: every count it knows, the newer ones left aside
            assert samples["kvobs_load_failures_total" + series % "evicted_after_lookup"] == 2 * rounds - 1
            assert samples["kvobs_hits_evicted_before_load_total{engine=dp7,model_name=m,reason=capacity}"] \
                == 3 * (2 * rounds - 1)
        assert not any("tomorrow" in name for name in old)
        assert as_of_0_1_0({k: v for k, v in today.items() if "tomorrow" not in k}) == old
        first[str(rounds)] = today
    assert first["2"] != first["1"]


def test_a_sidecar_names_what_it_does_not_know_and_keeps_the_rest(tmp_path: Path) -> None:
    """A newer writer's field, counter map and record kind: the line's known parts are read, each unknown
    item is counted once in kvobs_sidecar_unknown_wire_items{what}, nothing counts as corrupt."""
    writer = Writer("dp0", 11, "r1", "m")
    head = {"e": writer.engine, "pid": writer.pid, "run": writer.run, "m": writer.model_name}
    lines = [
        head | {"k": "totals", "t": 5.0, "q": 1, "failures": {"unknown": 2}, "gpu_stalls": {"x": 4},
                "ext": {"errors": {"stage_of_tomorrow": 1}}, "weather": "fine", "hist_keys": 3, "hist_window": 1.0},
        head | {"k": "heartbeat", "t": 6.0},
        head | {"k": "hello", "t": 1.0, "version": "9.9", "vllm_version": "0.40.0", "hot_path": "python",
                "reason": "ok", "observing": True, "colour": "blue"},
    ]
    totals, beat, hello = (decode_record(line) for line in lines)
    assert isinstance(totals, Totals) and totals.counters == {"failures": {"unknown": 2.0},
                                                              "errors": {"stage_of_tomorrow": 1.0}}
    assert set(totals.unknown) == {"counter:gpu_stalls", "field:weather", "label_value:errors=stage_of_tomorrow"}
    assert isinstance(beat, Unknown) and beat.unknown == ("record_kind:heartbeat",)
    assert hello is not None and hello.unknown == ("field:hello.colour",)
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    (journal / "dp0-11.000000.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines * 2))
    ingest = Ingest(tmp_path)
    ingest.poll()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in KvobsCollector(ingest).collect()
               for s in f.samples}
    assert samples[("kvobs_sidecar_unknown_wire_items", (("what", "counter"),))] == 1
    assert samples[("kvobs_sidecar_unknown_wire_items", (("what", "field"),))] == 2
    assert samples[("kvobs_sidecar_unknown_wire_items", (("what", "record_kind"),))] == 1
    assert samples[("kvobs_sidecar_unknown_wire_items", (("what", "label_value"),))] == 1
    assert samples[("kvobs_sidecar_skipped_total", (("reason", "corrupt"), ("source", "journal")))] == 0
    identity = (("engine", "dp0"), ("model_name", "m"))
    assert samples[("kvobs_load_failures_total", (("cause", "unknown"), *identity))] == 2
    assert samples[("kvobs_internal_errors_total", (*identity, ("stage", "stage_of_tomorrow")))] == 1
    ingest.checkpoint()
    restarted = Ingest(tmp_path)  # the checkpoint keeps what was unknown
    assert restarted.state.unknown == ingest.state.unknown


def test_label_values_a_writer_adds_are_bounded_at_the_reader(tmp_path: Path) -> None:
    line = {"k": "totals", "e": "dp0", "pid": 1, "run": "r", "t": 1.0, "q": 1, "hist_keys": 0, "hist_window": 0,
            "failures": {f"cause_{i}": 1 for i in range(wire_format.MAX_LABEL_VALUES + 40)}}
    totals = decode_record(line)
    assert isinstance(totals, Totals)
    assert len(totals.counters["failures"]) == wire_format.MAX_LABEL_VALUES + 1
    assert totals.counters["failures"][wire_format.OTHER] == 40
    assert sum(totals.counters["failures"].values()) == wire_format.MAX_LABEL_VALUES + 40


# -- the format decision -------------------------------------------------------------------------


def wire_shape() -> dict[str, Any]:
    """What readers of the wire depend on. ``fixed``: the format version, each kind's fields (a totals line's
    counter maps aside), the kinds and the removals flags' codes. ``grown``: the label values of each totals
    map, and the causes and stages, which only ever grow (kvobs.wire.format.EXTENSION carries new ones)."""
    totals_maps = set(TOTAL_LABELS)
    return {
        "fixed": {
            "format": wire_format.FORMAT_VERSION,
            "record_fields": {kind: sorted(set(fields) - totals_maps) for kind, fields in RECORD_FIELDS.items()},
            "kinds": list(wire_format.KINDS), "reasons": list(REASONS), "reason_bits": REASON_BITS,
            "paths": list(PATHS),
        },
        "grown": {"totals": {key: list(values) for key, values in TOTAL_LABELS.items()},
                  "causes": list(CAUSES), "stages": list(STAGES)},
    }


def test_a_change_of_the_wire_comes_with_its_format_decision() -> None:
    """tests/fixtures/wire/schema.json is the wire as last decided (docs/design.md, "Wire compatibility").

    A new counter, cause, stage or reason label value needs no decision: every reader since 0.1.0 keeps
    reading (checked end to end above); only nothing may be removed or reordered. A change of the fixed
    shape fails here until it is decided: an added field or kind that readers may ignore is recorded by
    rewriting the file (``KVOBS_WRITE_WIRE_SCHEMA=1`` on this test); anything else (a field or kind removed
    or renamed, codes reordered, the flags' bits changed) needs a new ``FORMAT_VERSION`` with readers for both.
    """
    now = wire_shape()
    if os.environ.get("KVOBS_WRITE_WIRE_SCHEMA") == "1":
        SCHEMA.write_text(json.dumps(now, indent=1) + "\n")
    decided = json.loads(SCHEMA.read_text())
    for key in ("causes", "stages"):
        assert now["grown"][key][: len(decided["grown"][key])] == decided["grown"][key], f"{key}: removed or reordered"
    for key, values in decided["grown"]["totals"].items():
        assert now["grown"]["totals"].get(key, [])[: len(values)] == values, f"totals {key}: removed or reordered"
    if now["fixed"]["format"] == decided["fixed"]["format"]:
        fixed, was = now["fixed"], decided["fixed"]
        for key in ("reasons", "paths", "kinds"):
            assert fixed[key][: len(was[key])] == was[key], f"{key}: removed or reordered: a new FORMAT_VERSION"
        assert fixed["reason_bits"] == was["reason_bits"], "the flags' bits changed: a new FORMAT_VERSION"
        for kind, fields in was["record_fields"].items():
            assert set(fields) <= set(fixed["record_fields"].get(kind, ())), f"{kind}: a field removed: a new format"
    assert now["fixed"] == decided["fixed"], (
        "the wire's shape changed: an addition readers may ignore? record it with KVOBS_WRITE_WIRE_SCHEMA=1 "
        "(docs/design.md, 'Wire compatibility'); anything else needs a new FORMAT_VERSION")
    for key, frozen in FROZEN_READER_LABELS.items():  # history: what 0.1.0's reader takes stays known
        assert frozen <= set(TOTAL_LABELS[key]), key
