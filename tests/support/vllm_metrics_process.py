"""Stands in for vLLM's API server's /metrics: vLLM's own ``vllm:kv_offload_*`` series, for real.

vLLM's API server needs a model and a GPU; its offload metrics do not. This process runs the
real ``OffloadingConnectorScheduler`` with the kvobs plugin around ``TieringOffloadingSpec``
(``demo.driver``; traffic from ``demo.workload``), takes the
scheduler's real ``get_stats()`` every step, and records them with vLLM's own
``KVConnectorProm`` into prometheus_client's default registry, served over HTTP — what the API
server's stat logger does with the stats EngineCore sends it.

Simulated (the GPU worker cannot run here): the worker's job-completion reports, and the
transfer statistics in them (per job: one chunk's bytes loaded, two stored; 1 ms each).

Usage: python -m tests.support.vllm_metrics_process PORT [KVOBS_DIR]  (KVOBS_DIR: kvobs journals there for a sidecar)

With KVOBS_VLLM_METRICS=1 in the environment, the kvobs option ``vllm_metrics`` is on: kvobs's own
counters join vLLM's series as ``vllm:kv_offload_kvobs_*_total`` (kvobs/vllm/vllm_metrics.py).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time

from prometheus_client import start_http_server
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferStats

from demo.driver import EngineStepDriver, build_scheduler
from demo.workload import Traffic, Workload
from kvobs.vllm.modelless_config import make_vllm_config

MODEL = "kvobs/cpu-harness"


def main() -> None:
    port = int(sys.argv[1])
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("kvobs").setLevel(logging.CRITICAL)
    options: dict[str, object] = {"inner_spec": "TieringOffloadingSpec"}
    if len(sys.argv) > 2:
        options["dir"] = sys.argv[2]
    if os.environ.get("KVOBS_VLLM_METRICS") == "1":
        options["vllm_metrics"] = True
    extra = {
        "spec_name": "ObservedOffloadingSpec",
        "spec_module_path": "kvobs.vllm",
        "kvobs": options,
        "secondary_tiers": [{"type": "FlakyTier", "module_path": "tests.support.flaky_tier"}],
        "tier_poll_interval_s": 0,
    }
    scheduler, spec, kv_cache_config = build_scheduler(extra, hybrid=True, num_full_groups=1, num_cpu_chunks=12)
    prom = KVConnectorProm(make_vllm_config(extra), ["model_name", "engine"], {0: [MODEL, "0"]})
    start_http_server(port, addr="127.0.0.1")
    driver = EngineStepDriver(scheduler, kv_cache_config, on_load_failure=lambda exc, request: None)
    rng = random.Random(7)
    traffic = Traffic(rng, Workload(), "v")
    chunk_bytes = spec.config.worker_kv_bytes_per_block
    print("serving", flush=True)
    while True:  # until the test stops the process
        requests = [traffic.next_request() for _ in range(rng.randint(0, 2))]
        driver.step(requests)
        jobs = driver.pending_job_ids
        stats = TransferStats()
        for _ in jobs:
            stats.store.record(2 * chunk_bytes, 0.001)
            stats.load.record(chunk_bytes, 0.001)
        driver.report_worker_jobs(jobs, transfer_stats=stats)
        for request in driver.running:
            if rng.random() < 0.3:
                driver.finish(request)
                traffic.finished(request)
        connector_stats = scheduler.get_stats()
        if connector_stats is not None and not connector_stats.is_empty():
            prom.observe(connector_stats.data, 0)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
