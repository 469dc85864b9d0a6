"""vLLM's scheduler, timed: the CPU its steps take on EngineCore's thread (benchmarks/engine.py).

Loaded inside EngineCore with ``--scheduler-cls benchmarks.engine_scheduler.TimedScheduler``. A step's
scheduler work is ``schedule()`` plus ``update_from_output()``; the offloading connector's scheduler
side, and so every call kvobs taps, runs inside them. Each call adds its thread CPU time to three
int64 counters (CPU ns, steps, wall ns) in a small file named by ``KVOBS_BENCH_SCHEDULER_STATS``,
written in place (an mmap), so the benchmark reads them between runs at no cost to the engine. The
model's forward pass runs in the worker process and is not counted: its OpenMP threads are what
made whole-process figures too noisy to compare.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from benchmarks import engine_attribution

STATS_ENV = "KVOBS_BENCH_SCHEDULER_STATS"
# scheduler CPU ns, steps, scheduler wall ns; with KVOBS_BENCH_ATTRIBUTE (benchmarks/engine_attribution.py)
# also kvobs's and vLLM's exclusive ns in timed calls, timed calls, the journal thread's and the process's CPU ns
FIELDS = ("cpu_ns", "steps", "wall_ns", "kvobs_ns", "vllm_ns", "timed_calls", "journal_cpu_ns", "applier_cpu_ns",
          "process_cpu_ns")
LAYOUT = struct.Struct("<" + "q" * len(FIELDS))
ATTRIBUTING = bool(os.environ.get(engine_attribution.ATTRIBUTE_ENV))
if ATTRIBUTING:
    engine_attribution.install()  # before the scheduler builds the connector, its spec and kvobs's manager


def read_stats(path: str) -> dict[str, int]:
    with open(path, "rb") as f:
        return dict(zip(FIELDS, LAYOUT.unpack(f.read(LAYOUT.size)), strict=True))


class TimedScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ[STATS_ENV]
        with open(path, "wb") as f:
            f.write(bytes(LAYOUT.size))
        self._stats_file = open(path, "r+b")  # noqa: SIM115 - kept open for the engine's life
        self._stats = mmap.mmap(self._stats_file.fileno(), LAYOUT.size)
        self._cpu = self._steps = self._wall = 0

    def _add(self, cpu: int, wall: int, step: int) -> None:
        self._cpu += cpu
        self._wall += wall
        self._steps += step
        if ATTRIBUTING:
            attributed = (*engine_attribution.exclusive, sum(engine_attribution.calls),
                          engine_attribution.journal_thread_cpu_ns(), engine_attribution.applier_thread_cpu_ns(),
                          time.process_time_ns())
        else:
            attributed = (0, 0, 0, 0, 0, 0)
        LAYOUT.pack_into(self._stats, 0, self._cpu, self._steps, self._wall, *attributed)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        output = super().schedule(*args, **kwargs)
        self._add(time.thread_time_ns() - cpu, time.perf_counter_ns() - wall, 1)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        outputs = super().update_from_output(*args, **kwargs)
        self._add(time.thread_time_ns() - cpu, time.perf_counter_ns() - wall, 0)
        return outputs
