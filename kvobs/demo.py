"""``kvobs demo``: kvobs explaining failed loads on vLLM's real offload managers, on CPU.

Starts the sidecar, runs a shared-prefix workload under eviction pressure through
the CPU spec and the tiering spec (both plugged in as ``ObservedOffloadingSpec``),
makes a coverage mismatch and a promotion-evicts-hit failure happen, prints each
explanatory message, and ends with a summary and where to look.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def run_demo(args: argparse.Namespace) -> int:
    from kvobs.vllm.demo_workload import coverage_mismatch, observed_manager, promotion_evicts_hit, run_requests

    logging.getLogger("kvobs").setLevel(logging.CRITICAL)  # the demo prints each message itself
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvobs-demo-"))
    url = f"http://127.0.0.1:{args.port}"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "kvobs.cli", "serve", "--dir", str(directory), "--port", str(args.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    print(f"kvobs demo: sidecar at {url}/metrics, kvobs directory {directory}")
    specs = ["CPUOffloadingSpec"] if args.no_tiering else ["CPUOffloadingSpec", "TieringOffloadingSpec"]
    totals: dict[str, dict[str, int]] = {"evicted": {}, "near_misses": {}, "failures": {}}
    try:
        for index, spec in enumerate(specs):
            manager = observed_manager(spec, num_chunks=64 if index == 0 else 16,
                                       directory=str(directory), engine=f"dp{index}")

            def progress(done: int, spec: str = spec) -> None:
                if done % 50 == 0 or done == args.requests:
                    print(f"\r  {spec}: {done}/{args.requests} requests", end="", flush=True)

            shown: dict[str, int] = {}

            def explain(exc: AssertionError, shown: dict[str, int] = shown) -> None:
                cause = str(exc).split("cause: ", 1)[-1].split(" ", 1)[0]
                shown[cause] = shown.get(cause, 0) + 1
                if shown[cause] <= 1:
                    print(f"\n  vLLM would have died here; kvobs says:\n  AssertionError: {exc}\n")

            print(f"\n[{spec}] {args.requests} requests over shared prefixes, eviction pressure")
            run_requests(manager, args.requests, args.seed + index, progress, explain)
            print()
            scenario = coverage_mismatch if index == 0 else promotion_evicts_hit
            for exc in scenario(manager):
                print(f"\n  vLLM would have died here; kvobs says:\n  AssertionError: {exc}\n")
            obs = manager.observer
            counters = (("evicted", obs.evicted), ("near_misses", obs.near_misses), ("failures", obs.failures))
            for name, counter in counters:
                for label, value in counter.items():
                    totals[name][label] = totals[name].get(label, 0) + value
            manager.shutdown()
        time.sleep(1.5)  # let the sidecar read the journals
        reports = json.loads(_get(f"{url}/api/v1/failures"))["failures"]
        print("summary")
        print(f"  evicted chunks by reason: { {k: v for k, v in totals['evicted'].items() if v} }")
        print(f"  near misses (hits evicted before load): {sum(totals['near_misses'].values())}")
        print(f"  load failures by cause: { {k: v for k, v in totals['failures'].items() if v} }")
        print(f"  failure reports: {len(reports)} in {directory / 'failures'} and {url}/api/v1/failures")
        print(f"  metrics: {url}/metrics (dashboards: dashboards/, see README)")
        if args.keep_serving:
            print("  sidecar keeps serving; Ctrl-C to stop")
            sidecar.wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=10)
