"""Adding an engine counter is its catalogue entry plus the line that counts it (docs/design.md, "Where to
change what"): done here in a scratch copy of kvobs, which then journals it and whose sidecar exports it."""

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
    sink.close()
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
