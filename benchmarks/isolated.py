"""Overhead with the garbage collector as a serving engine runs it: each side in a process of its own.

``benchmarks/overhead.py`` interleaves the sides in one process with the heap frozen, which is the
right tool for scheduler-thread CPU to the microsecond but hides the collector: a collection that
vLLM's allocations trigger walks every tracked object young enough, kvobs's pending captures among
them, and in one process a collection triggered on the bare side pays for kvobs's objects (issue 43).

Here each replay runs in a fresh interpreter, alternating sides (bare, observed, ...). The child
records the seeded trace, builds its side's manager, freezes what exists then (as vLLM freezes its
start-up heap, ``gc.freeze()`` in ``vllm/v1/engine/core.py``), and replays the trace with the
collector on. Each side therefore pays only for its own objects. Measured per replay: the scheduler
thread's CPU (``time.thread_time``), the process's CPU after kvobs's applier has applied everything
(``time.process_time``), and the collector's own wall time and collections (``gc.callbacks``).

Sides ending ``:held`` take kvobs's applier thread out (the observer is not served by it and its capture buffer
never fills during the replay): everything is applied after the replay, on this thread, and counted in the process
figure only. Their scheduler-thread figure is what the taps and their captures cost alone; the difference to the
side without ``:held`` is what applying beside vLLM's thread costs it (docs/performance.md, "Where the floor is").

Workloads: ``prefix`` (Zipf-shared prefixes of 4-64 chunks, a lookup per chunk: issue 43's shape) and
``trace`` (overhead.py's default scheduler model).

Run: ``.venv/bin/python -m benchmarks.isolated [--runs N] [--workload prefix,trace] [--json out.json]``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import arg_parser, median, paired_ratios, print_table, spread, write_json

WORKLOADS: dict[str, dict[str, Any]] = {
    "prefix": {"prefixes": 256, "prefix_chunks": (4, 64), "suffix_chunks": (1, 4), "decode_chunks": (1, 2),
               "num_chunks": 4_096, "max_running": 32, "steps": 3_000},
    "trace": {},
}
"""Knobs over ``benchmarks.overhead.Workload``'s defaults, by name."""
SIDES = ("bare", "observed", "observed+flight", "observed+journal")
FOLDED = ("evicted", "stored", "loaded")
"""Counters a replay reports, as the fold counted them (a held side must count what a served one does)."""
HELD = ":held"
"""Suffix of a side whose captures are all applied after the replay (the module's docstring)."""
TARGET_THREAD = 1.03
"""Scheduler thread, compiled, against the bare manager (issue 43; the flight recorder's side too)."""
TARGET_PROCESS = 1.10
"""Process CPU with the journal and the recorder (issue 43)."""


def child(side: str, manager: str, workload_name: str, journal_dir: str, steps: int | None) -> dict[str, Any]:
    """One replay in this process; what it measured."""
    os.environ.pop("KVOBS_DIR", None)
    from benchmarks import overhead

    knobs = dict(WORKLOADS[workload_name])
    if steps is not None:
        knobs["steps"] = steps
    workload = overhead.Workload(**knobs)
    trace = overhead.record(manager, workload)
    held = side.endswith(HELD)
    m = overhead.build(trace, side.removesuffix(HELD), Path(journal_dir))
    if held:
        hold_applier(m)
    contexts = [overhead.make_context(i, p) for i, p in enumerate(trace.positions)]
    calls = overhead.bind(m, trace.ops, contexts)
    sink = overhead._journal_sink(m)
    collector = {"s": 0.0, "n": 0, "t0": 0.0}

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            collector["t0"] = time.perf_counter()
        else:
            collector["s"] += time.perf_counter() - collector["t0"]
            collector["n"] += 1

    gc.collect()
    gc.freeze()  # start-up objects (the trace, the harness, vLLM's modules) are frozen, as vLLM freezes its own
    gc.callbacks.append(on_gc)
    p0, t0 = time.process_time(), time.thread_time()
    for call, args in calls:
        call(*args)
    t1 = time.thread_time()
    overhead.settle(m, sink)
    p1 = time.process_time()
    observer = getattr(m, "observer", None)
    gc.callbacks.remove(on_gc)
    errors = sum(observer.internal_errors.values()) if observer is not None else 0
    folded = {key: sum(observer.counts[key].values()) for key in FOLDED} if observer is not None else {}
    m.shutdown()
    return {"thread_s": t1 - t0, "process_s": p1 - p0, "gc_s": collector["s"], "collections": collector["n"],
            "calls": len(calls), "internal_errors": errors, "folded": folded}


