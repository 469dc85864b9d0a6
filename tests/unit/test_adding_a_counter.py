"""Adding an engine counter is its catalogue entry plus the line that counts it (docs/design.md, "Where to
change what"): done here in a scratch copy of kvobs, which then journals it and whose sidecar exports it.

Twice: a counter the observer counts, and one the recorder's fold counts from what the taps captured on vLLM's
thread (issue 43, item 2), driven by vLLM's real CPU manager. If a counter needed a third place (an if/elif in
the observer, a list in the journal, the sidecar), the count of changed files, the value or the export fails."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ENTRY = '''    MetricDef("kvobs_scratch_widgets", "counter", ("kind",), "Widgets, by kind (a counter added in a test).",
              values=("round", "square"), totals="widgets", counted="Observer.internal_error (a test's)"),
'''
COUNTING_LINE = '        self.counts["widgets"]["round"] += 1\n'

ENGINE_AND_SIDECAR = textwrap.dedent('''
    import sys
    from pathlib import Path
    from kvobs.journal import JournalSink
    from kvobs.observer import Observer
    from kvobs.options import Options
    from kvobs.sidecar.ingest import Ingest
    from kvobs.sidecar.metrics import KvobsCollector

    observer = Observer(Options(engine="dp0", model_name="m"))
    sink = JournalSink(sys.argv[1], observer.options)
    observer.add_sink(sink)
    for _ in range(3):
        observer.internal_error("journal", RuntimeError("a test's"))
    observer.close()  # drains, pushes the counters to the sinks, closes them
    ingest = Ingest(Path(sys.argv[1]))
    ingest.poll()
    for family in KvobsCollector(ingest).collect():
        for sample in family.samples:
            if sample.name.startswith("kvobs_scratch_widgets"):
                print(sample.name, sample.labels["kind"], float(sample.value))
''')


def _changed_files(left: Path, right: Path) -> list[str]:
    """Files that differ between two trees (added, removed or changed), relative to them."""
    compare = filecmp.dircmp(left, right, ignore=["__pycache__"])
    out: list[str] = []
    stack = [(compare, Path())]
    while stack:
        node, at = stack.pop()
        out += [str(at / name) for name in node.left_only + node.right_only + node.diff_files]
        stack += [(sub, at / name) for name, sub in node.subdirs.items()]
    return sorted(out)


def test_a_new_counter_is_its_catalogue_entry_and_its_counting_line(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "kvobs", scratch / "kvobs", ignore=ignore)
    catalogue = scratch / "kvobs" / "metric_catalogue.py"
    text = catalogue.read_text()
    anchor = '    MetricDef("kvobs_history_chunks"'
    assert text.count(anchor) == 1
    catalogue.write_text(text.replace(anchor, ENTRY + anchor))
    observer = scratch / "kvobs" / "observer.py"
    text = observer.read_text()
    anchor = "        errors[stage] += 1\n"
    assert text.count(anchor) == 1
    observer.write_text(text.replace(anchor, anchor + COUNTING_LINE))

    shutil.copytree(ROOT / "kvobs", tmp_path / "original", ignore=ignore)
    assert _changed_files(tmp_path / "original", scratch / "kvobs") == ["metric_catalogue.py", "observer.py"]

    script = tmp_path / "engine_and_sidecar.py"
    script.write_text(ENGINE_AND_SIDECAR)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "kvobs")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(scratch)}, timeout=120, check=True)
    assert sorted(out.stdout.splitlines()) == ["kvobs_scratch_widgets_total round 3.0",
                                               "kvobs_scratch_widgets_total square 0.0"], out.stderr


# A counter the recorder's fold counts: one row, one line in the fold of a request's finish (kvobs/hot_path.py).
ROW_BEFORE = '''    MetricDef("kvobs_internal_errors", "counter",'''
ROW = '''    MetricDef("kvobs_finished_requests", "counter", (), "Requests vLLM's manager was told finished.",
              totals="finished", part="requests", counted="Recorder.apply (kvobs/hot_path.py)"),
'''
FOLD_BEFORE = '''                    self.promises.finished(req_id)
'''
FOLD = '''                    self.counts["finished"]["requests"] += 1
'''

ENGINE = r'''
import sys
from pathlib import Path

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from tests.support.vllm_env import cpu_extra, create_manager, key

copy, directory = Path(sys.argv[1]), Path(sys.argv[2])
assert Path(kvobs.__file__).parent == copy, kvobs.__file__  # the copy, not the repository's kvobs
m = kvobs.observe(create_manager(cpu_extra(64)), dir=str(directory), engine="e0", flight_calls=0)
for i in range(5):
    context = ReqContext(req_id=f"r{i}")
    m.on_new_request(context)
    m.lookup(key(i), context)
    m.on_request_finished(context)
assert m.observer.counter("finished") == {"requests": 5}, m.observer.counter("finished")
m.shutdown()  # the journal's last totals line
ingest = Ingest(directory)
ingest.poll()
registry = CollectorRegistry(auto_describe=False)
registry.register(KvobsCollector(ingest))
print(generate_latest(registry).decode())
'''


def _insert_before(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, f"{path.name} no longer has the place this test adds to: {anchor!r}"
    path.write_text(source.replace(anchor, text + anchor))


def test_a_new_counter_is_one_catalogue_row_and_one_fold_line_end_to_end(tmp_path: Path) -> None:
    copy = tmp_path / "src" / "kvobs"
    shutil.copytree(ROOT / "kvobs", copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "_assets"))
    pristine = tmp_path / "pristine"
    shutil.copytree(copy, pristine)
    _insert_before(copy / "metric_catalogue.py", ROW_BEFORE, ROW)
    _insert_before(copy / "hot_path.py", FOLD_BEFORE, FOLD)
    assert _changed_files(pristine, copy) == ["hot_path.py", "metric_catalogue.py"]

    env = {**os.environ, "KVOBS_PURE_PYTHON": "1",  # the copy's sources: nothing of it is compiled
           "PYTHONPATH": os.pathsep.join([str(copy.parent), str(ROOT)])}
    env.pop("KVOBS_DIR", None)
    run = subprocess.run([sys.executable, "-c", ENGINE, str(copy), str(tmp_path / "dir")], env=env,
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    exported = [line for line in run.stdout.splitlines() if line.startswith("kvobs_finished_requests_total{")]
    assert exported == ['kvobs_finished_requests_total{engine="e0",model_name=""} 5.0'], run.stdout[-3000:]
