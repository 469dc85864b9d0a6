"""Overhead in context: the same engine steps through vLLM's real OffloadingConnectorScheduler.

``benchmarks.overhead`` replays only the manager's calls, the harshest
denominator (the bare managers are lean Python). Here the same seeded requests
(shared prefixes, real ``Request`` objects with vLLM's block hashes, made
before the clock starts) drive ``demo.driver.EngineStepDriver``
around the real connector scheduler, with the bare spec or the
``ObservedOffloadingSpec`` plugin wrapping it (no journal). Timed: scheduler-thread
CPU of the step loop: the connector's work, the manager's, and the driver's
stand-in for vLLM's ``Scheduler`` bookkeeping (a harness, so read the ratio as
"offloading work on the scheduler thread", not as a whole engine step).

Run: ``.venv/bin/python -m benchmarks.overhead_connector [--runs N]``.
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass
from typing import Any

os.environ.pop("KVOBS_DIR", None)

from vllm.v1.request import Request

from benchmarks._common import arg_parser, median, paired_ratios, print_table, spread, write_json
from demo.driver import EngineStepDriver, build_scheduler, make_request
from kvobs.vllm.modelless_config import BLOCK_SIZE

TARGET_RATIO = 1.05
SPECS = {"cpu": "CPUOffloadingSpec", "tiering": "TieringOffloadingSpec"}


def extra_config(spec: str, observed: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"spec_name": spec}
    if spec == "TieringOffloadingSpec":
        extra.update(secondary_tiers=[{"type": "example"}], tier_poll_interval_s=0)
    if observed:
        extra.update(spec_name="ObservedOffloadingSpec", spec_module_path="kvobs.vllm",
                     kvobs={"inner_spec": spec, "engine": "bench"})
    return extra


@dataclass(frozen=True)
class Plan:
    """Per step: new prompts (token lists) and their decode lengths."""

    arrivals: list[list[tuple[list[int], int]]]


def make_plan(steps: int, seed: int = 3) -> Plan:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(BLOCK_SIZE * rng.randrange(4, 24))] for _ in range(48)]
    arrivals = []
    for _ in range(steps):
        now = []
        for _ in range(rng.randint(0, 2)):
            prefix = prefixes[min(int(rng.paretovariate(1.2)) - 1, len(prefixes) - 1)]
            suffix = [rng.randrange(1000, 30000) for _ in range(rng.randrange(8, 200))]
            now.append((prefix + suffix, rng.randint(1, 24)))
        arrivals.append(now)
    return Plan(arrivals)


def run_once(plan: Plan, spec: str, observed: bool, num_chunks: int) -> tuple[float, int, int]:
    """Scheduler-thread CPU seconds for the plan; requests served; chunks evicted (observed side)."""
    scheduler, _spec, kv_cache_config = build_scheduler(extra_config(spec, observed), hybrid=False,
                                                        num_cpu_chunks=num_chunks)
    driver = EngineStepDriver(scheduler, kv_cache_config)
    requests: list[list[tuple[Request, int]]] = [
        [(make_request(f"r{s}-{i}", prompt), decode) for i, (prompt, decode) in enumerate(step)]
        for s, step in enumerate(plan.arrivals)
    ]  # vLLM hashes the blocks here, before the clock starts
    decode_left: dict[str, int] = {}
    served = 0
    gc.collect()
    gc.freeze()
    try:
        t0 = time.thread_time()
        for step in requests:
            for request, decode in step:
                decode_left[request.request_id] = decode
            driver.step([r for r, _ in step])
            driver.report_all_worker_jobs()
            for request in driver.running:
                decode_left[request.request_id] -= 1
                if decode_left[request.request_id] <= 0:
                    driver.finish(request)
                    served += 1
        driver.step()
        driver.report_all_worker_jobs()
        elapsed = time.thread_time() - t0
        observer = getattr(scheduler.manager, "observer", None)
        evicted = -1 if observer is None else sum(observer.evicted.values())
    finally:
        gc.unfreeze()
        scheduler.shutdown()
    return elapsed, served, evicted


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--managers", default="cpu,tiering")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 7)
    plan = make_plan(args.steps or (30 if args.quick else 1_200))
    num_chunks = 1_024
    results: dict[str, Any] = {"runs": runs, "steps": len(plan.arrivals), "num_cpu_chunks": num_chunks}
    rows = []
    for manager in args.managers.split(","):
        spec = SPECS[manager]
        run_once(plan, spec, True, num_chunks)  # warm
        bare: list[float] = []
        observed: list[float] = []
        served = {True: 0, False: 0}
        evicted = 0
        for run in range(runs):
            for side in (False, True) if run % 2 == 0 else (True, False):
                seconds, served[side], removed = run_once(plan, spec, side, num_chunks)
                (observed if side else bare).append(seconds)
                evicted = max(evicted, removed)
        assert served[True] == served[False], served
        ratio = median(paired_ratios(observed, bare))
        results[manager] = {"bare_s": bare, "observed_s": observed, "ratio": ratio, "requests": served[True],
                            "evicted_chunks": evicted}
        rows.append((manager, served[True], evicted, 1e3 * median(bare), spread(bare), 1e3 * median(observed),
                     spread(observed), ratio))
    print_table(f"Overhead through the real OffloadingConnectorScheduler ({len(plan.arrivals)} steps, "
                f"{runs} interleaved runs; scheduler-thread CPU; no journal)",
                ("manager", "requests", "evicted", "bare ms", "spread", "observed ms", "spread", "ratio"), rows)
    worst = max(results[m]["ratio"] for m in args.managers.split(","))
    print(f"\n  observed/bare <= {TARGET_RATIO}: worst {worst:.3f} -> {'MET' if worst <= TARGET_RATIO else 'MISSED'}")
    write_json(args.json, "overhead_connector", results)
    return results


if __name__ == "__main__":
    main()
