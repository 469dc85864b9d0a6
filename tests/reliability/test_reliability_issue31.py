"""Issue 31, classes 3, 4 and 5, as an operator meets them, each with real processes.

3. Two engines with the same label (two models on one node, both engine "0") in one ``KVOBS_DIR``:
   the second's start must not delete the first's live journal.
4. A journal that shrinks under a running ``kvobs serve`` (copy-truncate rotation, an operator's
   ``truncate``): the sidecar must read the engine's later lines, final totals included.
5. SIGHUP to ``kvobs serve`` (a closed terminal, ssh or tmux session): it must checkpoint on the way
   out, so that restarted it never serves a counter lower than before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import ROOT, Sidecar, clean_env, wait_for
from tests.support.sidecar_input import scrape

pytestmark = pytest.mark.slow


class LiveEngine:
    """tests/support/live_engine.py as a process: a real observed vLLM manager that stores when told."""

    def __init__(self, directory: Path, **options: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.live_engine", str(directory), json.dumps(options)],
            cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.expect("ready")

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == word, f"the engine said {line!r}, not {word!r}"

    def say(self, command: str, answer: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        self.expect(answer)

    def exit(self) -> None:
        self.say("exit", "done")
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def stored(url: str, model: str, engine: str = "0") -> float:
    """``kvobs_stored_chunks_total`` of one engine (all tiers) on the sidecar's /metrics."""
    return sum(value for (name, labels), value in scrape(url).items()
               if name == "kvobs_stored_chunks_total" and ("model_name", model) in labels
               and ("engine", engine) in labels)


@pytest.mark.parametrize("kept", [0, 1])
def test_a_second_engine_with_the_same_label_keeps_the_first_ones_live_journal(tmp_path: Path, kept: int) -> None:
    """Two models on one node, both engine "0", one directory. The second engine's start prunes its
    label's earlier processes' journals; the first engine is alive, so its journal must stay, and
    everything it does afterwards must reach the sidecar. Before the fix, with ``journal_processes``
    0 (or ``kept`` dead processes of that label besides) the first engine's live segment was deleted:
    its later stores and its final totals were never read."""
    sidecar = Sidecar(tmp_path).start()
    engines: list[LiveEngine] = []
    try:
        for _ in range(kept):  # earlier processes of label "0", dead now (a crash loop's leftovers)
            dead = LiveEngine(tmp_path, engine="0", model_name="model-old", journal_processes=kept)
            dead.say("store 1", "stored")
            dead.exit()
        first = LiveEngine(tmp_path, engine="0", model_name="model-a", journal_processes=kept)
        engines.append(first)
        first.say("store 3", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 3, what="the first engine's stores on /metrics")
        second = LiveEngine(tmp_path, engine="0", model_name="model-b", journal_processes=kept)
        engines.append(second)
        first.say("store 4", "stored")
        second.say("store 2", "stored")
        first.exit()
        second.exit()
        wait_for(lambda: stored(sidecar.url, "model-a") == 7 and stored(sidecar.url, "model-b") == 2,
                 timeout=10, what="both engines' stores on /metrics")
        journals = sorted(p.name for p in (tmp_path / "journal").iterdir())
        assert len(journals) == 2 + kept, journals  # the two engines' and the newest `kept` dead ones
    finally:
        for engine in engines:
            engine.kill()
        sidecar.stop()