def hold_applier(m: Any) -> None:
    """Keep kvobs's applier thread away from ``m``'s captures until :func:`overhead.settle` applies them all."""
    from kvobs.applier import APPLIER

    observer = m.observer
    APPLIER.forget(observer)
    observer.recorder._capture_limit = 1 << 40  # never full in a replay: nothing applied on vLLM's thread either


def run_child(side: str, manager: str, workload: str, journal_dir: Path, steps: int | None) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.isolated", "--child", side, "--manager", manager, "--workload", workload,
         "--journal-dir", str(journal_dir), *(["--steps", str(steps)] if steps is not None else [])],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default="prefix,trace")
    parser.add_argument("--manager", default="cpu")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--child", default=None, help=argparse_hidden())
    parser.add_argument("--journal-dir", default=None, help=argparse_hidden())
    parser.add_argument("--steps", type=int, default=None, help="scheduler steps per replay (default: the workload's)")
    args = parser.parse_args(argv)
    steps = 40 if args.quick and args.steps is None else args.steps
    if args.child:
        print(json.dumps(child(args.child, args.manager, args.workload, args.journal_dir, steps)))
        return {}
    runs = args.runs or (1 if args.quick else 7)
    sides = tuple(args.sides.split(","))
    results: dict[str, Any] = {"runs": runs, "manager": args.manager, "workloads": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvobs-isolated-") as tmp:
        for workload in args.workload.split(","):
            got: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
            for run in range(runs):
                order = sides if run % 2 == 0 else sides[::-1]  # alternate to cancel drift
                for side in order:
                    got[side].append(run_child(side, args.manager, workload, Path(tmp) / f"{workload}-{side}-{run}",
                                               steps))
            res: dict[str, Any] = {"replays": got}
            for side in sides:
                thread = paired_ratios([r["thread_s"] for r in got[side]], [r["thread_s"] for r in got["bare"]])
                process = paired_ratios([r["process_s"] for r in got[side]], [r["process_s"] for r in got["bare"]])
                res[side] = {"thread_ratio": median(thread), "thread_spread": spread(thread),
                             "process_ratio": median(process), "process_spread": spread(process)}
                rows.append((workload, side, got[side][0]["calls"], 1e3 * median([r["thread_s"] for r in got[side]]),
                             median(thread), spread(thread), median(process), spread(process),
                             1e3 * median([r["gc_s"] for r in got[side]]),
                             median([r["collections"] for r in got[side]]),
                             max(r["internal_errors"] for r in got[side])))
            results["workloads"][workload] = res
    from kvobs.hot_path_loader import HOT_PATH

    print_table(
        f"Isolated overhead ({args.manager} manager, {HOT_PATH} hot path): each side its own process, collector on "
        f"(start-up frozen), {runs} alternating runs (medians; ratio = median of paired ratios)",
        ("workload", "side", "calls", "thread ms", "thread ratio", "spread", "process ratio", "spread", "gc ms",
         "collections", "errors"),
        rows,
    )
    print(f"\n  targets (issue 43): scheduler thread <= {TARGET_THREAD} compiled, flight recorder on included; "
          f"process CPU with journal <= {TARGET_PROCESS}")
    results["hot_path"] = HOT_PATH
    write_json(args.json, "isolated", results)
    return results


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
